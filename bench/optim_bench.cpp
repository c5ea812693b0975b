// bench/optim_bench.cpp: the optimizer step of a 1.5B-parameter model under each strata policy,
// next to the PyTorch ways of doing the same step, all in one process on the same shapes.
//
// Model: 1.536e9 fp32 parameters in 32 layers of 48e6 (four tensors per layer, 12e6 + 4e6 + 16e6
// + 16e6: the qkv, output, fc1 and fc2 weights of a width-2000 transformer block), AdamW with
// lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01. Parameters and gradients are
// pseudo-random (never zeros), filled once; the gradients stay fixed. Moments: 8 B per parameter,
// 12.288e9 B (PERF.md's "12.3 GB").
//
// Measures (targets in /work/shared/PERF.md and issue 4, "Must show"):
//   BM_StrataResident          optim::Adam over a keep_on_gpu runtime: everything on the GPU.
//                              CUDA events on the compute stream. floor_ms = 28 B/param over the
//                              HBM bandwidth measured in this run (a 2 GiB device-to-device copy,
//                              read + write counted).
//   BM_TorchFusedAdamW         at::_fused_adamw_ over the same shapes, all resident (with the
//                              _foreach_add_ of the step counters, as torch.optim.AdamW does).
//                              CUDA events on the current stream. Target: strata resident <= 1.00x.
//   BM_StrataBulk              policy bulk, roles optimizer states: reload_all(), step(),
//                              offload_all(moments, keep_cached) per step. floor = 12.3 GB over the
//                              raw pinned H2D bandwidth + 12.3 GB over the raw D2H bandwidth (each
//                              alone).
//   BM_TorchBulkTo             moments in pinned CPU tensors: .to(cuda, non_blocking) for all,
//                              fused step, copy_(non_blocking) back into the pinned tensors,
//                              synchronize. Peak extra GPU memory from the caching allocator.
//   BM_TorchPerLayerPipeline   the per-layer pipeline written with LibTorch streams: an H2D and a
//                              D2H stream from the pool, compute on the current stream, 2 staging
//                              slots of one layer's moments, events between the three.
//   BM_StrataLayerPrefetch/K   policy layer_prefetch with prefetch depth K (1, 2): moments in
//                              pinned host memory, parameters and gradients on the GPU. floor =
//                              12.3 GB each way over the raw per-direction pinned bandwidth with
//                              both directions running at once. Targets: step <= 1.03 x floor and
//                              faster than BM_TorchPerLayerPipeline; peak extra GPU memory (the
//                              staging ring) <= (K + 1) x the largest layer's moments + 1%.
//                              After the timed steps, one more step with its copies traced
//                              (runtime/copy_trace.h): trace_* counters say how long each
//                              direction of the link copied alone, with the other, or not at
//                              all; STRATA_TRACE_DIR=DIR also writes the copies as CSV.
//   BM_TorchCpuAdamW           torch::optim::AdamW on CPU tensors, 1/8 of the model (4 layers);
//                              ms_scaled = time x 8; transfers not counted.
//   BM_SimulatedLayerPrefetch  layer_prefetch K=1 on the simulated device, 2 layers x 64K params:
//                              the one benchmark that runs without a GPU.
// Floors of the offloaded approaches: the raw pinned bandwidth comes from passes of the link rig
// (16 x 256 MiB each way) right before each step, outside its clock, warm-up steps included, so
// each step is judged against the link as it was then (See Note [Adjacent floor] in link_rig.h);
// main's start-of-run figures stay in the JSON context for reference.
// Timing: the resident approaches with CUDA events around the step on the stream that computes;
// the offloaded ones with host wall time from an idle device to cudaDeviceSynchronize() after the
// step (the write-back of the last layer is part of the step). Warm-up: 2 steps per repetition.
// After every benchmark the first and last tensors' first and last 1024 elements (parameters, and
// exp_avg where it can be read) are compared with a host AdamW over the same number of steps, so a
// fast but wrong step fails the run.
//
// Memory: one approach's state at a time (a rig, kept across the repetitions of a benchmark and
// freed before the next approach starts, LibTorch's caches emptied): at most ~25 GB of GPU memory
// (resident: parameters, gradients and both moments) and ~14 GB of pinned host memory, plus the
// link rig's 8 GiB of GPU and 8 GiB of pinned memory, made in main before any rig (where the HBM
// and start-of-run link bandwidths are measured) and kept to the end.
//
// Run (on a machine without a GPU everything but the simulated benchmark reports "no GPU"):
//   build/bin/strata_optim_bench --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true
//       --benchmark_out=optim_bench.json --benchmark_out_format=json   (one command line)
//   python3 tools/gpu/summarize_optim.py optim_bench.json
// The JSON context carries the GPU name, the model's sizes, and the measured HBM and pinned
// bandwidths.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>

#include "bench/optim_common.h"
#include "bench/optim_torch.h"

#ifdef STRATA_BENCH_TORCH
#include <ATen/Parallel.h>
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/version.h>
#endif

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/stats.h"
#include "allocator/tier.h"
#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "bench/bench_util.h"
#include "policies/builtin.h"

namespace {

using namespace strata::bench;  // NOLINT: the benchmark's whole vocabulary
namespace rt = strata::rt;
using strata::str_cat;
using strata::alloc::Tier;

[[maybe_unused]] bool require_bandwidths(benchmark::State& state) {
  if (g_bw.measured) return true;
  skip(state, str_cat("bandwidths for the floor: ", g_bw.error));
  return false;
}

#ifdef STRATA_HAS_CUDA
// The floor's denominator(s), as counters.
void report_link(benchmark::State& state, const LinkFloor& link) {
  if (link.kind() == LinkFloor::kConcurrent) {
    state.counters["link_per_direction_gbps"] = link.per_direction_gbps();
  } else {
    state.counters["link_h2d_gbps"] = link.h2d_gbps();
    state.counters["link_d2h_gbps"] = link.d2h_gbps();
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// One approach's rig at a time, kept across the repetitions of its benchmark.

std::unique_ptr<Rig> g_rig;
std::string g_rig_key;

// Frees the current rig and whatever the libraries cached for it, so the next approach starts
// with the GPU (and pinned memory) as the first one found it.
void release_rig() {
#ifdef STRATA_HAS_CUDA
  if (have_gpu()) (void)cudaDeviceSynchronize();
#endif
  g_rig.reset();
  g_rig_key.clear();
#ifdef STRATA_BENCH_TORCH
  if (torch_used()) {
    (void)cudaDeviceSynchronize();
    c10::cuda::CUDACachingAllocator::emptyCache();
    at::getHostAllocator(at::kCUDA)->empty_cache();
  }
#endif
}

// The rig named `key`, made by `make` (a StatusOr<unique_ptr<R>>) unless it is the current one.
template <typename R, typename Make>
absl::StatusOr<R*> rig(std::string_view key, Make make) {
  if (g_rig != nullptr && g_rig_key == key) return static_cast<R*>(g_rig.get());
  release_rig();
  absl::StatusOr<std::unique_ptr<R>> made = make();
  if (!made.ok()) {
    release_rig();
    return made.status();
  }
  R* out = made->get();
  g_rig = std::move(*made);
  g_rig_key = std::string(key);
  return out;
}

absl::StatusOr<StrataRig*> strata_rig(const Model& model, std::string policy, int depth,
                                      rt::DeviceKind device) {
  const std::string key =
      str_cat("strata/", policy, "/", depth, device == rt::DeviceKind::kCuda ? "/cuda" : "/sim");
  return rig<StrataRig>(key, [&] { return make_strata_rig(model, policy, depth, device); });
}

// What the benchmarks read before and after the timed steps.
struct Snapshot {
  std::int64_t gpu_segment_allocs = 0;
  std::int64_t pinned_segment_allocs = 0;
  rt::RuntimeStats runtime;
};

Snapshot snapshot(rt::Runtime& runtime) {
  return {runtime.allocator().stats(Tier::kGpu).num_segment_allocs,
          runtime.allocator().stats(Tier::kPinnedHost).num_segment_allocs, runtime.stats()};
}

// Counters every strata benchmark reports: deltas over the timed steps, per step where it says so.
void report_runtime(benchmark::State& state, const Snapshot& before, const Snapshot& after) {
  const double steps = static_cast<double>(state.iterations());
  const rt::RuntimeStats& a = after.runtime;
  const rt::RuntimeStats& b = before.runtime;
  state.counters["host_syncs"] = static_cast<double>(a.host_syncs - b.host_syncs) / steps;
  // Both must be 0: no cudaMalloc or pinning once warm.
  state.counters["gpu_segment_allocs"] =
      static_cast<double>(after.gpu_segment_allocs - before.gpu_segment_allocs);
  state.counters["pinned_segment_allocs"] =
      static_cast<double>(after.pinned_segment_allocs - before.pinned_segment_allocs);
  state.counters["failed_migrations"] =
      static_cast<double>(a.failed_migrations - b.failed_migrations);
  state.counters["h2d_bytes_per_step"] =
      bytes_counter(static_cast<double>(a.migrated_bytes_h2d - b.migrated_bytes_h2d) / steps);
  state.counters["d2h_bytes_per_step"] =
      bytes_counter(static_cast<double>(a.migrated_bytes_d2h - b.migrated_bytes_d2h) / steps);
  const double h2d_ms = a.h2d_busy_ms - b.h2d_busy_ms;
  const double d2h_ms = a.d2h_busy_ms - b.d2h_busy_ms;
  if (h2d_ms > 0) {
    state.counters["engine_h2d_gbps"] =
        gb_per_s(static_cast<double>(a.timed_bytes_h2d - b.timed_bytes_h2d), h2d_ms / 1e3);
  }
  if (d2h_ms > 0) {
    state.counters["engine_d2h_gbps"] =
        gb_per_s(static_cast<double>(a.timed_bytes_d2h - b.timed_bytes_d2h), d2h_ms / 1e3);
  }
}

// The strata benchmarks' timing: warm-up steps, then one step per iteration, with the runtime's
// counters read around the timed steps. after_each (if given) runs after each timed step, for
// figures a step leaves behind. std::nullopt, with the benchmark skipped, on an error.
struct StrataTimed {
  double step_ms = 0;
  Snapshot before, after;
};
std::optional<StrataTimed> time_strata_steps(benchmark::State& state, rt::Runtime& runtime,
                                             const std::function<absl::StatusOr<double>()>& step,
                                             const std::function<void()>& after_each = {}) {
  for (int i = 0; i < kWarmupSteps; ++i) {
    if (absl::StatusOr<double> w = step(); !w.ok()) {
      skip(state, "warm-up step", w.status());
      return std::nullopt;
    }
  }
  StrataTimed out;
  out.before = snapshot(runtime);
  double total_ms = 0;
  for (auto _ : state) {
    absl::StatusOr<double> ms = step();
    if (!ms.ok()) {
      skip(state, "step", ms.status());
      break;
    }
    total_ms += *ms;
    if (after_each) after_each();
    state.SetIterationTime(*ms / 1e3);
  }
  if (state.error_occurred() || state.iterations() == 0) return std::nullopt;
  out.after = snapshot(runtime);
  out.step_ms = total_ms / static_cast<double>(state.iterations());
  return out;
}

void BM_StrataResident(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifdef STRATA_HAS_CUDA
  if (!require_bandwidths(state)) return;
  const Model& model = full_model();
  absl::StatusOr<StrataRig*> made = strata_rig(model, "keep_on_gpu", 0, rt::DeviceKind::kCuda);
  if (!made.ok()) return skip(state, "keep_on_gpu runtime with the model", made.status());
  StrataRig& r = **made;
  rt::Runtime& runtime = *r.runtime;
  const auto stream = static_cast<cudaStream_t>(runtime.compute_stream());
  EventPair ev;
  auto step = [&] { return time_on_stream(ev, stream, [&] { return r.adam->step(); }); };
  const std::optional<StrataTimed> timed = time_strata_steps(state, runtime, step);
  if (!timed) return;
  const Snapshot& before = timed->before;
  const Snapshot& after = timed->after;
  if (absl::Status s = check_strata("strata resident", r); !s.ok()) {
    return skip(state, "result check", s);
  }
  const double step_ms = timed->step_ms;
  const double bytes = kResidentBytesPerParam * static_cast<double>(model.params());
  const double floor_ms = ms_at(bytes, g_bw.hbm_gbps);
  state.counters["step_ms"] = step_ms;
  state.counters["floor_ms"] = floor_ms;
  state.counters["ratio_to_floor"] = floor_ms > 0 ? step_ms / floor_ms : 0;
  state.counters["hbm_gbps"] = g_bw.hbm_gbps;
  state.counters["achieved_gbps"] = gb_per_s(bytes, step_ms / 1e3);
  state.counters["hbm_fraction"] =
      g_bw.hbm_gbps > 0 ? gb_per_s(bytes, step_ms / 1e3) / g_bw.hbm_gbps : 0;
  state.counters["peak_extra_gpu_bytes"] = bytes_counter(0);
  state.counters["params"] = static_cast<double>(model.params());
  report_runtime(state, before, after);
  state.SetLabel(str_cat("optim::Adam (AdamW), policy keep_on_gpu, ", model.describe(),
                         ", CUDA events on the compute stream; floor 28 B/param over HBM"));
#endif
}
BENCHMARK(BM_StrataResident)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);

// What the bulk policy streams and BM_TorchBulkTo moves: the moments, not offload_all's default of
// every role; the GPU memory stays in strata's pool between steps, as it stays in LibTorch's cache
// for the peer (strata_optim_compare also times the default, memory back to the driver).
const rt::OffloadOptions kMomentsCached{.roles = rt::RoleSet::optimizer_states(),
                                        .keep_cached = true};

void BM_StrataBulk(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifdef STRATA_HAS_CUDA
  if (!require_bandwidths(state)) return;
  const Model& model = full_model();
  absl::StatusOr<StrataRig*> made = strata_rig(model, "bulk", 0, rt::DeviceKind::kCuda);
  if (!made.ok()) return skip(state, "bulk runtime with the model", made.status());
  StrataRig& r = **made;
  rt::Runtime& runtime = *r.runtime;

  // Steps start with the moments offloaded, as after the previous step of a bulk loop.
  double reload_ms = 0;
  LinkFloor link(LinkFloor::kSequential);
  auto step = sampled(link, [&]() -> absl::StatusOr<double> {
    return time_to_idle([&]() -> absl::Status {
      const Clock::time_point t0 = Clock::now();
      STRATA_RETURN_IF_ERROR(runtime.reload_all());
      reload_ms = seconds_between(t0, Clock::now()) * 1e3;
      STRATA_RETURN_IF_ERROR(r.adam->step());
      return runtime.offload_all(kMomentsCached);
    });
  });
  if (absl::Status s = runtime.offload_all(kMomentsCached); !s.ok()) {
    return skip(state, "first offload_all", s);
  }
  // Extra GPU memory during the step: the allocator's GPU bytes with the moments reloaded, less
  // with them offloaded (measured in the warm-up, outside the clock).
  // wait_all() makes sure the sources of the completed moves are freed before the reading.
  double peak_extra = 0;
  {
    absl::Status s = runtime.wait_all();
    const std::int64_t offloaded = runtime.allocator().stats(Tier::kGpu).allocated_bytes.current;
    if (s.ok()) s = runtime.reload_all();
    if (s.ok()) s = runtime.wait_all();
    const std::int64_t loaded = runtime.allocator().stats(Tier::kGpu).allocated_bytes.current;
    peak_extra = static_cast<double>(loaded - offloaded);
    if (s.ok()) s = runtime.offload_all(kMomentsCached);
    if (s.ok()) s = runtime.wait_all();
    if (!s.ok()) return skip(state, "reload_all / offload_all before the steps", s);
  }
  double total_reload_ms = 0;
  const std::optional<StrataTimed> timed =
      time_strata_steps(state, runtime, step, [&] { total_reload_ms += reload_ms; });
  if (!timed) return;
  const Snapshot& before = timed->before;
  const Snapshot& after = timed->after;
  if (absl::Status s = check_strata("strata bulk", r); !s.ok()) {
    return skip(state, "result check", s);
  }
  const double steps = static_cast<double>(state.iterations());
  const double step_ms = timed->step_ms;
  const double moments = model.moment_bytes();
  // Out and back are two phases one after the other, each over one direction of the link.
  const double floor_ms = link.floor_ms(moments);
  state.counters["step_ms"] = step_ms;
  state.counters["reload_ms"] = total_reload_ms / steps;
  state.counters["step_and_offload_ms"] = step_ms - total_reload_ms / steps;
  state.counters["floor_ms"] = floor_ms;
  state.counters["ratio_to_floor"] = floor_ms > 0 ? step_ms / floor_ms : 0;
  state.counters["moment_bytes"] = bytes_counter(moments);
  state.counters["peak_extra_gpu_bytes"] = bytes_counter(peak_extra);
  report_link(state, link);
  report_runtime(state, before, after);
  state.SetLabel(
      str_cat("reload_all + optim::Adam step + offload_all, policy bulk, roles "
              "optimizer states, ",
              model.describe(),
              ", host wall to device idle; floor: moments over raw pinned H2D + over raw "
              "pinned D2H, each alone, passes before each step"));
#endif
}

void BM_StrataLayerPrefetch(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifdef STRATA_HAS_CUDA
  if (!require_bandwidths(state)) return;
  const int depth = static_cast<int>(state.range(0));
  const Model& model = full_model();
  absl::StatusOr<StrataRig*> made =
      strata_rig(model, "layer_prefetch", depth, rt::DeviceKind::kCuda);
  if (!made.ok()) return skip(state, "layer_prefetch runtime with the model", made.status());
  StrataRig& r = **made;
  rt::Runtime& runtime = *r.runtime;
  LinkFloor link(LinkFloor::kConcurrent);
  auto step = sampled(link, [&] { return time_to_idle([&] { return r.adam->step(); }); });
  const std::optional<StrataTimed> timed = time_strata_steps(state, runtime, step);
  if (!timed) return;
  const Snapshot& before = timed->before;
  const Snapshot& after = timed->after;
  const std::int64_t used_after = device_used_bytes();
  absl::StatusOr<strata::rt::LinkUse> use = traced_step(r, str_cat("layer_prefetch_k", depth));
  if (!use.ok()) return skip(state, "traced step", use.status());
  if (absl::Status s = check_strata(str_cat("strata layer_prefetch K=", depth), r); !s.ok()) {
    return skip(state, "result check", s);
  }
  const double steps = static_cast<double>(state.iterations());
  const double step_ms = timed->step_ms;
  const double moments = model.moment_bytes();
  const double floor_ms = link.floor_ms(moments);
  const double largest = largest_layer_moment_bytes(runtime);
  const double peak_extra = static_cast<double>(after.runtime.staging_bytes);
  const double bound = (depth + 1) * largest;
  state.counters["step_ms"] = step_ms;
  state.counters["floor_ms"] = floor_ms;
  state.counters["ratio_to_floor"] = floor_ms > 0 ? step_ms / floor_ms : 0;
  state.counters["prefetch_depth"] = depth;
  state.counters["moment_bytes"] = bytes_counter(moments);
  report_link(state, link);
  state.counters["achieved_gbps_per_direction"] = gb_per_s(moments, step_ms / 1e3);
  state.counters["peak_extra_gpu_bytes"] = bytes_counter(peak_extra);
  state.counters["staged_peak_bytes"] =
      bytes_counter(static_cast<double>(after.runtime.staged_peak_bytes));
  state.counters["largest_layer_moment_bytes"] = bytes_counter(largest);
  state.counters["extra_over_bound"] = bound > 0 ? peak_extra / bound : 0;
  // Cross-check from the driver: device memory in use now less before the first step (the ring,
  // and anything else the steps made the pools take).
  if (used_after >= 0 && r.device_used_at_create >= 0) {
    state.counters["device_used_growth_bytes"] =
        bytes_counter(static_cast<double>(used_after - r.device_used_at_create));
  }
  state.counters["prefetch_hits"] =
      static_cast<double>(after.runtime.prefetch_hits - before.runtime.prefetch_hits) / steps;
  state.counters["prefetch_waits"] =
      static_cast<double>(after.runtime.prefetch_waits - before.runtime.prefetch_waits) / steps;
  state.counters["prefetch_stall_ms"] =
      static_cast<double>(after.runtime.prefetch_stall_ns - before.runtime.prefetch_stall_ns) /
      1e6 / steps;
  // The traced step: where the link went idle in one direction or both.
  state.counters["trace_span_ms"] = use->span_ms;
  state.counters["trace_both_ms"] = use->both_ms;
  state.counters["trace_h2d_alone_ms"] = use->h2d_alone_ms;
  state.counters["trace_d2h_alone_ms"] = use->d2h_alone_ms;
  state.counters["trace_neither_ms"] = use->neither_ms;
  state.counters["trace_h2d_gbps_both"] = gb_per_s(use->h2d_bytes_both, use->both_ms / 1e3);
  state.counters["trace_d2h_gbps_both"] = gb_per_s(use->d2h_bytes_both, use->both_ms / 1e3);
  state.counters["trace_h2d_gbps_alone"] = gb_per_s(use->h2d_bytes_alone, use->h2d_alone_ms / 1e3);
  state.counters["trace_d2h_gbps_alone"] = gb_per_s(use->d2h_bytes_alone, use->d2h_alone_ms / 1e3);
  report_runtime(state, before, after);
  state.SetLabel(str_cat("optim::Adam step, policy layer_prefetch K=", depth,
                         ", moments pinned, params and grads on the GPU, ", model.describe(),
                         ", host wall to device idle; floor 8 B/param each way over raw pinned "
                         "per-direction bandwidth with both directions at once, passes before "
                         "each step"));
#endif
}

#ifdef STRATA_BENCH_TORCH
absl::StatusOr<TorchOffloadRig*> torch_offload_rig(const Model& model) {
  return rig<TorchOffloadRig>("torch/offload", [&] { return make_torch_offload_rig(model); });
}
#else
bool require_torch(benchmark::State& state) {
  skip(state, "built without LibTorch (STRATA_WITH_TORCH off) or without CUDA");
  return false;
}
#endif

void BM_TorchFusedAdamW(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifndef STRATA_BENCH_TORCH
  (void)require_torch(state);
#else
  if (!require_bandwidths(state)) return;
  torch_guarded(state, [&] {
    const Model& model = full_model();
    absl::StatusOr<TorchResidentRig*> made =
        rig<TorchResidentRig>("torch/resident", [&] { return make_torch_resident_rig(model); });
    if (!made.ok()) return skip(state, "LibTorch tensors of the model", made.status());
    TorchResidentRig& r = **made;
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream();
    EventPair ev;
    auto step = [&] {
      return time_on_stream(ev, compute.stream(), [&] { return torch_resident_step(r); });
    };
    for (int i = 0; i < kWarmupSteps; ++i) {
      if (absl::StatusOr<double> w = step(); !w.ok())
        return skip(state, "warm-up step", w.status());
    }
    torch_reset_peak();
    const std::int64_t base = torch_allocated_now();
    double total_ms = 0;
    for (auto _ : state) {
      absl::StatusOr<double> ms = step();
      if (!ms.ok()) {
        skip(state, "step", ms.status());
        break;
      }
      total_ms += *ms;
      state.SetIterationTime(*ms / 1e3);
    }
    if (state.error_occurred() || state.iterations() == 0) return;
    const std::int64_t peak = torch_allocated_peak();
    absl::Status checked = check_torch_resident("torch fused AdamW", model, r);
    if (!checked.ok()) return skip(state, "result check", checked);
    const double step_ms = total_ms / static_cast<double>(state.iterations());
    const double bytes = kResidentBytesPerParam * static_cast<double>(model.params());
    const double floor_ms = ms_at(bytes, g_bw.hbm_gbps);
    state.counters["step_ms"] = step_ms;
    state.counters["floor_ms"] = floor_ms;
    state.counters["ratio_to_floor"] = floor_ms > 0 ? step_ms / floor_ms : 0;
    state.counters["hbm_gbps"] = g_bw.hbm_gbps;
    state.counters["achieved_gbps"] = gb_per_s(bytes, step_ms / 1e3);
    state.counters["peak_extra_gpu_bytes"] = bytes_counter(static_cast<double>(peak - base));
    state.counters["params"] = static_cast<double>(model.params());
    state.SetLabel(
        str_cat("at::_fused_adamw_ (+ _foreach_add_ of the float step counters), all "
                "resident, ",
                model.count(), " tensors in one call, ", model.describe(),
                ", CUDA events on the current stream"));
  });
#endif
}

#ifdef STRATA_BENCH_TORCH
struct TimedSteps {
  double step_ms = 0;
  double peak_extra = 0;  // the caching allocator's peak above what was allocated before a step
};

// The LibTorch offloading peers' timing: warm-up steps, then one step per iteration with the
// caching allocator's peak restarted (outside the clock) from what is allocated before it.
// std::nullopt, with the benchmark skipped, on an error.
std::optional<TimedSteps> time_torch_offload_steps(
    benchmark::State& state, const std::function<absl::StatusOr<double>()>& step) {
  for (int i = 0; i < kWarmupSteps; ++i) {
    if (absl::StatusOr<double> w = step(); !w.ok()) {
      skip(state, "warm-up step", w.status());
      return std::nullopt;
    }
  }
  double total_ms = 0;
  TimedSteps out;
  for (auto _ : state) {
    torch_reset_peak();
    const std::int64_t base = torch_allocated_now();
    absl::StatusOr<double> ms = step();
    if (!ms.ok()) {
      skip(state, "step", ms.status());
      break;
    }
    out.peak_extra = std::max(out.peak_extra, static_cast<double>(torch_allocated_peak() - base));
    total_ms += *ms;
    state.SetIterationTime(*ms / 1e3);
  }
  if (state.error_occurred() || state.iterations() == 0) return std::nullopt;
  out.step_ms = total_ms / static_cast<double>(state.iterations());
  return out;
}
#endif

void BM_TorchBulkTo(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifndef STRATA_BENCH_TORCH
  (void)require_torch(state);
#else
  if (!require_bandwidths(state)) return;
  torch_guarded(state, [&] {
    const Model& model = full_model();
    absl::StatusOr<TorchOffloadRig*> made = torch_offload_rig(model);
    if (!made.ok()) return skip(state, "LibTorch tensors of the model", made.status());
    TorchOffloadRig& r = **made;
    LinkFloor link(LinkFloor::kSequential);
    auto step = sampled(link, [&] { return time_to_idle([&] { return torch_bulk_step(r); }); });
    std::optional<TimedSteps> timed = time_torch_offload_steps(state, step);
    if (!timed) return;
    if (absl::Status s = check_torch_offload("torch bulk .to()", model, r); !s.ok()) {
      return skip(state, "result check", s);
    }
    const double step_ms = timed->step_ms;
    const double moments = model.moment_bytes();
    const double floor_ms = link.floor_ms(moments);
    state.counters["step_ms"] = step_ms;
    state.counters["floor_ms"] = floor_ms;
    state.counters["ratio_to_floor"] = floor_ms > 0 ? step_ms / floor_ms : 0;
    state.counters["moment_bytes"] = bytes_counter(moments);
    state.counters["peak_extra_gpu_bytes"] = bytes_counter(timed->peak_extra);
    report_link(state, link);
    state.SetLabel(
        str_cat("moments pinned CPU tensors: .to(cuda, non_blocking) all, "
                "at::_fused_adamw_, copy_(non_blocking) back, synchronize; ",
                model.describe(), ", host wall to device idle; floor as StrataBulk"));
  });
#endif
}

void BM_TorchPerLayerPipeline(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifndef STRATA_BENCH_TORCH
  (void)require_torch(state);
#else
  if (!require_bandwidths(state)) return;
  torch_guarded(state, [&] {
    const Model& model = full_model();
    absl::StatusOr<TorchOffloadRig*> made = torch_offload_rig(model);
    if (!made.ok()) return skip(state, "LibTorch tensors of the model", made.status());
    TorchOffloadRig& r = **made;
    LinkFloor link(LinkFloor::kConcurrent);
    auto step =
        sampled(link, [&] { return time_to_idle([&] { return torch_pipeline_step(model, r); }); });
    std::optional<TimedSteps> timed = time_torch_offload_steps(state, step);
    if (!timed) return;
    if (absl::Status s = check_torch_offload("torch per-layer pipeline", model, r); !s.ok()) {
      return skip(state, "result check", s);
    }
    const double step_ms = timed->step_ms;
    const double moments = model.moment_bytes();
    const double floor_ms = link.floor_ms(moments);
    report_link(state, link);
    state.counters["step_ms"] = step_ms;
    state.counters["floor_ms"] = floor_ms;
    state.counters["ratio_to_floor"] = floor_ms > 0 ? step_ms / floor_ms : 0;
    state.counters["moment_bytes"] = bytes_counter(moments);
    state.counters["achieved_gbps_per_direction"] = gb_per_s(moments, step_ms / 1e3);
    state.counters["peak_extra_gpu_bytes"] = bytes_counter(timed->peak_extra);
    state.counters["largest_layer_moment_bytes"] =
        bytes_counter(kMomentBytesPerParam * static_cast<double>(model.layer_numel()));
    state.SetLabel(
        str_cat("LibTorch streams: H2D + D2H from the pool, compute current, 2 slots "
                "of a layer's moments, CUDAEvents between them, at::_fused_adamw_ per "
                "layer; ",
                model.describe(), ", host wall to device idle; floor as StrataLayerPrefetch"));
  });
#endif
}

void BM_TorchCpuAdamW(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifndef STRATA_BENCH_TORCH
  (void)require_torch(state);
#else
  torch_guarded(state, [&] {
    const Model& model = cpu_model();
    struct CpuRig final : Rig {
      std::vector<at::Tensor> params;
      std::unique_ptr<torch::optim::AdamW> optimizer;
      std::int64_t step_count = 0;
    };
    absl::StatusOr<CpuRig*> made =
        rig<CpuRig>("torch/cpu", [&]() -> absl::StatusOr<std::unique_ptr<CpuRig>> {
          auto r = std::make_unique<CpuRig>();
          std::vector<at::Tensor> grads;
          STRATA_RETURN_IF_ERROR(make_torch_params(model, at::kCPU, r->params, grads));
          for (std::size_t k = 0; k < r->params.size(); ++k) {
            r->params[k].requires_grad_(true);
            r->params[k].mutable_grad() = grads[k];
          }
          r->optimizer = std::make_unique<torch::optim::AdamW>(
              r->params, torch::optim::AdamWOptions(kHyper.lr)
                             .betas(std::make_tuple(static_cast<double>(kHyper.beta1),
                                                    static_cast<double>(kHyper.beta2)))
                             .eps(kHyper.eps)
                             .weight_decay(kHyper.weight_decay));
          return r;
        });
    if (!made.ok()) return skip(state, "CPU tensors", made.status());
    CpuRig& r = **made;
    auto step = [&] {
      const Clock::time_point t0 = Clock::now();
      r.optimizer->step();
      ++r.step_count;
      return seconds_between(t0, Clock::now()) * 1e3;
    };
    for (int i = 0; i < kWarmupSteps; ++i) (void)step();
    double total_ms = 0;
    for (auto _ : state) {
      const double ms = step();
      total_ms += ms;
      state.SetIterationTime(ms / 1e3);
    }
    absl::Status checked = check_ends(
        "torch CPU AdamW", model, r.step_count,
        [&](int k, std::vector<float>& p, std::vector<float>& m) -> absl::Status {
          p = to_host_vector(r.params[k].detach());
          m.clear();  // the optimizer's state is not read here; the parameters depend on it
          return absl::OkStatus();
        });
    if (!checked.ok()) return skip(state, "result check", checked);
    const double step_ms = total_ms / static_cast<double>(state.iterations());
    state.counters["step_ms"] = step_ms;
    state.counters["ms_scaled"] = step_ms * kCpuScale;
    state.counters["scale"] = kCpuScale;
    state.counters["threads"] = at::get_num_threads();
    state.counters["params"] = static_cast<double>(model.params());
    state.counters["peak_extra_gpu_bytes"] = bytes_counter(0);
    state.SetLabel(str_cat("torch::optim::AdamW on CPU tensors, ", at::get_num_threads(),
                           " threads, 1/", kCpuScale, " of the model (", model.describe(),
                           "); ms_scaled = step_ms x ", kCpuScale,
                           "; scaled, transfers not counted"));
  });
#endif
}

BENCHMARK(BM_TorchFusedAdamW)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_StrataBulk)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
// The two LibTorch offload peers share one rig (pinned moments): keep them next to each other.
BENCHMARK(BM_TorchBulkTo)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TorchPerLayerPipeline)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_StrataLayerPrefetch)
    ->Arg(1)
    ->Arg(2)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TorchCpuAdamW)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);

// ---------------------------------------------------------------------------------------------
// The simulated device: layer_prefetch K=1 on a tiny model, host memcpy, not PCIe.

void BM_SimulatedLayerPrefetch(benchmark::State& state) {
  const Model& model = tiny_model();
  constexpr int kDepth = 1;
  absl::StatusOr<StrataRig*> made =
      strata_rig(model, "layer_prefetch", kDepth, rt::DeviceKind::kSimulated);
  if (!made.ok()) return skip(state, "simulated runtime with the model", made.status());
  StrataRig& r = **made;
  rt::Runtime& runtime = *r.runtime;
  // The simulated device runs each operation when it is enqueued: the step is done on return.
  auto step = [&]() -> absl::StatusOr<double> {
    const Clock::time_point t0 = Clock::now();
    STRATA_RETURN_IF_ERROR(r.adam->step());
    return seconds_between(t0, Clock::now()) * 1e3;
  };
  const std::optional<StrataTimed> timed = time_strata_steps(state, runtime, step);
  if (!timed) return;
  const Snapshot& before = timed->before;
  const Snapshot& after = timed->after;
  if (absl::Status s = runtime.wait_all(); !s.ok()) return skip(state, "wait_all", s);
  if (absl::Status s = check_strata("simulated layer_prefetch", r); !s.ok()) {
    return skip(state, "result check", s);
  }
  const double largest = largest_layer_moment_bytes(runtime);
  const double peak_extra = static_cast<double>(after.runtime.staging_bytes);
  state.counters["step_ms"] = timed->step_ms;
  state.counters["peak_extra_gpu_bytes"] = bytes_counter(peak_extra);
  state.counters["staged_peak_bytes"] =
      bytes_counter(static_cast<double>(after.runtime.staged_peak_bytes));
  state.counters["largest_layer_moment_bytes"] = bytes_counter(largest);
  state.counters["extra_over_bound"] = largest > 0 ? peak_extra / ((kDepth + 1) * largest) : 0;
  report_runtime(state, before, after);
  state.SetLabel(
      str_cat("simulated device: host memcpy and the CPU kernel, not PCIe; "
              "layer_prefetch K=",
              kDepth, ", ", model.describe()));
}
BENCHMARK(BM_SimulatedLayerPrefetch)
    ->UseManualTime()
    ->Iterations(10)
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
#ifdef STRATA_BENCH_TORCH
  at::set_num_threads(cores);  // the CPU peer uses every core
#endif
#ifdef STRATA_HAS_CUDA
  // Before any rig exists, so the measurement has the GPU and the link to itself; the raw copy
  // buffers stay for the passes next to each offloaded step.
  if (have_gpu()) {
    absl::StatusOr<Bandwidths> bw = measure_bandwidths();
    if (bw.ok()) {
      g_bw = *bw;
    } else {
      g_bw.error = bw.status().ToString();
    }
  }
#endif
  const Model& model = full_model();
  benchmark::AddCustomContext("gpu", strata::alloc::cuda_device_name(0));
  benchmark::AddCustomContext("params", std::to_string(model.params()));
  benchmark::AddCustomContext("layers", std::to_string(model.layers));
  benchmark::AddCustomContext("model", model.describe());
  benchmark::AddCustomContext("moment_bytes",
                              str_cat(static_cast<std::int64_t>(model.moment_bytes())));
  benchmark::AddCustomContext("hyper", "AdamW lr=1e-3 betas=(0.9,0.999) eps=1e-8 wd=0.01");
  if (g_bw.measured) {
    benchmark::AddCustomContext("hbm_gbps", str_cat(g_bw.hbm_gbps));
    benchmark::AddCustomContext("pinned_h2d_gbps", str_cat(g_bw.h2d_gbps));
    benchmark::AddCustomContext("pinned_d2h_gbps", str_cat(g_bw.d2h_gbps));
    benchmark::AddCustomContext("pinned_both_per_direction_gbps",
                                str_cat(g_bw.both_per_direction_gbps));
    benchmark::AddCustomContext("pinned_both_h2d_gbps", str_cat(g_bw.both_h2d_gbps));
    benchmark::AddCustomContext("pinned_both_d2h_gbps", str_cat(g_bw.both_d2h_gbps));
  } else {
    benchmark::AddCustomContext("bandwidth_error", g_bw.error);
  }
  benchmark::AddCustomContext(
      "bandwidth_method",
      str_cat("HBM: cudaMemcpyAsync device to device of 2 GiB, 2 x bytes / time, median of ",
              kHbmPasses, "; pinned: cudaMemcpyAsync cudaMalloc <-> cudaHostAlloc(portable), ",
              kPieces, " x 256 MiB per direction, non-blocking streams, CUDA events, median of ",
              kLinkPasses, "; both at once: bytes each way / span"));
  benchmark::AddCustomContext(
      "timing",
      "resident: CUDA events on the computing stream; offloaded: host wall from an idle "
      "device to cudaDeviceSynchronize after the step; warm-up 2 steps");
  benchmark::AddCustomContext("cpu_threads", std::to_string(cores));
#if defined(STRATA_BENCH_TORCH) && defined(TORCH_VERSION)
  benchmark::AddCustomContext("torch", TORCH_VERSION);
#elif defined(STRATA_BENCH_TORCH)
  benchmark::AddCustomContext("torch", "yes");
#else
  benchmark::AddCustomContext("torch", "no");
#endif
  benchmark::RunSpecifiedBenchmarks();
  release_rig();
  release_device_sources();
#ifdef STRATA_HAS_CUDA
  delete g_link;
  g_link = nullptr;
#endif
  benchmark::Shutdown();
  return 0;
}
