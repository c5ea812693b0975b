// Expandable segments (See Note [Expandable segments] in allocator/block_pool_expand.cpp): a pool
// whose large blocks come from ranges that grow and shrink by mapping memory, on the simulated
// device (real host memory behind the mappings, so contents are checked too): a free block at the
// end is reused whatever the next size, changing shapes reserve about their peak, trim unmaps free
// memory anywhere in a range, stream events hold memory back from unmapping, and failed mappings
// change nothing.
#include <algorithm>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "allocator/block_pool.h"
#include "allocator/tiered_allocator.h"
#include "gtest/gtest.h"
#include "tests/allocator/test_util.h"

namespace strata::alloc {
namespace {

std::unique_ptr<Upstream> memory_device(std::size_t capacity = kGiB) {
  return make_simulated_device_upstream({.capacity = capacity});
}

class ExpandableTest : public ::testing::Test {
 protected:
  explicit ExpandableTest(std::size_t budget = kNoBudget)
      : ops_(std::make_shared<SimulatedStreamOps>()),
        pool_({.tier = Tier::kGpu, .budget = budget, .expandable = true}, memory_device(), ops_) {}
  void* alloc(std::size_t bytes, StreamHandle stream = nullptr) {
    absl::StatusOr<void*> p = pool_.allocate(bytes, {.stream = stream});
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : nullptr;
  }
  void free(void* p) { ASSERT_TRUE(pool_.deallocate(p).ok()); }
  void expect_valid() { EXPECT_TRUE(pool_.validate().ok()) << pool_.validate(); }
  std::int64_t reserved() const { return pool_.stats().reserved_bytes.current; }

  std::shared_ptr<SimulatedStreamOps> ops_;
  BlockPool pool_;
};

TEST_F(ExpandableTest, IsOnWhereTheUpstreamCanMap) {
  EXPECT_TRUE(pool_.expandable());
  BlockPool pageable({.tier = Tier::kPageableHost, .expandable = true},
                     make_pageable_host_upstream(), nullptr);
  EXPECT_FALSE(pageable.expandable()) << "pageable host memory has no ranges to map into";
}

TEST_F(ExpandableTest, AFreeBlockAtTheEndIsReusedWhateverTheNextSize) {
  void* a = alloc(10 * kMiB);
  void* b = alloc(20 * kMiB);
  EXPECT_EQ(static_cast<std::byte*>(b), static_cast<std::byte*>(a) + 10 * kMiB);
  free(b);
  void* c = alloc(30 * kMiB);  // larger than any free block: grows in place
  EXPECT_EQ(c, b);
  EXPECT_EQ(reserved(), static_cast<std::int64_t>(40 * kMiB));
  EXPECT_EQ(pool_.stats().segments.current, 1);
  expect_valid();
  free(a);
  free(c);
  expect_valid();
}

TEST_F(ExpandableTest, ChangingShapesReserveAboutTheirPeak) {
  // Steps of activations of a length drawn per step, freed in reverse with temporaries between:
  // fixed segments keep each step's sizes cached; one expandable range stays near the peak.
  std::mt19937_64 rng(testing::test_seed(17));
  // Every block above kSmallSize: small ones keep fixed segments (and would be cached here).
  std::uniform_int_distribution<std::size_t> length(5, 64);
  for (int step = 0; step < 20; ++step) {
    const std::size_t unit = length(rng) * 256 * kKiB;
    std::vector<void*> saved;
    for (int layer = 0; layer < 12; ++layer) {
      saved.push_back(alloc(4 * unit));
      void* temp = alloc(3 * unit);
      saved.push_back(alloc(unit));
      free(temp);
    }
    while (!saved.empty()) {
      free(saved.back());
      saved.pop_back();
    }
  }
  const TierStats s = pool_.stats();
  const double ratio =
      static_cast<double>(s.reserved_bytes.peak) / static_cast<double>(s.allocated_bytes.peak);
  std::printf("expandable: reserved peak / allocated peak %.4f (%lld maps)\n", ratio,
              static_cast<long long>(s.num_maps));
  EXPECT_LE(ratio, 1.01);
  expect_valid();
}

TEST_F(ExpandableTest, TrimUnmapsFreeMemoryAnywhereAndKeepsTheRest) {
  auto* a = static_cast<unsigned char*>(alloc(64 * kMiB));
  void* b = alloc(64 * kMiB);
  auto* c = static_cast<unsigned char*>(alloc(64 * kMiB));
  std::memset(a, 0xA5, 64 * kMiB);
  std::memset(c, 0x5A, 64 * kMiB);
  free(b);
  absl::StatusOr<std::size_t> trimmed = pool_.trim();
  ASSERT_TRUE(trimmed.ok()) << trimmed.status();
  EXPECT_EQ(*trimmed, 64 * kMiB) << "the free block in the middle is unmapped";
  EXPECT_EQ(reserved(), static_cast<std::int64_t>(128 * kMiB));
  EXPECT_GE(pool_.stats().num_unmaps, 1);
  expect_valid();
  void* again = alloc(64 * kMiB);  // maps the hole again
  EXPECT_EQ(again, b);
  EXPECT_EQ(reserved(), static_cast<std::int64_t>(192 * kMiB));
  EXPECT_TRUE(std::all_of(a, a + 64 * kMiB, [](unsigned char x) { return x == 0xA5; }));
  EXPECT_TRUE(std::all_of(c, c + 64 * kMiB, [](unsigned char x) { return x == 0x5A; }));
  free(a);
  free(again);
  free(c);
  ASSERT_TRUE(pool_.trim().ok());
  EXPECT_EQ(reserved(), 0);
  EXPECT_EQ(pool_.stats().segments.current, 0) << "a range with nothing mapped goes back";
  expect_valid();
}

TEST_F(ExpandableTest, MemoryBehindAStreamEventIsNotUnmapped) {
  int side = 0;
  void* a = alloc(8 * kMiB);
  void* b = alloc(8 * kMiB);
  ASSERT_TRUE(pool_.record_stream(b, &side).ok());
  ops_->hold();  // events stay pending until completed
  free(b);
  ASSERT_TRUE(pool_.trim().ok());
  EXPECT_EQ(reserved(), static_cast<std::int64_t>(16 * kMiB)) << "b's copy may still run";
  ops_->complete_all();
  ASSERT_TRUE(pool_.synchronize_pending().ok());
  ASSERT_TRUE(pool_.trim().ok());
  EXPECT_EQ(reserved(), static_cast<std::int64_t>(8 * kMiB));
  free(a);
  expect_valid();
}

TEST_F(ExpandableTest, StreamsGrowRangesOfTheirOwn) {
  int s1 = 0, s2 = 0;
  void* a = alloc(4 * kMiB, &s1);
  void* b = alloc(4 * kMiB, &s2);
  EXPECT_EQ(pool_.stats().segments.current, 2);
  free(a);
  void* c = alloc(4 * kMiB, &s2);
  EXPECT_NE(c, a) << "a block freed on one stream is not reused by another";
  free(b);
  free(c);
  expect_valid();
}

TEST(ExpandableBudgetTest, GrowingInPlaceStaysWithinTheBudgetWithoutRetries) {
  BlockPool pool({.tier = Tier::kGpu, .budget = 100 * kMiB, .expandable = true}, memory_device(),
                 std::make_shared<SimulatedStreamOps>());
  absl::StatusOr<void*> a = pool.allocate(60 * kMiB);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(pool.deallocate(*a).ok());
  absl::StatusOr<void*> b = pool.allocate(90 * kMiB);  // 60 free + 30 mapped: within 100
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(pool.stats().num_alloc_retries, 0);
  EXPECT_EQ(pool.stats().reserved_bytes.current, static_cast<std::int64_t>(90 * kMiB));
  absl::StatusOr<void*> c = pool.allocate(20 * kMiB);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(pool.deallocate(*b).ok());
  EXPECT_TRUE(pool.validate().ok()) << pool.validate();
}

TEST(ExpandableFaultTest, AFailedMappingChangesNothing) {
  auto faulty = std::make_unique<FaultInjectingUpstream>(memory_device());
  FaultInjectingUpstream* inject = faulty.get();
  BlockPool pool({.tier = Tier::kGpu, .expandable = true}, std::move(faulty),
                 std::make_shared<SimulatedStreamOps>());
  absl::StatusOr<void*> keep = pool.allocate(10 * kMiB);
  ASSERT_TRUE(keep.ok());
  // 200 MiB maps four extents (64, 64, 64, 8 MiB): fail each call in turn, retry defeated.
  for (std::int64_t k = 1; k <= 5; ++k) {
    const TierStats before = pool.stats();
    inject->fail_allocate_calls(k, 2);
    absl::StatusOr<void*> p = pool.allocate(200 * kMiB);
    inject->disarm();
    if (p.ok()) {
      ASSERT_TRUE(pool.deallocate(*p).ok());
      ASSERT_TRUE(pool.trim().ok());
      continue;
    }
    EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
    const TierStats after = pool.stats();
    EXPECT_EQ(after.allocated_bytes.current, before.allocated_bytes.current) << "call " << k;
    EXPECT_LE(after.reserved_bytes.current, before.reserved_bytes.current) << "call " << k;
    EXPECT_TRUE(pool.validate().ok()) << "call " << k << ": " << pool.validate();
  }
  absl::StatusOr<void*> p = pool.allocate(200 * kMiB);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(pool.deallocate(*p).ok());
  ASSERT_TRUE(pool.deallocate(*keep).ok());
  EXPECT_TRUE(pool.validate().ok()) << pool.validate();
}

TEST(ExpandableThreadsTest, ConcurrentAllocateFreeAndTrim) {
  BlockPool pool({.tier = Tier::kGpu, .expandable = true}, memory_device(2 * kGiB),
                 std::make_shared<SimulatedStreamOps>());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool, t] {
      std::mt19937_64 rng(1000 + t);
      std::vector<std::pair<unsigned char*, std::size_t>> live;
      for (int i = 0; i < 2000; ++i) {
        if (live.empty() || rng() % 2 == 0) {
          const std::size_t bytes = (1 + rng() % 64) * 256 * kKiB;
          absl::StatusOr<void*> p = pool.allocate(bytes);
          ASSERT_TRUE(p.ok()) << p.status();
          auto* bytes_ptr = static_cast<unsigned char*>(*p);
          std::memset(bytes_ptr, t + 1, bytes);  // faults if any of it were unmapped
          live.emplace_back(bytes_ptr, bytes);
        } else {
          const std::size_t pick = rng() % live.size();
          const auto [p, bytes] = live[pick];
          ASSERT_EQ(p[bytes - 1], t + 1) << "another thread wrote into this block";
          ASSERT_TRUE(pool.deallocate(p).ok());
          live[pick] = live.back();
          live.pop_back();
        }
        if (i % 97 == 0) ASSERT_TRUE(pool.trim().ok());
      }
      for (auto [p, bytes] : live) ASSERT_TRUE(pool.deallocate(p).ok());
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(pool.trim().ok());
  EXPECT_EQ(pool.stats().reserved_bytes.current, 0);
  EXPECT_TRUE(pool.validate().ok()) << pool.validate();
}

}  // namespace
}  // namespace strata::alloc
