// SerialWorker (base/serial_worker.h): jobs run in the order posted, on one thread other than the
// poster's, while the poster goes on; wait(ticket) returns once that job has run, not waiting for
// those posted after it; drain() returns once every job posted before it has run and shows what
// they wrote; the destructor runs what is left.
#include "base/serial_worker.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace strata {
namespace {

TEST(SerialWorkerTest, JobsRunInOrderOnOneOtherThread) {
  SerialWorker worker;
  std::vector<int> order;  // written by the worker only, read after drain()
  std::vector<std::thread::id> threads;
  for (int job = 0; job < 100; ++job) {
    worker.post([&, job] {
      order.push_back(job);
      threads.push_back(std::this_thread::get_id());
    });
  }
  worker.drain();
  ASSERT_EQ(order.size(), 100u);
  for (int job = 0; job < 100; ++job) EXPECT_EQ(order[static_cast<std::size_t>(job)], job);
  for (std::thread::id id : threads) {
    EXPECT_EQ(id, threads.front());
    EXPECT_NE(id, std::this_thread::get_id());
  }
}

TEST(SerialWorkerTest, PostReturnsWhileAJobRunsAndDrainWaitsForIt) {
  SerialWorker worker;
  std::atomic<bool> release{false};
  std::atomic<int> done{0};
  worker.post([&] {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    done++;
  });
  worker.post([&] { done++; });  // queued behind the first
  EXPECT_EQ(done.load(), 0);
  release.store(true);
  worker.drain();
  EXPECT_EQ(done.load(), 2);
  worker.drain();  // nothing posted: returns at once
  worker.post([&] { done++; });
  worker.drain();
  EXPECT_EQ(done.load(), 3);
}

TEST(SerialWorkerTest, WaitReturnsOnceItsJobRanNotTheOnesAfter) {
  SerialWorker worker;
  std::atomic<bool> release_second{false};
  std::atomic<int> done{0};
  const SerialWorker::Ticket first = worker.post([&] { done++; });
  const SerialWorker::Ticket second = worker.post([&] {
    while (!release_second.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    done++;
  });
  const SerialWorker::Ticket third = worker.post([&] { done++; });
  EXPECT_LT(first, second);
  EXPECT_LT(second, third);
  worker.wait(first);  // the second job still blocks the worker: returns anyway
  EXPECT_EQ(done.load(), 1);
  release_second.store(true);
  worker.wait(third);
  EXPECT_EQ(done.load(), 3);
  worker.wait(first);  // long since run: returns at once
}

TEST(SerialWorkerTest, TheDestructorRunsWhatIsLeft) {
  std::atomic<int> done{0};
  {
    SerialWorker worker;
    for (int job = 0; job < 10; ++job) {
      worker.post([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        done++;
      });
    }
  }
  EXPECT_EQ(done.load(), 10);
}

}  // namespace
}  // namespace strata
