// base/serial_worker.h: one host thread, started once, that runs the jobs posted to it in order
// while the poster goes on (a host-stepped layer's step during backward: See Note [Host steps in
// backward] in optim/adam_host_speculation.cpp).
//
//   strata::SerialWorker worker;
//   worker.post([&] { step_layer_on_the_host(3); });   // returns at once
//   worker.post([&] { step_layer_on_the_host(2); });   // runs after the first
//   worker.drain();                                    // returns once both have run
//
// Jobs run one at a time on the worker's thread, in the order posted. drain() returns once every
// job posted before it has run (what a job wrote is then visible to the caller). The destructor
// drains, then stops and joins the thread. A job must not post to or drain its own worker.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace strata {

class SerialWorker {
 public:
  SerialWorker();
  ~SerialWorker();
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  void post(std::function<void()> job);
  void drain();

 private:
  void work();

  std::mutex mu_;
  std::condition_variable posted_cv_;  // a job was posted, or stop_
  std::condition_variable idle_cv_;    // the queue emptied and no job runs
  std::deque<std::function<void()>> jobs_;
  bool running_ = false;  // a job taken from jobs_ runs now
  bool stop_ = false;
  std::thread thread_;  // last: started once the members above are
};

}  // namespace strata
