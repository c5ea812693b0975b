#include "base/thread_pool.h"

#include <algorithm>

namespace strata {

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::run_parts(const std::function<void(int)>& fn, int parts) {
  for (int part = next_.fetch_add(1); part < parts; part = next_.fetch_add(1)) {
    fn(part);
    if (done_.fetch_add(1) + 1 == parts) {
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(int parts, const std::function<void(int)>& fn) {
  if (parts <= 0) return;
  if (workers_.empty() || parts == 1) {
    for (int part = 0; part < parts; ++part) fn(part);
    return;
  }
  std::lock_guard<std::mutex> one_job(run_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    parts_ = parts;
    next_.store(0);
    done_.store(0);
    ++generation_;
  }
  work_cv_.notify_all();
  run_parts(fn, parts);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return done_.load() == parts && holding_ == 0; });
  fn_ = nullptr;  // a worker waking late finds no job
}

void ThreadPool::work() {
  unsigned long long seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (fn_ == nullptr) continue;  // that job has ended already
    const std::function<void(int)>* fn = fn_;
    const int parts = parts_;
    ++holding_;
    lock.unlock();
    run_parts(*fn, parts);
    lock.lock();
    if (--holding_ == 0) done_cv_.notify_all();
  }
}

void parallel_ranges(ThreadPool* pool, std::int64_t total, std::int64_t min_part,
                     std::int64_t align,
                     const std::function<void(std::int64_t, std::int64_t)>& fn) {
  const int threads = pool != nullptr ? pool->size() : 1;
  const int most = threads == 1 ? 1 : threads * kPartsPerThread;
  const int n = static_cast<int>(std::clamp<std::int64_t>(total / min_part, 1, most));
  if (n == 1) {
    fn(0, total);
    return;
  }
  const std::int64_t per = ((total + n - 1) / n + align - 1) / align * align;
  pool->parallel_for(n, [&](int part) {
    const std::int64_t begin = std::min(total, per * part);
    fn(begin, std::min(total, begin + per));
  });
}

}  // namespace strata
