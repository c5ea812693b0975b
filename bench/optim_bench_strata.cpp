// bench/optim_bench_strata.cpp: strata's approaches in strata_optim_bench (bench/optim_bench.h):
// optim::Adam over a runtime under keep_on_gpu, bulk and layer_prefetch on the GPU, and
// layer_prefetch on the simulated device. What each measures: bench/optim_bench.cpp.
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/stats.h"
#include "allocator/tier.h"
#include "base/status.h"
#include "base/strings.h"
#include "bench/bench_util.h"
#include "bench/optim_bench.h"
#include "bench/optim_bench_rig.h"

namespace strata::bench {
namespace {

using alloc::Tier;

// What the bulk policy streams and BM_TorchBulkTo moves: the moments, not offload_all's default of
// every role; the GPU memory stays in strata's pool between steps, as it stays in LibTorch's cache
// for the peer (strata_optim_compare also times the default, memory back to the driver).
const rt::OffloadOptions kMomentsCached{.roles = rt::RoleSet::optimizer_states(),
                                        .keep_cached = true};

// The GPU benchmarks' start: the GPU, the bandwidths main measured for the floors, and strata's rig
// for `policy` at prefetch depth `depth` over the full model. nullptr, with the benchmark skipped,
// without any of them.
StrataRig* gpu_rig(benchmark::State& state, const std::string& policy, int depth) {
  if (!require_gpu(state)) return nullptr;
#ifdef STRATA_HAS_CUDA
  if (!require_bandwidths(state)) return nullptr;
  absl::StatusOr<StrataRig*> made = strata_rig(full_model(), policy, depth, rt::DeviceKind::kCuda);
  if (made.ok()) return *made;
  skip(state, str_cat(policy, " runtime with the model"), made.status());
#endif
  return nullptr;
}

}  // namespace

void BM_StrataResident(benchmark::State& state) {
  StrataRig* const made = gpu_rig(state, "keep_on_gpu", 0);
  if (made == nullptr) return;
#ifdef STRATA_HAS_CUDA
  StrataRig& r = *made;
  const Model& model = full_model();
  rt::Runtime& runtime = *r.runtime;
  const auto stream = static_cast<cudaStream_t>(runtime.compute_stream());
  EventPair ev;
  auto step = [&] { return time_on_stream(ev, stream, [&] { return r.adam->step(); }); };
  const std::optional<StrataTimed> timed = time_strata_steps(state, runtime, step);
  if (!timed) return;
  if (absl::Status s = check_strata("strata resident", r); !s.ok()) {
    return skip(state, "result check", s);
  }
  const double achieved_gbps = report_resident(state, model, timed->step_ms);
  state.counters["hbm_fraction"] = g_bw.hbm_gbps > 0 ? achieved_gbps / g_bw.hbm_gbps : 0;
  state.counters["peak_extra_gpu_bytes"] = bytes_counter(0);
  report_runtime(state, timed->before, timed->after);
  state.SetLabel(str_cat("optim::Adam (AdamW), policy keep_on_gpu, ", model.describe(),
                         ", CUDA events on the compute stream; floor 28 B/param over HBM"));
#endif
}

void BM_StrataBulk(benchmark::State& state) {
  StrataRig* const made = gpu_rig(state, "bulk", 0);
  if (made == nullptr) return;
#ifdef STRATA_HAS_CUDA
  StrataRig& r = *made;
  const Model& model = full_model();
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
  if (absl::Status s = check_strata("strata bulk", r); !s.ok()) {
    return skip(state, "result check", s);
  }
  const double steps = static_cast<double>(state.iterations());
  // Out and back are two phases one after the other, each over one direction of the link.
  report_offloaded(state, link, model.moment_bytes(), timed->step_ms);
  state.counters["reload_ms"] = total_reload_ms / steps;
  state.counters["step_and_offload_ms"] = timed->step_ms - total_reload_ms / steps;
  state.counters["peak_extra_gpu_bytes"] = bytes_counter(peak_extra);
  report_runtime(state, timed->before, timed->after);
  state.SetLabel(
      str_cat("reload_all + optim::Adam step + offload_all, policy bulk, roles "
              "optimizer states, ",
              model.describe(),
              ", host wall to device idle; floor: moments over raw pinned H2D + over raw "
              "pinned D2H, each alone, passes before each step"));
#endif
}

void BM_StrataLayerPrefetch(benchmark::State& state) {
  const int depth = static_cast<int>(state.range(0));
  StrataRig* const made = gpu_rig(state, "layer_prefetch", depth);
  if (made == nullptr) return;
#ifdef STRATA_HAS_CUDA
  StrataRig& r = *made;
  const Model& model = full_model();
  rt::Runtime& runtime = *r.runtime;
  LinkFloor link(LinkFloor::kConcurrent);
  auto step = sampled(link, [&] { return time_to_idle([&] { return r.adam->step(); }); });
  const std::optional<StrataTimed> timed = time_strata_steps(state, runtime, step);
  if (!timed) return;
  const Snapshot& before = timed->before;
  const Snapshot& after = timed->after;
  const std::int64_t used_after = device_used_bytes();
  absl::StatusOr<rt::LinkUse> use = traced_step(r, str_cat("layer_prefetch_k", depth));
  if (!use.ok()) return skip(state, "traced step", use.status());
  if (absl::Status s = check_strata(str_cat("strata layer_prefetch K=", depth), r); !s.ok()) {
    return skip(state, "result check", s);
  }
  const double steps = static_cast<double>(state.iterations());
  const double moments = model.moment_bytes();
  const double largest = largest_layer_moment_bytes(runtime);
  const double peak_extra = static_cast<double>(after.runtime.staging_bytes);
  const double bound = (depth + 1) * largest;
  report_offloaded(state, link, moments, timed->step_ms);
  state.counters["prefetch_depth"] = depth;
  state.counters["achieved_gbps_per_direction"] = gb_per_s(moments, timed->step_ms / 1e3);
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
  auto step = [&] { return time_on_host([&] { return r.adam->step(); }); };
  const std::optional<StrataTimed> timed = time_strata_steps(state, runtime, step);
  if (!timed) return;
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
  report_runtime(state, timed->before, after);
  state.SetLabel(
      str_cat("simulated device: host memcpy and the CPU kernel, not PCIe; "
              "layer_prefetch K=",
              kDepth, ", ", model.describe()));
}

}  // namespace strata::bench
