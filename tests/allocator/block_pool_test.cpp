// Unit tests of BlockPool and TieredAllocator: rounding, best fit, split and merge, growth and
// trim, stats and fragmentation, budgets, stream ordering with simulated events
// (See Note [Stream ordering] in allocator/block_pool.h), threads.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "allocator/block_pool.h"
#include "allocator/tiered_allocator.h"
#include "gtest/gtest.h"
#include "tests/allocator/test_util.h"

namespace strata::alloc {
namespace {

using testing::address_only_device;

class PoolTest : public ::testing::Test {
 protected:
  PoolTest()
      : ops_(std::make_shared<SimulatedStreamOps>()),
        pool_({.tier = Tier::kGpu}, address_only_device(), ops_) {}
  void* alloc(std::size_t bytes, StreamHandle stream = nullptr) {
    absl::StatusOr<void*> p = pool_.allocate(bytes, {.stream = stream});
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : nullptr;
  }
  void free(void* p) { ASSERT_TRUE(pool_.deallocate(p).ok()); }
  void expect_valid() { EXPECT_TRUE(pool_.validate().ok()) << pool_.validate(); }

  std::shared_ptr<SimulatedStreamOps> ops_;
  BlockPool pool_;
};

TEST_F(PoolTest, RoundsToGranularityAndAligns) {
  std::vector<void*> blocks;
  for (std::size_t bytes : {1ul, 63ul, 255ul, 256ul, 511ul, 512ul, 513ul, 4097ul, 3ul * kMiB + 1}) {
    void* p = alloc(bytes);
    blocks.push_back(p);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % kBlockGranularity, 0u) << bytes;
    EXPECT_EQ(pool_.requested_size(p), bytes);
  }
  TierStats s = pool_.stats();
  EXPECT_EQ(s.allocated_bytes.current,
            static_cast<std::int64_t>(512 * 4 + 1024 + 4608 + 3 * kMiB + 512 + 512 + 512));
  expect_valid();
  for (void* p : blocks) free(p);
}

TEST_F(PoolTest, SmallAndLargeRequestsUseSeparateSegments) {
  void* small = alloc(kSmallSize);
  void* large = alloc(kSmallSize + 1);
  TierStats s = pool_.stats();
  EXPECT_EQ(s.segments.current, 2);
  // Small segment: 2 MiB; large: request rounded up to 2 MiB.
  EXPECT_EQ(s.reserved_bytes.current, static_cast<std::int64_t>(kSmallSegmentSize + 2 * kMiB));
  free(small);
  free(large);
  expect_valid();
}

TEST_F(PoolTest, SplitsThenMergesBackIntoOneBlockPerSegment) {
  // Four blocks carved out of one 8 MiB segment, freed in an order that needs both merges.
  void* whole = alloc(8 * kMiB);
  free(whole);
  std::vector<void*> parts;
  for (int i = 0; i < 4; ++i) parts.push_back(alloc(2 * kMiB));
  EXPECT_EQ(pool_.stats().segments.current, 1);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(static_cast<std::byte*>(parts[i + 1]) - static_cast<std::byte*>(parts[i]),
              static_cast<std::ptrdiff_t>(2 * kMiB));
  }
  free(parts[1]);
  free(parts[3]);
  expect_valid();
  EXPECT_EQ(pool_.stats().inactive_split_bytes, static_cast<std::int64_t>(4 * kMiB));
  free(parts[2]);  // merges with both neighbours
  expect_valid();
  free(parts[0]);
  TierStats s = pool_.stats();
  EXPECT_EQ(s.free_bytes, static_cast<std::int64_t>(8 * kMiB));
  EXPECT_EQ(s.largest_free_block, static_cast<std::int64_t>(8 * kMiB));
  EXPECT_EQ(s.inactive_split_bytes, 0);
  EXPECT_DOUBLE_EQ(s.fragmentation, 0.0);
  expect_valid();
}

TEST_F(PoolTest, FreedNeighboursAreMergedBeforeThePoolGrows) {
  // 64 small blocks of 32 KiB fill one 2 MiB segment; freed one by one they stay separate blocks,
  // but a 1 MiB request finds them merged instead of taking a new segment
  // (See Note [Lazy coalescing] in allocator/block_pool.h).
  std::vector<void*> parts;
  for (int i = 0; i < 64; ++i) parts.push_back(alloc(32 * kKiB));
  const TierStats full = pool_.stats();
  EXPECT_EQ(full.num_segment_allocs, 1);
  EXPECT_EQ(full.free_bytes, 0);
  for (void* p : parts) free(p);
  expect_valid();
  TierStats s = pool_.stats();
  EXPECT_EQ(s.largest_free_block, static_cast<std::int64_t>(kSmallSegmentSize))
      << "stats see the free run as one block";
  EXPECT_DOUBLE_EQ(s.fragmentation, 0.0);
  void* big = alloc(kSmallSize);
  EXPECT_EQ(pool_.stats().num_segment_allocs, 1);
  free(big);
  pool_.consolidate();
  expect_valid();
}

TEST_F(PoolTest, BestFitTakesTheSmallestBlockThatFits) {
  // Segments of 4, 6 and 10 MiB, all free: a 5 MiB request must land in the 6 MiB one.
  void* a = alloc(4 * kMiB);
  void* b = alloc(6 * kMiB);
  void* c = alloc(10 * kMiB);
  free(a);
  free(b);
  free(c);
  void* p = alloc(5 * kMiB);
  EXPECT_EQ(p, b);
  void* q = alloc(4 * kMiB);
  EXPECT_EQ(q, a);
  free(p);
  free(q);
  EXPECT_EQ(pool_.stats().num_segment_allocs, 3);
  expect_valid();
}

TEST_F(PoolTest, FragmentationIsOneMinusLargestOverTotalFree) {
  void* whole = alloc(8 * kMiB);
  free(whole);
  std::vector<void*> parts;
  for (int i = 0; i < 4; ++i) parts.push_back(alloc(2 * kMiB));
  free(parts[0]);
  free(parts[2]);
  TierStats s = pool_.stats();
  EXPECT_EQ(s.free_bytes, static_cast<std::int64_t>(4 * kMiB));
  EXPECT_EQ(s.largest_free_block, static_cast<std::int64_t>(2 * kMiB));
  EXPECT_DOUBLE_EQ(s.fragmentation, 0.5);
  free(parts[1]);
  free(parts[3]);
}

TEST_F(PoolTest, TrimReturnsOnlyEntirelyFreeSegments) {
  void* a = alloc(4 * kMiB);
  void* b = alloc(6 * kMiB);
  void* small = alloc(1000);
  free(a);
  absl::StatusOr<std::size_t> released = pool_.trim();
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, 4 * kMiB);
  TierStats s = pool_.stats();
  EXPECT_EQ(s.segments.current, 2);
  EXPECT_EQ(s.num_segment_frees, 1);
  free(b);
  free(small);
  released = pool_.trim();
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, 6 * kMiB + kSmallSegmentSize);
  s = pool_.stats();
  EXPECT_EQ(s.reserved_bytes.current, 0);
  EXPECT_EQ(s.reserved_bytes.peak, static_cast<std::int64_t>(12 * kMiB));
  expect_valid();
}

TEST_F(PoolTest, PeaksAndCountersFollowTheCalls) {
  void* a = alloc(3 * kMiB);
  void* b = alloc(5 * kMiB);
  free(a);
  void* c = alloc(kMiB / 2);
  TierStats s = pool_.stats();
  EXPECT_EQ(s.allocated_bytes.peak, static_cast<std::int64_t>(8 * kMiB));
  EXPECT_EQ(s.allocated_bytes.current, static_cast<std::int64_t>(5 * kMiB + kMiB / 2));
  EXPECT_EQ(s.num_allocs, 3);
  EXPECT_EQ(s.num_frees, 1);
  EXPECT_EQ(s.active_blocks.current, 2);
  EXPECT_EQ(s.active_blocks.peak, 2);
  pool_.reset_peak_stats();
  EXPECT_EQ(pool_.stats().allocated_bytes.peak, static_cast<std::int64_t>(5 * kMiB + kMiB / 2));
  free(b);
  free(c);
}

TEST_F(PoolTest, BlocksAreReusedOnlyByTheirOwnStream) {
  auto* s1 = reinterpret_cast<StreamHandle>(0x1);
  auto* s2 = reinterpret_cast<StreamHandle>(0x2);
  void* a = alloc(4 * kMiB, s1);
  free(a);
  void* b = alloc(4 * kMiB, s2);  // must not reuse s1's block
  EXPECT_NE(a, b);
  void* c = alloc(4 * kMiB, s1);  // s1 gets its own block back at once
  EXPECT_EQ(a, c);
  free(b);
  free(c);
  expect_valid();
}

TEST_F(PoolTest, RecordStreamHoldsTheBlockUntilTheEventCompletes) {
  auto* compute = reinterpret_cast<StreamHandle>(0x1);
  auto* copy = reinterpret_cast<StreamHandle>(0x2);
  void* a = alloc(4 * kMiB, compute);
  ASSERT_TRUE(pool_.record_stream(a, copy).ok());
  ops_->hold();  // the copy stream is still busy
  free(a);
  EXPECT_EQ(pool_.stats().pending_free_bytes.current, static_cast<std::int64_t>(4 * kMiB));
  void* b = alloc(4 * kMiB, compute);
  EXPECT_NE(a, b) << "a block was reused while another stream could still use it";
  expect_valid();
  ops_->complete_all();
  free(b);
  void* c = alloc(4 * kMiB, compute);  // processing the completed event returns a to the pool
  EXPECT_TRUE(c == a || c == b);
  EXPECT_EQ(pool_.stats().pending_free_bytes.current, 0);
  free(c);
  EXPECT_EQ(ops_->live_events(), 0);
  expect_valid();
}

// See Note [Last use] in allocator/block_pool.h: a block marked at its last use on a stream waits,
// once freed, for the event recorded then, not for the work that stream queued since; a block
// only recorded on the stream waits for all of it.
TEST_F(PoolTest, AMarkedBlockWaitsOnlyForItsLastUse) {
  auto* compute = reinterpret_cast<StreamHandle>(0x1);
  auto* copy = reinterpret_cast<StreamHandle>(0x2);
  void* marked = alloc(4 * kMiB, compute);
  void* recorded = alloc(4 * kMiB, compute);
  ops_->hold();
  ASSERT_TRUE(pool_.mark_last_use(marked, copy).ok());
  ASSERT_TRUE(pool_.record_stream(recorded, copy).ok());
  ops_->complete_all();  // the copy stream passed the last use...
  ops_->hold();          // ...and is busy with later work
  free(marked);
  free(recorded);
  EXPECT_EQ(pool_.stats().pending_free_bytes.current, static_cast<std::int64_t>(8 * kMiB));
  void* again = alloc(4 * kMiB, compute);
  EXPECT_EQ(again, marked);
  EXPECT_EQ(pool_.stats().pending_free_bytes.current, static_cast<std::int64_t>(4 * kMiB));
  expect_valid();
  free(again);
  ops_->complete_all();
  ASSERT_TRUE(pool_.synchronize_pending().ok());
  EXPECT_EQ(ops_->live_events(), 0);
  expect_valid();
}

// A use recorded after the marked last one undoes the mark; a block's own stream needs none.
TEST_F(PoolTest, ARecordStreamAfterTheMarkUndoesIt) {
  auto* compute = reinterpret_cast<StreamHandle>(0x1);
  auto* copy = reinterpret_cast<StreamHandle>(0x2);
  void* a = alloc(4 * kMiB, compute);
  ASSERT_TRUE(pool_.mark_last_use(a, compute).ok());
  EXPECT_EQ(ops_->live_events(), 0);
  ops_->hold();
  ASSERT_TRUE(pool_.mark_last_use(a, copy).ok());
  ops_->complete_all();
  ops_->hold();
  ASSERT_TRUE(pool_.record_stream(a, copy).ok());  // queued after the mark
  EXPECT_EQ(ops_->live_events(), 0) << "the undone mark's event was not released";
  free(a);
  void* b = alloc(4 * kMiB, compute);
  EXPECT_NE(a, b) << "reused while the copy stream's later work may still touch it";
  ops_->complete_all();
  free(b);
  ASSERT_TRUE(pool_.synchronize_pending().ok());
  EXPECT_EQ(ops_->live_events(), 0);
  EXPECT_EQ(pool_.mark_last_use(a, copy).code(), absl::StatusCode::kInvalidArgument);
  expect_valid();
}

// An allocation about to grow the pool asks every pending event, not only those up to the first
// that is not done: a block behind a done event that sits behind a pending one is reused.
TEST_F(PoolTest, AnAllocationAboutToGrowAsksEveryPendingEvent) {
  auto* copy = reinterpret_cast<StreamHandle>(0x2);
  void* behind = alloc(4 * kMiB);
  void* done = alloc(4 * kMiB);
  ASSERT_TRUE(pool_.mark_last_use(done, copy).ok());  // not held: done at once
  ops_->hold();
  ASSERT_TRUE(pool_.record_stream(behind, copy).ok());
  free(behind);  // its event, pending, is first in the list
  free(done);
  const std::int64_t segments = pool_.stats().segments.current;
  void* again = alloc(4 * kMiB);
  EXPECT_EQ(again, done);
  EXPECT_EQ(pool_.stats().segments.current, segments) << "the pool grew";
  free(again);
  ops_->complete_all();
  ASSERT_TRUE(pool_.synchronize_pending().ok());
  EXPECT_EQ(ops_->live_events(), 0);
  expect_valid();
}

// A pool destroyed with a marked block still live releases the mark's event.
TEST(PoolLastUseTest, APoolDestroyedWithAMarkedLiveBlockReleasesItsEvent) {
  auto ops = std::make_shared<SimulatedStreamOps>();
  {
    BlockPool pool({.tier = Tier::kGpu}, address_only_device(), ops);
    absl::StatusOr<void*> a = pool.allocate(4 * kMiB);
    ASSERT_TRUE(a.ok());
    ASSERT_TRUE(pool.mark_last_use(*a, reinterpret_cast<StreamHandle>(0x2)).ok());
    EXPECT_EQ(ops->live_events(), 1);
    ::testing::internal::CaptureStderr();
  }
  (void)::testing::internal::GetCapturedStderr();
  EXPECT_EQ(ops->live_events(), 0);
}

TEST_F(PoolTest, PendingBlocksDoNotMergeUntilTheirEventsComplete) {
  auto* copy = reinterpret_cast<StreamHandle>(0x2);
  void* whole = alloc(6 * kMiB);
  free(whole);
  void* a = alloc(2 * kMiB);
  void* b = alloc(2 * kMiB);
  void* c = alloc(2 * kMiB);
  ASSERT_TRUE(pool_.record_stream(b, copy).ok());
  ops_->hold();
  free(b);
  free(a);
  free(c);
  expect_valid();
  EXPECT_EQ(pool_.stats().largest_free_block, static_cast<std::int64_t>(2 * kMiB));
  ASSERT_TRUE(pool_.synchronize_pending().ok());
  EXPECT_EQ(pool_.stats().largest_free_block, static_cast<std::int64_t>(6 * kMiB));
  EXPECT_EQ(pool_.stats().num_event_waits, 1);
  expect_valid();
}

TEST(PoolBudgetTest, OutOfMemoryWaitsForPendingEventsFirst) {
  // F5 of RELIABILITY.md: with the budget full and a block waiting behind a copy event, the pool
  // waits for the event and retries instead of reporting out of memory.
  auto ops = std::make_shared<SimulatedStreamOps>();
  BlockPool pool({.tier = Tier::kGpu, .budget = 8 * kMiB}, address_only_device(), ops);
  auto* copy = reinterpret_cast<StreamHandle>(0x2);
  absl::StatusOr<void*> a = pool.allocate(8 * kMiB);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(pool.record_stream(*a, copy).ok());
  ops->hold();
  ASSERT_TRUE(pool.deallocate(*a).ok());
  absl::StatusOr<void*> b = pool.allocate(8 * kMiB);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, *a);
  TierStats s = pool.stats();
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.num_event_waits, 1);
  EXPECT_EQ(s.num_ooms, 0);
  ASSERT_TRUE(pool.deallocate(*b).ok());
}

// The fault sweep (seed 724605580) found an out-of-memory error that hid its cause: the blocks
// behind copy events could not be waited for, and the message said only that the budget was full.
TEST(PoolBudgetTest, OutOfMemoryWhoseEventWaitFailedSaysSo) {
  auto ops = std::make_shared<SimulatedStreamOps>();
  BlockPool pool({.tier = Tier::kGpu, .budget = 8 * kMiB}, address_only_device(), ops);
  auto* copy = reinterpret_cast<StreamHandle>(0x2);
  absl::StatusOr<void*> a = pool.allocate(8 * kMiB);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(pool.record_stream(*a, copy).ok());
  ops->hold();
  ops->set_synchronize_completes(false);  // a stuck stream: the wait fails
  ASSERT_TRUE(pool.deallocate(*a).ok());
  absl::StatusOr<void*> b = pool.allocate(8 * kMiB);
  ASSERT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("; blocks behind copy events could not be waited for: "),
            std::string_view::npos)
      << b.status();
  ops->set_synchronize_completes(true);
  ASSERT_TRUE(pool.synchronize_pending().ok());
}

TEST(PoolBudgetTest, OutOfMemoryReturnsCachedSegmentsOfOtherStreamsFirst) {
  auto ops = std::make_shared<SimulatedStreamOps>();
  BlockPool pool({.tier = Tier::kGpu, .budget = 10 * kMiB}, address_only_device(), ops);
  auto* s1 = reinterpret_cast<StreamHandle>(0x1);
  auto* s2 = reinterpret_cast<StreamHandle>(0x2);
  absl::StatusOr<void*> a = pool.allocate(8 * kMiB, {.stream = s1});
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(pool.deallocate(*a).ok());
  absl::StatusOr<void*> b = pool.allocate(8 * kMiB, {.stream = s2});
  ASSERT_TRUE(b.ok()) << b.status();
  TierStats s = pool.stats();
  EXPECT_EQ(s.num_segment_frees, 1);
  EXPECT_EQ(s.reserved_bytes.current, static_cast<std::int64_t>(8 * kMiB));
  ASSERT_TRUE(pool.deallocate(*b).ok());
}

TEST(PoolBudgetTest, OutOfMemoryMessageNamesEverything) {
  BlockPool pool({.tier = Tier::kPinnedHost, .budget = 16 * kMiB}, address_only_device(), nullptr);
  absl::StatusOr<void*> a = pool.allocate(10 * kMiB);
  ASSERT_TRUE(a.ok());
  absl::StatusOr<void*> b = pool.allocate(7 * kMiB);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string m(b.status().message());
  EXPECT_NE(m.find("out of memory in tier pinned_host"), std::string::npos) << m;
  EXPECT_NE(m.find("tried to allocate 7.00 MiB (7340032 bytes asked)"), std::string::npos) << m;
  EXPECT_NE(m.find("reserved 10.00 MiB"), std::string::npos) << m;
  EXPECT_NE(m.find("allocated 10.00 MiB"), std::string::npos) << m;
  EXPECT_NE(m.find("budget 16.00 MiB"), std::string::npos) << m;
  EXPECT_NE(m.find("largest free block 0 B"), std::string::npos) << m;
  EXPECT_EQ(pool.stats().num_ooms, 1);
  ASSERT_TRUE(pool.deallocate(*a).ok());
}

TEST(PoolThreadTest, ConcurrentAllocFreeKeepsCountersExact) {
  auto ops = std::make_shared<SimulatedStreamOps>();
  BlockPool pool({.tier = Tier::kGpu}, make_simulated_device_upstream({.capacity = 4 * kGiB}), ops);
  constexpr int kThreads = 4;
  constexpr int kRounds = 2000;
  std::vector<std::thread> threads;
  std::vector<std::vector<void*>> handoff(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&pool, t, &handoff] {
      std::mt19937_64 rng(1234 + t);
      std::vector<void*> mine;
      for (int i = 0; i < kRounds; ++i) {
        const std::size_t bytes = 1 + rng() % (3 * kMiB);
        absl::StatusOr<void*> p = pool.allocate(bytes);
        ASSERT_TRUE(p.ok()) << p.status();
        std::memset(*p, t, std::min<std::size_t>(bytes, 64));
        mine.push_back(*p);
        if (mine.size() > 8) {
          ASSERT_TRUE(pool.deallocate(mine.front()).ok());
          mine.erase(mine.begin());
        }
      }
      handoff[t] = mine;
    });
  }
  for (auto& th : threads) th.join();
  // Free every thread's leftovers from another thread.
  std::thread other([&] {
    for (auto& list : handoff) {
      for (void* p : list) ASSERT_TRUE(pool.deallocate(p).ok());
    }
  });
  other.join();
  TierStats s = pool.stats();
  EXPECT_EQ(s.allocated_bytes.current, 0);
  EXPECT_EQ(s.active_blocks.current, 0);
  EXPECT_EQ(s.num_allocs, kThreads * kRounds);
  EXPECT_EQ(s.num_frees, kThreads * kRounds);
  EXPECT_TRUE(pool.validate().ok()) << pool.validate();
}

TEST(TieredAllocatorTest, SimulatedBackendServesAllThreeTiers) {
  AllocatorOptions options;
  options.device = DeviceBackend::kSimulated;
  options.simulated_device.capacity = kGiB;
  absl::StatusOr<std::unique_ptr<TieredAllocator>> allocator =
      TieredAllocator::create(std::move(options));
  ASSERT_TRUE(allocator.ok()) << allocator.status();
  EXPECT_TRUE((*allocator)->gpu_is_simulated());
  EXPECT_EQ((*allocator)->upstream(Tier::kGpu).name(), "simulated_device");
  EXPECT_EQ((*allocator)->upstream(Tier::kPinnedHost).name(), "simulated_pinned_host");
  EXPECT_EQ((*allocator)->upstream(Tier::kPageableHost).name(), "pageable_host");
  for (Tier tier : kAllTiers) {
    absl::StatusOr<void*> p = (*allocator)->allocate(tier, 12345);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(*p) % tier_min_alignment(tier), 0u);
    std::memset(*p, 0xab, 12345);  // simulated device memory is real host memory
    ASSERT_TRUE((*allocator)->deallocate(tier, *p).ok());
  }
  const std::string table = (*allocator)->format_stats();
  EXPECT_NE(table.find("allocated_bytes"), std::string::npos);
  EXPECT_NE(table.find("fragmentation"), std::string::npos);
  const std::string json = (*allocator)->stats_json();
  EXPECT_NE(json.find("\"pinned_host\": {\"allocated_bytes\": {\"current\": 0, \"peak\": 12800}"),
            std::string::npos)
      << json;
}

TEST(TieredAllocatorTest, InitialReservationPinsOnceUpFront) {
  AllocatorOptions options;
  options.device = DeviceBackend::kSimulated;
  options.initial_reservation[tier_index(Tier::kPinnedHost)] = 64 * kMiB;
  auto allocator = TieredAllocator::create(std::move(options));
  ASSERT_TRUE(allocator.ok()) << allocator.status();
  TierStats s = (*allocator)->stats(Tier::kPinnedHost);
  EXPECT_EQ(s.reserved_bytes.current, static_cast<std::int64_t>(64 * kMiB));
  for (int i = 0; i < 10; ++i) {
    absl::StatusOr<void*> p = (*allocator)->allocate(Tier::kPinnedHost, 16 * kMiB);
    ASSERT_TRUE(p.ok());
    ASSERT_TRUE((*allocator)->deallocate(Tier::kPinnedHost, *p).ok());
  }
  EXPECT_EQ((*allocator)->stats(Tier::kPinnedHost).num_segment_allocs, 1);
}

// A request larger than the machine's memory is an out-of-memory error naming the default budget
// (while it is the budget), not a process the kernel kills (strata-alloc-demo --layer-mib 100000
// was, at 23.5 GB resident; See Note [Host budgets] in allocator/tiered_allocator.h).
TEST(TieredAllocatorTest, HostTiersHaveBudgetsFromTheMachinesMemory) {
  AllocatorOptions options;
  options.device = DeviceBackend::kSimulated;
  auto allocator = TieredAllocator::create(std::move(options));
  ASSERT_TRUE(allocator.ok()) << allocator.status();
  for (Tier tier : {Tier::kPinnedHost, Tier::kPageableHost}) {
    const std::size_t budget = (*allocator)->pool(tier).budget();
    ASSERT_NE(budget, kNoBudget) << tier_name(tier);
    absl::Status s = (*allocator)->allocate(tier, budget + kMiB).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_NE(std::string(s.message())
                  .find(tier == Tier::kPinnedHost
                            ? "(the default for pinned memory: half of the machine's"
                            : "(the default for pageable memory: the "),
              std::string::npos)
        << s;
    EXPECT_NE(std::string(s.message()).find("AllocatorOptions::budgets sets another"),
              std::string::npos)
        << s;
    // Once set_budget changes it, the budget is no longer the default, and the message says so.
    ASSERT_TRUE((*allocator)->set_budget(tier, 8 * kMiB).ok());
    s = (*allocator)->allocate(tier, 16 * kMiB).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_EQ(std::string(s.message()).find("the default"), std::string::npos) << s;
  }
  // The GPU tier has none unless given; kNoBudget turns a host tier's off.
  EXPECT_EQ((*allocator)->pool(Tier::kGpu).budget(), kNoBudget);
  AllocatorOptions unlimited;
  unlimited.device = DeviceBackend::kSimulated;
  unlimited.budgets[tier_index(Tier::kPinnedHost)] = kNoBudget;
  EXPECT_EQ((*TieredAllocator::create(std::move(unlimited)))->pool(Tier::kPinnedHost).budget(),
            kNoBudget);
}

TEST(TieredAllocatorTest, CudaBackendIsUnavailableWithoutAGpu) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has a GPU";
  AllocatorOptions options;
  options.device = DeviceBackend::kCuda;
  auto allocator = TieredAllocator::create(std::move(options));
  ASSERT_FALSE(allocator.ok());
  EXPECT_EQ(allocator.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(std::string(allocator.status().message()).find("no CUDA device is visible"),
            std::string::npos);
}

}  // namespace
}  // namespace strata::alloc
