// optim/step_rates.h: measures, on this machine, the rates that bound an optimizer step split
// between the GPU and the host (rt::StepRates): the link each way and both ways at once, the host
// Adam kernel on the given threads with the link idle and while it copies both ways, the link
// meanwhile, host memory bandwidth, and the GPU Adam kernel.
//
// Note [Measuring the step's rates]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The rates are measured as the step will use them, not as a datasheet gives them: copies between
// pinned host memory and GPU memory on the runtime's device, timed with device events; the host
// kernel over pinned buffers on the pool the step uses, timed on the host, once alone and once
// while copies run both ways for longer than it does. Host Adam and DMA share host memory, so the
// second rate is the one a hybrid step sees, and so are the link's rates meanwhile: the copies
// come in small pieces with an event after each, and the pieces done when the kernel is done,
// over the time since they were queued, give each direction's rate beside the kernel. The kernel
// runs over its buffer as many times as last loaded_seconds, so that those rates are over many
// pieces. Host memory is also measured as a copy between two pageable buffers split over the same
// pool (reported; the cost model does not use it). Each figure is the best of a few repeats (the
// first run of each also faults its pages in). Buffers come from the runtime's allocator and go
// back before it returns, their segments to the driver too (the GPU and pinned tiers are trimmed),
// so it must run before a budget is full and leaves no memory behind; it waits on the device (host
// syncs), so at setup only. On the simulated device the link figures are host copies: they say
// nothing about a GPU.
//
// Example:
//   ThreadPool pool(16);
//   STRATA_ASSIGN_OR_RETURN(rt::StepRates rates, measure_step_rates(runtime, pool, {}));
//   std::printf("%s\n", rt::describe(rates).c_str());
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "base/thread_pool.h"
#include "optim/state_codec.h"
#include "optim/step_rule.h"
#include "runtime/runtime.h"
#include "runtime/step_costs.h"

namespace strata::optim {

struct MeasureOptions {
  std::size_t link_bytes = std::size_t{64} << 20;  // per copy
  // The host kernel's run (2^26: 1 GiB of pinned float32, larger than the host's caches, as a
  // model's states are; halved down to 2^20 while the pinned tier has no room for it); the GPU
  // kernel's is 2^24 or this if smaller.
  std::int64_t adam_params = std::int64_t{1} << 26;
  std::size_t memory_bytes = std::size_t{256} << 20;  // host memory copy
  int repeats = 3;
  // How long the host kernel runs beside the copies (passes over its buffer, 1 to 64).
  double loaded_seconds = 0.04;
  // The rule whose kernels are timed (null: Adam), their moments stored as `moments` says: the
  // step's rates are those of its own kernels.
  const StepRule* rule = nullptr;
  StateType moments = StateType::kF32;
};

[[nodiscard]] absl::StatusOr<rt::StepRates> measure_step_rates(rt::Runtime& runtime,
                                                               ThreadPool& pool,
                                                               const MeasureOptions& options);

}  // namespace strata::optim
