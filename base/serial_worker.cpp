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

SerialWorker::Ticket SerialWorker::post(std::function<void()> job) {
  Ticket ticket = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
    ticket = ++posted_;
  }
  posted_cv_.notify_one();
  return ticket;
}

void SerialWorker::wait(Ticket ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  ran_cv_.wait(lock, [&] { return ran_ >= ticket; });
}

void SerialWorker::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  const Ticket last = posted_;
  ran_cv_.wait(lock, [&] { return ran_ >= last; });
}

void SerialWorker::work() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    posted_cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stop_, with nothing left
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    job();
    lock.lock();
    ++ran_;
    ran_cv_.notify_all();
  }
}

}  // namespace strata
