// base/thread_pool.h: host threads started once and reused, for work split into parts (the host
// Adam kernel's element ranges).
//
//   strata::ThreadPool pool(8);                      // 7 workers; the caller is the 8th
//   pool.parallel_for(16, [&](int part) { run(part); });   // returns once all 16 parts ran
//
// Note [Persistent host threads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A host step used to start its threads on every call and join them at the end: tens of
// microseconds a thread, every layer, every step, and as many thread creations as layers times
// threads in a run. The pool starts its workers once, at construction, and they sleep on a
// condition variable between jobs. A job is a count of parts and a function; the workers and the
// calling thread take parts in turn from one counter until none is left, and parallel_for returns
// once every part has run and no worker still holds the job (so the function may go out of scope).
// One job runs at a time: a second caller waits for the first to finish. The destructor stops and
// joins the workers; no job may be running then.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace strata {

class ThreadPool {
 public:
  // `threads` counts the calling thread: threads - 1 workers are started (none for 1 or less).
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // The threads a job runs on, the caller's included.
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(0) ... fn(parts - 1), each once, on the workers and the calling thread; returns when
  // all have run. fn must not call parallel_for on the same pool.
  void parallel_for(int parts, const std::function<void(int)>& fn);

 private:
  void work();
  // Takes parts from next_ until none is left; runs them.
  void run_parts(const std::function<void(int)>& fn, int parts);

  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;
  std::condition_variable work_cv_;  // a job was posted, or stop_
  std::condition_variable done_cv_;  // the last part finished, or the last worker left the job
  bool stop_ = false;
  unsigned long long generation_ = 0;             // counts jobs posted
  const std::function<void(int)>* fn_ = nullptr;  // the job, while it runs
  int parts_ = 0;
  int holding_ = 0;  // workers inside the current job
  std::atomic<int> next_{0};
  std::atomic<int> done_{0};
};

// Runs fn(begin, end) over [0, total) split into at most kPartsPerThread * pool->size() ranges of
// at least `min_part` elements each, every range but the last a multiple of `align` long (so that
// each starts on a cache line of its data); on this thread alone for a null pool or a small total.
// The host kernels split their elements this way. The threads take the ranges from one counter,
// so a thread the machine runs slower (another process, a core shared with the copies' driver
// threads, memory further away) leaves the others more ranges, instead of holding up the job's end
// by a whole thread's share.
inline constexpr int kPartsPerThread = 4;
void parallel_ranges(ThreadPool* pool, std::int64_t total, std::int64_t min_part,
                     std::int64_t align, const std::function<void(std::int64_t, std::int64_t)>& fn);

}  // namespace strata
