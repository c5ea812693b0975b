#include "base/serial_worker.h"

#include <utility>

namespace strata {

SerialWorker::SerialWorker() : thread_([this] { work(); }) {}

SerialWorker::~SerialWorker() {
  drain();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  posted_cv_.notify_one();
  thread_.join();
}

void SerialWorker::post(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  posted_cv_.notify_one();
}

void SerialWorker::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return jobs_.empty() && !running_; });
}

void SerialWorker::work() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    posted_cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stop_, with nothing left
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    running_ = true;
    lock.unlock();
    job();
    lock.lock();
    running_ = false;
    if (jobs_.empty()) idle_cv_.notify_all();
  }
}

}  // namespace strata
