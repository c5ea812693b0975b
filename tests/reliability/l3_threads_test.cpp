// L3 of RELIABILITY.md: several threads allocating in every tier, a quarter of the frees done by
// another thread, while others register tensors, migrate them and read them back; counters exact at
// the end, nothing live, no deadlock (a watchdog fails the test after two minutes). Runs under
// ThreadSanitizer in `make test`.
#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "tests/allocator/test_util.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using testing::make_runtime;
using testing::read_all;
using testing::spec;
using testing::special_payload;

TEST(L3Test, ThreadsAllocateFreeAcrossThreadsRegisterAndMigrate) {
  const std::uint64_t seed = alloc::testing::fresh_seed();
  std::printf("L3: seed %llu\n", static_cast<unsigned long long>(seed));
  auto [rt, dev] = make_runtime("bulk");
  alloc::TieredAllocator& allocator = rt->allocator();
  std::array<std::int64_t, alloc::kNumTiers> base_allocs{};
  for (Tier t : alloc::kAllTiers) base_allocs[alloc::tier_index(t)] = allocator.stats(t).num_allocs;

  constexpr int kThreads = 4;
  constexpr int kRounds = 1500;
  std::mutex handoff_mu;
  std::vector<std::pair<Tier, void*>> handoff;  // freed by whichever thread pops them
  std::atomic<std::int64_t> allocs{0}, frees{0}, cross_frees{0}, tensors{0}, mismatches{0};
  std::atomic<bool> failed{false};

  auto worker = [&](int id) {
    std::mt19937_64 rng(seed + id);
    std::vector<std::pair<Tier, void*>> mine;
    for (int r = 0; r < kRounds && !failed; ++r) {
      const Tier tier = alloc::kAllTiers[rng() % alloc::kNumTiers];
      absl::StatusOr<void*> p = allocator.allocate(tier, 1 + rng() % (1 << 20));
      if (!p.ok()) {
        failed = true;
        break;
      }
      ++allocs;
      if (rng() % 4 == 0) {
        std::lock_guard<std::mutex> lock(handoff_mu);
        handoff.emplace_back(tier, *p);
      } else {
        mine.emplace_back(tier, *p);
      }
      std::pair<Tier, void*> other{Tier::kGpu, nullptr};
      {
        std::lock_guard<std::mutex> lock(handoff_mu);
        if (!handoff.empty() && rng() % 2 == 0) {
          other = handoff.back();
          handoff.pop_back();
        }
      }
      if (other.second != nullptr) {
        if (!allocator.deallocate(other.first, other.second).ok()) failed = true;
        ++frees;
        ++cross_frees;
      }
      if (mine.size() > 16) {
        if (!allocator.deallocate(mine.front().first, mine.front().second).ok()) failed = true;
        ++frees;
        mine.erase(mine.begin());
      }
      if (r % 50 == 0) {
        // A tensor's whole life on this thread while the others allocate: register, migrate, read.
        auto payload = special_payload(1 + rng() % 100'000, seed + r + id);
        absl::StatusOr<TensorHandle> h = rt->register_tensor(
            spec(str_cat("t", id, ".", r), r % 7, Role::kOther, payload.size(), DType::kUInt8),
            payload.data());
        if (!h.ok()) {
          failed = true;
          break;
        }
        const Tier to = alloc::kAllTiers[rng() % alloc::kNumTiers];
        if (!rt->migrate(*h, to).ok() || !rt->wait_all().ok()) failed = true;
        mismatches += read_all(*rt, *h) != payload;
        if (!rt->unregister(*h).ok()) failed = true;
        ++tensors;
      }
    }
    for (auto [tier, p] : mine) {
      if (!allocator.deallocate(tier, p).ok()) failed = true;
      ++frees;
    }
  };

  auto run = std::async(std::launch::async, [&] {
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
    for (std::thread& t : threads) t.join();
  });
  if (run.wait_for(std::chrono::minutes(2)) != std::future_status::ready) {
    ADD_FAILURE() << "deadlock: the threads did not finish within two minutes";
    std::abort();  // a hung test would otherwise hang CI
  }
  for (auto [tier, p] : handoff) {
    ASSERT_TRUE(allocator.deallocate(tier, p).ok());
    ++frees;
  }
  EXPECT_FALSE(failed);
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(allocs, frees);
  std::int64_t counted = 0;
  for (Tier t : alloc::kAllTiers) {
    alloc::TierStats s = allocator.stats(t);
    counted += s.num_allocs - base_allocs[alloc::tier_index(t)];
    EXPECT_EQ(s.allocated_bytes.current, 0) << tier_name(t);
    EXPECT_TRUE(allocator.pool(t).validate().ok()) << tier_name(t);
  }
  // The allocator counted every allocate: the threads', the tensors' (registration, migration,
  // bounce buffers are the runtime's own pool).
  EXPECT_GE(counted, allocs.load());
  EXPECT_TRUE(allocator.leak_report().empty()) << allocator.format_leak_report();
  std::printf(
      "L3: %d threads, %lld allocations (%lld freed by another thread), %lld tensors "
      "registered, migrated and read back, %lld mismatches\n",
      kThreads, static_cast<long long>(allocs.load()), static_cast<long long>(cross_frees.load()),
      static_cast<long long>(tensors.load()), static_cast<long long>(mismatches.load()));
}

}  // namespace
}  // namespace strata::rt
