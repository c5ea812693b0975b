// L1 of RELIABILITY.md: 10^6 random operations (a fifth under the sanitizers; allocate 55% / free
// 45%, sizes log-uniform 1 B .. 64 MiB, all three tiers, random free order) on address-only
// simulated upstreams, checked against a model (std::map of live ranges): no overlapping live
// ranges, every pointer aligned, per-tier live bytes equal to the model every 10^4 operations;
// after freeing everything, zero live bytes and one free block per segment. Runs a fixed seed and a
// fresh one (printed).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "allocator/tiered_allocator.h"
#include "gtest/gtest.h"
#include "tests/allocator/test_util.h"

namespace strata::alloc {
namespace {

constexpr int kCheckEvery = 10'000;

// 10^6 operations; STRATA_RANDOM_OPS sets fewer (the sanitizer builds, where each costs 10-20 times
// more, run a fifth of them).
int num_ops() {
  if (const char* env = std::getenv("STRATA_RANDOM_OPS")) return std::stoi(env);
  return 1'000'000;
}

struct ModelBlock {
  std::uintptr_t end;
  std::size_t requested;
  Tier tier;
};

void run_random_ops(std::uint64_t seed) {
  std::printf("L1 random ops: seed %llu (rerun with STRATA_TEST_SEED=%llu)\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  AllocatorOptions options;
  options.device = DeviceBackend::kSimulated;
  for (Tier tier : kAllTiers) {
    // 512 GiB of address space per tier: L1 reserves about 125 GB; ThreadSanitizer leaves no room
    // for much more.
    options.upstreams[tier_index(tier)] = testing::address_only_device(std::size_t{512} << 30);
  }
  auto created = TieredAllocator::create(std::move(options));
  ASSERT_TRUE(created.ok()) << created.status();
  TieredAllocator& allocator = **created;

  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log_size(0.0, std::log(64.0 * kMiB));
  std::map<std::uintptr_t, ModelBlock> model;  // start -> block
  std::vector<std::uintptr_t> live;            // for random choice of what to free
  std::array<std::int64_t, kNumTiers> model_requested{};

  const int ops = num_ops();
  for (int op = 1; op <= ops; ++op) {
    const bool do_alloc = live.empty() || (rng() % 100) < 55;
    if (do_alloc) {
      const Tier tier = kAllTiers[rng() % kNumTiers];
      const auto bytes = static_cast<std::size_t>(std::exp(log_size(rng)));
      absl::StatusOr<void*> p = allocator.allocate(tier, std::max<std::size_t>(bytes, 1));
      ASSERT_TRUE(p.ok()) << "op " << op << ": " << p.status();
      const auto start = reinterpret_cast<std::uintptr_t>(*p);
      const std::size_t asked = std::max<std::size_t>(bytes, 1);
      ASSERT_EQ(start % tier_min_alignment(tier), 0u) << "op " << op;
      ASSERT_EQ(start % kDefaultAlignment, 0u) << "op " << op;
      // No overlap with the neighbours on either side.
      auto next = model.lower_bound(start);
      if (next != model.end()) {
        ASSERT_LE(start + asked, next->first) << "op " << op;
      }
      if (next != model.begin()) {
        ASSERT_LE(std::prev(next)->second.end, start) << "op " << op;
      }
      model.emplace(start, ModelBlock{start + asked, asked, tier});
      live.push_back(start);
      model_requested[tier_index(tier)] += static_cast<std::int64_t>(asked);
    } else {
      const std::size_t pick = rng() % live.size();
      const std::uintptr_t start = live[pick];
      live[pick] = live.back();
      live.pop_back();
      auto it = model.find(start);
      ASSERT_NE(it, model.end());
      ASSERT_TRUE(allocator.deallocate(it->second.tier, reinterpret_cast<void*>(start)).ok())
          << "op " << op;
      model_requested[tier_index(it->second.tier)] -=
          static_cast<std::int64_t>(it->second.requested);
      model.erase(it);
    }
    if (op % kCheckEvery == 0) {
      for (Tier tier : kAllTiers) {
        ASSERT_EQ(allocator.stats(tier).requested_bytes.current, model_requested[tier_index(tier)])
            << "op " << op << " tier " << tier_name(tier);
      }
    }
  }
  std::int64_t live_bytes = 0;
  for (auto v : model_requested) live_bytes += v;
  std::printf(
      "L1 random ops: %d ops, %zu blocks live at the end (%s), reserved gpu %s\n", ops, live.size(),
      format_bytes(static_cast<std::size_t>(live_bytes)).c_str(),
      format_bytes(static_cast<std::size_t>(allocator.stats(Tier::kGpu).reserved_bytes.current))
          .c_str());
  for (Tier tier : kAllTiers) ASSERT_TRUE(allocator.pool(tier).validate().ok());

  std::shuffle(live.begin(), live.end(), rng);
  for (std::uintptr_t start : live) {
    ASSERT_TRUE(allocator.deallocate(model[start].tier, reinterpret_cast<void*>(start)).ok());
  }
  for (Tier tier : kAllTiers) {
    TierStats s = allocator.stats(tier);
    EXPECT_EQ(s.allocated_bytes.current, 0);
    EXPECT_EQ(s.requested_bytes.current, 0);
    // One free block per segment: everything merged back, so free bytes == reserved and the pool's
    // invariant check (no two adjacent free blocks) holds.
    EXPECT_EQ(s.free_bytes, s.reserved_bytes.current);
    EXPECT_EQ(s.inactive_split_bytes, 0);
    allocator.pool(tier).consolidate();
    ASSERT_TRUE(allocator.pool(tier).validate().ok()) << allocator.pool(tier).validate();
  }
}

TEST(RandomOpsTest, FixedSeed) { run_random_ops(20261121); }

TEST(RandomOpsTest, FreshSeed) { run_random_ops(testing::fresh_seed()); }

}  // namespace
}  // namespace strata::alloc
