// base/serial_worker.h: one host thread, started once, that runs the jobs posted to it in order
// while the poster goes on (a host-stepped layer's step during backward: See Note [Host steps in
// backward] in optim/adam_host_speculation.cpp).
//
//   strata::SerialWorker worker;
//   const auto first = worker.post([&] { step_layer_on_the_host(3); });  // returns at once
//   worker.post([&] { step_layer_on_the_host(2); });                     // runs after the first
//   worker.wait(first);                                                  // once the first ran
//   worker.drain();                                                      // once both have run
//
// Jobs run one at a time on the worker's thread, in the order posted. post() returns the job's
// ticket; wait(ticket) returns once that job has run, and drain() once every job posted before it
// has (what a job wrote is then visible to the caller). The destructor drains, then stops and
// joins the thread. A job must not post to, wait for or drain its own worker.
#pragma once

#include <condition_variable>
#include <cstdint>
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

  // Tickets count from 1, in the order jobs are posted.
  using Ticket = std::uint64_t;

  Ticket post(std::function<void()> job);
  void wait(Ticket ticket);
  void drain();

 private:
  void work();

  std::mutex mu_;
  std::condition_variable posted_cv_;  // a job was posted, or stop_
  std::condition_variable ran_cv_;     // a job has run
  std::deque<std::function<void()>> jobs_;
  Ticket posted_ = 0;  // the last job's ticket
  Ticket ran_ = 0;     // every job up to this ticket has run
  bool stop_ = false;
  std::thread thread_;  // last: started once the members above are
};

}  // namespace strata
