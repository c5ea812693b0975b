// apps/train/phase_switch.h: strata-train's phase switch (--phase_switch_every=N), what an RL
// trainer does between training and rollout: everything training keeps on the GPU goes to host
// memory, torch's cache is emptied, a stand-in for the rollout engine allocates through torch as
// much of the freed GPU memory as it can and frees it, and everything comes back. The same
// procedure times a strata run (Runtime::offload_all / reload_all) and a PyTorch run (.to() of
// parameters, gradients and Adam states), each from the run's own operations.
//
// Example:
//   PhaseSwitchOps ops{.offload = [&] { bridge::check(rt.offload_all()); },
//                      .reload = [&] { bridge::check(rt.reload_all()); },
//                      .gpu_bytes = [&] { return rt.stats().gpu_reserved_bytes; },
//                      .moved_bytes = [&] { ... }};
//   result.phase_switches.push_back(phase_switch(options, step, ops));
#pragma once

#include <cstdint>
#include <functional>
#include <utility>

#include "apps/train/train.h"

namespace strata::apps {

// What a run does at a switch; offload and reload throw (c10::Error) on failure.
struct PhaseSwitchOps {
  std::function<void()> offload;
  std::function<void()> reload;
  // The run's own GPU memory now: a strata run's GPU tier and staging ring; a PyTorch run's
  // model and optimizer state.
  std::function<std::int64_t()> gpu_bytes;
  // Bytes moved so far, host -> GPU and GPU -> host.
  std::function<std::pair<std::int64_t, std::int64_t>()> moved_bytes;
  // Host memory pinned so far (a strata run: its pinned tier's segment allocations); may be empty.
  std::function<std::int64_t()> pinned_allocations;
  // Nanoseconds spent so far in cudaMalloc and in cudaFree for the run's GPU memory (a strata run:
  // its GPU tier's upstream calls); may be empty.
  std::function<std::pair<std::int64_t, std::int64_t>()> gpu_upstream_ns;
};

// Switches out and back after `after_step`, on the run's device; throws what ops throw.
PhaseSwitchRecord phase_switch(const TrainOptions& options, int after_step,
                               const PhaseSwitchOps& ops);

}  // namespace strata::apps
