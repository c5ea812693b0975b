// apps/train/torch_device.h (internal to apps/train/): the few things every part of strata-train
// does with torch's device: wall-clock timing after a synchronize, a step's clock (StepClock,
// See Note [Step end]) and torch's CUDA cache. Scalars are read with bridge::ScalarReader, which
// does not wait behind the copies a step leaves running.
//
// Example:
//   const Clock::time_point start = Clock::now();
//   ...; synchronize(options);
//   const double ms = ms_since(start);
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <optional>
#include <utility>

#include "apps/train/train.h"

#ifdef STRATA_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace strata::apps {

using Clock = std::chrono::steady_clock;

inline double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

inline torch::Device device_of(const TrainOptions& o) {
  return o.cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
}

inline void synchronize(const TrainOptions& o) {
  if (o.cuda) torch::cuda::synchronize();
}

// Waits for torch's current stream only: copies on other streams may still run.
inline void synchronize_torch_stream(const TrainOptions& o) {
#ifdef STRATA_HAS_CUDA
  if (o.cuda) c10::cuda::getCurrentCUDAStream().synchronize();
#else
  (void)o;
#endif
}

// torch sets up its CUDA allocator lazily, on the first CUDA tensor; its statistics calls fail
// ("Invalid device argument") before that, so the first of them sets it up.
inline void init_torch_cuda(const TrainOptions& o) {
#ifdef STRATA_HAS_CUDA
  if (o.cuda) at::globalContext().lazyInitDevice(at::kCUDA);
#else
  (void)o;
#endif
}

// Gives torch's cached GPU memory back to the driver.
inline void release_torch_cache(const TrainOptions& o) {
  init_torch_cuda(o);
#ifdef STRATA_HAS_CUDA
  if (o.cuda) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

// Note [Step end]
// ~~~~~~~~~~~~~~~
// A training loop does not wait for the whole GPU at the end of a step; it reads the loss, which
// waits for the stream the model computes on. So with StepEnd::kStream a step's time ends when
// torch's current stream and the runtime's compute stream have done its work, and copies still
// running then (the write-backs of the layers the optimizer stepped last, a .to() baseline's states
// on their way home) run on into the next step's forward. Whatever the next step has to wait for (a
// staging slot not yet written back, a home block not yet filled) it waits for on the GPU, inside
// its own time, so each step's time runs from the previous step's end: the times add up to the wall
// time of the run, less the wait for the last step's copies, reported apart as RunResult::drain_ms.
// After a phase switch, which synchronizes everything, the next step's time starts afresh. The
// traced step (the run's last) waits on the host for what the step before left running, inside its
// time, so that its trace holds its own copies alone: a little slower than the others, never
// faster. StepEnd::kDevice waits for every stream at the end of each step, as strata-train did
// before.
class StepClock {
 public:
  StepClock(const TrainOptions& o, std::function<void()> wait_for_streams)
      : o_(o), wait_for_streams_(std::move(wait_for_streams)) {}
  bool stream_end() const { return o_.step_end == TrainOptions::StepEnd::kStream; }
  // The step's start: the previous step's end while nothing synchronized since.
  Clock::time_point start() const { return last_end_.value_or(Clock::now()); }
  // Waits for the step's work (See Note [Step end]).
  void wait() const {
    if (!stream_end()) return synchronize(o_);
    synchronize_torch_stream(o_);
    if (wait_for_streams_) wait_for_streams_();
  }
  // Ends the step begun at `start`; its time in ms.
  double end(Clock::time_point start) {
    const Clock::time_point now = Clock::now();
    if (stream_end()) last_end_ = now;
    return std::chrono::duration<double, std::milli>(now - start).count();
  }
  // Everything synchronized: the next step's time starts afresh.
  void synchronized() { last_end_.reset(); }
  // After the last step: waits for every stream; the time that took with StepEnd::kStream.
  double drain(const std::function<void()>& wait_all) {
    const Clock::time_point start = Clock::now();
    synchronize(o_);
    if (wait_all) wait_all();
    last_end_.reset();
    return stream_end() ? ms_since(start) : 0.0;
  }

 private:
  const TrainOptions& o_;
  std::function<void()> wait_for_streams_;
  std::optional<Clock::time_point> last_end_;
};

}  // namespace strata::apps
