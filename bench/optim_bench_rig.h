// bench/optim_bench_rig.h: the Google Benchmark side of strata_optim_bench's rig: one approach's
// rig at a time, kept across the repetitions of its benchmark and freed (with what LibTorch cached
// for it) before the next approach's; the timing loops of strata's steps and of the LibTorch
// offloading peers; and the counters every benchmark reports (the floor, the runtime's deltas).
// The model, the floors and the rigs themselves: bench/optim_common.h, bench/optim_torch.h.
//
// Example:
//   absl::StatusOr<StrataRig*> made = strata_rig(full_model(), "layer_prefetch", 1,
//                                                rt::DeviceKind::kCuda);
//   if (!made.ok()) return skip(state, "runtime", made.status());
//   LinkFloor link(LinkFloor::kConcurrent);
//   auto step = sampled(link, [&] { return time_to_idle([&] { return (*made)->adam->step(); }); });
//   const std::optional<StrataTimed> timed = time_strata_steps(state, *(*made)->runtime, step);
//   if (!timed) return;
//   report_offloaded(state, link, full_model().moment_bytes(), timed->step_ms);
//   report_runtime(state, timed->before, timed->after);
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <benchmark/benchmark.h>

#include "absl/status/statusor.h"
#include "bench/optim_common.h"
#include "bench/optim_torch.h"
#include "bench/runtime_rig.h"
#include "runtime/device.h"
#include "runtime/runtime.h"

namespace strata::bench {

// A timed step: its milliseconds, or the error that skips the benchmark.
using StepFn = std::function<absl::StatusOr<double>()>;

// False, with the benchmark skipped, when main could not measure the bandwidths (g_bw).
bool require_bandwidths(benchmark::State& state);

// ---------------------------------------------------------------------------------------------
// Counters.

// step_ms, floor_ms and ratio_to_floor (0 without a floor).
void report_floor(benchmark::State& state, double step_ms, double floor_ms);

// A resident step of `model` against its floor, 28 B/param over the HBM bandwidth of g_bw:
// report_floor's counters and hbm_gbps, achieved_gbps, params. Returns achieved_gbps.
double report_resident(benchmark::State& state, const Model& model, double step_ms);

#ifdef STRATA_HAS_CUDA
// The floor's denominator(s), as counters.
void report_link(benchmark::State& state, const LinkFloor& link);

// An offloaded step that moves `moments` each way against `link`'s floor: report_floor's
// counters, moment_bytes and report_link's.
void report_offloaded(benchmark::State& state, const LinkFloor& link, double moments,
                      double step_ms);
#endif

// Counters every strata benchmark reports: deltas over the timed steps, per step where it says so.
void report_runtime(benchmark::State& state, const Snapshot& before, const Snapshot& after);

// ---------------------------------------------------------------------------------------------
// One approach's rig at a time, kept across the repetitions of its benchmark.

// Frees the current rig and whatever the libraries cached for it, so the next approach starts
// with the GPU (and pinned memory) as the first one found it.
void release_rig();
// The current rig if it is the one named `key`, else nullptr.
Rig* kept_rig(std::string_view key);
// Makes `rig` the current one, named `key`.
void keep_rig(std::unique_ptr<Rig> rig, std::string_view key);

// The rig named `key`, made by `make` (a StatusOr<unique_ptr<R>>) unless it is the current one.
template <typename R, typename Make>
absl::StatusOr<R*> rig(std::string_view key, Make make) {
  if (Rig* kept = kept_rig(key); kept != nullptr) return static_cast<R*>(kept);
  release_rig();
  absl::StatusOr<std::unique_ptr<R>> made = make();
  if (!made.ok()) {
    release_rig();
    return made.status();
  }
  R* out = made->get();
  keep_rig(std::move(*made), key);
  return out;
}

// strata's rig for `policy` at prefetch depth `depth` on `device` (make_strata_rig), kept.
absl::StatusOr<StrataRig*> strata_rig(const Model& model, std::string policy, int depth,
                                      rt::DeviceKind device);

// ---------------------------------------------------------------------------------------------
// Timing.

// kWarmupSteps untimed steps; false, with the benchmark skipped, on an error.
bool warm_up(benchmark::State& state, const StepFn& step);

// One step per iteration, its milliseconds the iteration's time, before_each and after_each (if
// given) around it outside the clock. The mean step in ms, or std::nullopt (the benchmark skipped
// on an error).
std::optional<double> time_steps(benchmark::State& state, const StepFn& step,
                                 const std::function<void()>& before_each = {},
                                 const std::function<void()>& after_each = {});

// The strata benchmarks' timing: warm-up steps, then time_steps with the runtime's counters read
// around the timed steps; after_each (if given) runs after each timed step, for figures a step
// leaves behind. std::nullopt, with the benchmark skipped, on an error.
struct StrataTimed {
  double step_ms = 0;
  Snapshot before, after;
};
std::optional<StrataTimed> time_strata_steps(benchmark::State& state, rt::Runtime& runtime,
                                             const StepFn& step,
                                             const std::function<void()>& after_each = {});

#ifdef STRATA_BENCH_TORCH
// The LibTorch offloading peers' timing: warm-up steps, then time_steps with the caching
// allocator's peak restarted (outside the clock) from what is allocated before each step.
// std::nullopt, with the benchmark skipped, on an error.
struct TimedSteps {
  double step_ms = 0;
  double peak_extra = 0;  // the caching allocator's peak above what was allocated before a step
};
std::optional<TimedSteps> time_torch_offload_steps(benchmark::State& state, const StepFn& step);
#endif

}  // namespace strata::bench
