// ThreadPool (See Note [Persistent host threads] in base/thread_pool.h): every part runs once, on
// the workers started at construction and the caller, job after job, and from several callers.
#include "base/thread_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

namespace strata {
namespace {

TEST(ThreadPoolTest, EveryPartRunsOnceJobAfterJob) {
  ThreadPool pool(4);
  EXPECT_EQ(pool.size(), 4);
  for (int parts : {0, 1, 2, 3, 4, 5, 17, 1000}) {
    std::vector<std::atomic<int>> runs(static_cast<std::size_t>(parts));
    for (int job = 0; job < 20; ++job) {
      pool.parallel_for(parts, [&](int part) { runs[static_cast<std::size_t>(part)]++; });
    }
    for (int part = 0; part < parts; ++part) {
      EXPECT_EQ(runs[static_cast<std::size_t>(part)].load(), 20) << parts << " parts, #" << part;
    }
  }
}

TEST(ThreadPoolTest, TheWorkersAreStartedOnceAndShareTheParts) {
  ThreadPool pool(4);
  std::mutex mu;
  std::set<std::thread::id> threads;
  for (int job = 0; job < 50; ++job) {
    pool.parallel_for(64, [&](int) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      std::lock_guard<std::mutex> lock(mu);
      threads.insert(std::this_thread::get_id());
    });
  }
  // The caller and the three workers, and no thread more over 50 jobs.
  EXPECT_LE(threads.size(), 4u);
  EXPECT_GE(threads.size(), 2u) << "the parts never left the calling thread";
  EXPECT_TRUE(threads.count(std::this_thread::get_id()));
}

TEST(ThreadPoolTest, OneThreadRunsEverythingOnTheCaller) {
  ThreadPool pool(1);
  EXPECT_EQ(pool.size(), 1);
  std::vector<int> order;
  const std::thread::id caller = std::this_thread::get_id();
  pool.parallel_for(5, [&](int part) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    order.push_back(part);
  });
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
}

TEST(ThreadPoolTest, CallersFromSeveralThreadsTakeTurns) {
  ThreadPool pool(3);
  std::atomic<long> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int job = 0; job < 25; ++job) pool.parallel_for(10, [&](int part) { sum += part; });
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(sum.load(), 4L * 25 * 45);
}

// parallel_ranges covers [0, total) once, in ranges of at least min_part elements, each starting on
// a multiple of align, at most kPartsPerThread a thread; on the caller alone without a pool.
TEST(ParallelRanges, CoversEveryElementOnceInAlignedRanges) {
  ThreadPool pool(4);
  for (std::int64_t total :
       {std::int64_t{1}, std::int64_t{1000}, std::int64_t{1} << 16, (std::int64_t{1} << 20) + 7}) {
    std::mutex mu;
    std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
    parallel_ranges(&pool, total, 1024, 16, [&](std::int64_t begin, std::int64_t end) {
      std::lock_guard<std::mutex> lock(mu);
      ranges.emplace_back(begin, end);
    });
    std::sort(ranges.begin(), ranges.end());
    std::int64_t next = 0;
    for (const auto& [begin, end] : ranges) {
      EXPECT_EQ(begin, next) << "total " << total;
      EXPECT_EQ(begin % 16, 0);
      if (end < total) EXPECT_GE(end - begin, 1024);
      next = end;
    }
    EXPECT_EQ(next, total);
    EXPECT_LE(ranges.size(), static_cast<std::size_t>(kPartsPerThread * pool.size()));
    if (total >= std::int64_t{1} << 20) {
      EXPECT_GT(ranges.size(), static_cast<std::size_t>(pool.size()))
          << "a large job is cut finer than one range a thread";
    }
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> alone;
  parallel_ranges(nullptr, 5000, 1024, 16,
                  [&](std::int64_t begin, std::int64_t end) { alone.emplace_back(begin, end); });
  ASSERT_EQ(alone.size(), 1u);
  EXPECT_EQ(alone[0], std::make_pair(std::int64_t{0}, std::int64_t{5000}));
}

}  // namespace
}  // namespace strata
