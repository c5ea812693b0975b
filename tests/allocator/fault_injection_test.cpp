// F1 of RELIABILITY.md for the allocator: fail the k-th upstream allocation call, for every k of a
// scenario and every tier. Each failure must end in a typed error naming the tier and the bytes,
// leave the allocator exactly as it was (live blocks, their contents, stats), and the same call
// must succeed once the fault is gone.
#include <cstring>
#include <vector>

#include "allocator/tiered_allocator.h"
#include "gtest/gtest.h"
#include "tests/allocator/test_util.h"

namespace strata::alloc {
namespace {

struct Live {
  Tier tier;
  void* ptr;
  std::size_t bytes;
  unsigned char fill;
};

// A scenario with growth in every tier: small and large blocks, frees that leave holes.
std::vector<std::size_t> scenario_sizes() {
  return {100, 3 * kMiB, 700 * kKiB, 9 * kMiB, 64, 2 * kMiB + 1, 20 * kMiB, 5000, 1 * kMiB};
}

// With run == 1 the pool's retry (after returning cached segments) absorbs the fault: the call
// succeeds and counts a retry. With run == 2 the retry fails too: a typed error.
class FaultInjectionTest : public ::testing::TestWithParam<int> {};

TEST_P(FaultInjectionTest, FailTheKthUpstreamCallInEveryTier) {
  const int run = GetParam();
  int injections = 0, errors = 0, retried = 0;
  for (Tier tier : kAllTiers) {
    for (std::int64_t k = 1;; ++k) {
      AllocatorOptions options;
      options.device = DeviceBackend::kSimulated;
      auto fault = std::make_unique<FaultInjectingUpstream>(
          tier == Tier::kGpu ? make_simulated_device_upstream({.capacity = kGiB})
                             : (tier == Tier::kPinnedHost ? make_simulated_pinned_upstream()
                                                          : make_pageable_host_upstream()));
      FaultInjectingUpstream* injector = fault.get();
      options.upstreams[tier_index(tier)] = std::move(fault);
      auto created = TieredAllocator::create(std::move(options));
      ASSERT_TRUE(created.ok());
      TieredAllocator& allocator = **created;
      injector->fail_allocate_calls(k, run);

      std::vector<Live> live;
      bool injected = false;
      int step = 0;
      for (std::size_t bytes : scenario_sizes()) {
        const TierStats before = allocator.stats(tier);
        const std::int64_t injected_before = injector->injected_failures();
        absl::StatusOr<void*> p = allocator.allocate(tier, bytes);
        if (p.ok() && injector->injected_failures() > injected_before) {
          // Absorbed by the retry: counted, and the block is good.
          injected = true;
          ++injections;
          ++retried;
          EXPECT_EQ(allocator.stats(tier).num_alloc_retries, before.num_alloc_retries + 1);
        }
        if (!p.ok()) {
          // The injected failure: a typed error naming tier and size, and nothing changed.
          injected = true;
          ++injections;
          ++errors;
          EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
          const std::string m(p.status().message());
          EXPECT_NE(m.find(str_cat("out of memory in tier ", tier_name(tier))), std::string::npos)
              << m;
          EXPECT_NE(m.find(str_cat("(", bytes, " bytes asked)")), std::string::npos) << m;
          EXPECT_NE(m.find("injected failure"), std::string::npos) << m;
          const TierStats after = allocator.stats(tier);
          EXPECT_EQ(after.allocated_bytes.current, before.allocated_bytes.current);
          EXPECT_EQ(after.active_blocks.current, before.active_blocks.current);
          EXPECT_LE(after.reserved_bytes.current, before.reserved_bytes.current);
          EXPECT_TRUE(allocator.pool(tier).validate().ok());
          for (const Live& l : live) {
            const auto* bytes_ptr = static_cast<const unsigned char*>(l.ptr);
            for (std::size_t i = 0; i < l.bytes; i += 997) {
              ASSERT_EQ(bytes_ptr[i], l.fill) << "live block changed by a failed call";
            }
          }
          // The fault is gone (one-shot): the same call now succeeds.
          p = allocator.allocate(tier, bytes);
          ASSERT_TRUE(p.ok()) << p.status();
        }
        const auto fill = static_cast<unsigned char>(step * 37 + 1);
        std::memset(*p, fill, bytes);
        live.push_back({tier, *p, bytes, fill});
        // Free every third block, leaving holes.
        if (++step % 3 == 0) {
          ASSERT_TRUE(allocator.deallocate(live.front().tier, live.front().ptr).ok());
          live.erase(live.begin());
        }
      }
      for (const Live& l : live) ASSERT_TRUE(allocator.deallocate(l.tier, l.ptr).ok());
      EXPECT_EQ(allocator.stats(tier).allocated_bytes.current, 0);
      if (!injected) break;  // k is past the scenario's last upstream call: every site was hit
    }
  }
  std::printf(
      "allocator fault sites: %d tiers, fault run %d, injections: %d (typed errors %d, successful "
      "retries %d), failures: %d\n",
      kNumTiers, run, injections, errors, retried, ::testing::Test::HasFailure() ? 1 : 0);
  EXPECT_GE(injections, 3 * 5);
  if (run == 1) {
    EXPECT_EQ(errors, 0);
  } else {
    EXPECT_EQ(retried, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Runs, FaultInjectionTest, ::testing::Values(1, 2));

TEST(FaultInjectionPersistentTest, PersistentUpstreamFailureIsReportedAndRecoverable) {
  AllocatorOptions options;
  options.device = DeviceBackend::kSimulated;
  auto fault = std::make_unique<FaultInjectingUpstream>(make_simulated_device_upstream());
  FaultInjectingUpstream* injector = fault.get();
  options.upstreams[tier_index(Tier::kGpu)] = std::move(fault);
  auto allocator = TieredAllocator::create(std::move(options));
  ASSERT_TRUE(allocator.ok());
  injector->fail_all_allocates();
  absl::StatusOr<void*> p = (*allocator)->allocate(Tier::kGpu, 4 * kMiB);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ((*allocator)->stats(Tier::kGpu).num_ooms, 1);
  EXPECT_EQ((*allocator)->stats(Tier::kGpu).num_alloc_retries, 1);
  EXPECT_EQ(injector->injected_failures(), 2);  // first try and the retry after freeing caches
  injector->disarm();
  p = (*allocator)->allocate(Tier::kGpu, 4 * kMiB);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE((*allocator)->deallocate(Tier::kGpu, *p).ok());
}

}  // namespace
}  // namespace strata::alloc
