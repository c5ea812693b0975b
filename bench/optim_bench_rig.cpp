// bench/optim_bench_rig.cpp: the Google Benchmark side of strata_optim_bench's rig
// (bench/optim_bench_rig.h).
#include "bench/optim_bench_rig.h"

#include <algorithm>
#include <cstdint>

#include "base/strings.h"

#ifdef STRATA_BENCH_TORCH
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace strata::bench {
namespace {

std::unique_ptr<Rig> g_rig;
std::string g_rig_key;

}  // namespace

bool require_bandwidths(benchmark::State& state) {
  if (g_bw.measured) return true;
  skip(state, str_cat("bandwidths for the floor: ", g_bw.error));
  return false;
}

void report_floor(benchmark::State& state, double step_ms, double floor_ms) {
  state.counters["step_ms"] = step_ms;
  state.counters["floor_ms"] = floor_ms;
  state.counters["ratio_to_floor"] = floor_ms > 0 ? step_ms / floor_ms : 0;
}

double report_resident(benchmark::State& state, const Model& model, double step_ms) {
  const double bytes = kResidentBytesPerParam * static_cast<double>(model.params());
  const double achieved_gbps = gb_per_s(bytes, step_ms / 1e3);
  report_floor(state, step_ms, ms_at(bytes, g_bw.hbm_gbps));
  state.counters["hbm_gbps"] = g_bw.hbm_gbps;
  state.counters["achieved_gbps"] = achieved_gbps;
  state.counters["params"] = static_cast<double>(model.params());
  return achieved_gbps;
}

#ifdef STRATA_HAS_CUDA
void report_link(benchmark::State& state, const LinkFloor& link) {
  if (link.kind() == LinkFloor::kConcurrent) {
    state.counters["link_per_direction_gbps"] = link.per_direction_gbps();
  } else {
    state.counters["link_h2d_gbps"] = link.h2d_gbps();
    state.counters["link_d2h_gbps"] = link.d2h_gbps();
  }
}

void report_offloaded(benchmark::State& state, const LinkFloor& link, double moments,
                      double step_ms) {
  report_floor(state, step_ms, link.floor_ms(moments));
  state.counters["moment_bytes"] = bytes_counter(moments);
  report_link(state, link);
}
#endif  // STRATA_HAS_CUDA

void report_runtime(benchmark::State& state, const Snapshot& before, const Snapshot& after) {
  const double steps = static_cast<double>(state.iterations());
  Deltas d;
  d.add(before, after);
  state.counters["host_syncs"] = static_cast<double>(d.host_syncs) / steps;
  // Both must be 0: no cudaMalloc or pinning once warm.
  state.counters["gpu_segment_allocs"] = static_cast<double>(d.gpu_segment_allocs);
  state.counters["pinned_segment_allocs"] = static_cast<double>(d.pinned_segment_allocs);
  state.counters["failed_migrations"] = static_cast<double>(d.failed_migrations);
  const rt::RuntimeStats& a = after.runtime;
  const rt::RuntimeStats& b = before.runtime;
  state.counters["h2d_bytes_per_step"] =
      bytes_counter(static_cast<double>(a.migrated_bytes_h2d - b.migrated_bytes_h2d) / steps);
  state.counters["d2h_bytes_per_step"] =
      bytes_counter(static_cast<double>(a.migrated_bytes_d2h - b.migrated_bytes_d2h) / steps);
  report_engine(state, d);
}

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

Rig* kept_rig(std::string_view key) {
  return g_rig != nullptr && g_rig_key == key ? g_rig.get() : nullptr;
}

void keep_rig(std::unique_ptr<Rig> rig, std::string_view key) {
  g_rig = std::move(rig);
  g_rig_key = std::string(key);
}

absl::StatusOr<StrataRig*> strata_rig(const Model& model, std::string policy, int depth,
                                      rt::DeviceKind device) {
  const std::string key =
      str_cat("strata/", policy, "/", depth, device == rt::DeviceKind::kCuda ? "/cuda" : "/sim");
  return rig<StrataRig>(key, [&] { return make_strata_rig(model, policy, depth, device); });
}

bool warm_up(benchmark::State& state, const StepFn& step) {
  for (int i = 0; i < kWarmupSteps; ++i) {
    if (absl::StatusOr<double> w = step(); !w.ok()) {
      skip(state, "warm-up step", w.status());
      return false;
    }
  }
  return true;
}

std::optional<double> time_steps(benchmark::State& state, const StepFn& step,
                                 const std::function<void()>& before_each,
                                 const std::function<void()>& after_each) {
  double total_ms = 0;
  for (auto _ : state) {
    if (before_each) before_each();
    absl::StatusOr<double> ms = step();
    if (!ms.ok()) {
      skip(state, "step", ms.status());
      break;
    }
    if (after_each) after_each();
    total_ms += *ms;
    state.SetIterationTime(*ms / 1e3);
  }
  if (state.error_occurred() || state.iterations() == 0) return std::nullopt;
  return total_ms / static_cast<double>(state.iterations());
}

std::optional<StrataTimed> time_strata_steps(benchmark::State& state, rt::Runtime& runtime,
                                             const StepFn& step,
                                             const std::function<void()>& after_each) {
  if (!warm_up(state, step)) return std::nullopt;
  StrataTimed out;
  out.before = snapshot(runtime);
  const std::optional<double> step_ms = time_steps(state, step, {}, after_each);
  if (!step_ms) return std::nullopt;
  out.after = snapshot(runtime);
  out.step_ms = *step_ms;
  return out;
}

#ifdef STRATA_BENCH_TORCH
std::optional<TimedSteps> time_torch_offload_steps(benchmark::State& state, const StepFn& step) {
  if (!warm_up(state, step)) return std::nullopt;
  TimedSteps out;
  std::int64_t base = 0;
  const std::optional<double> step_ms = time_steps(
      state, step,
      [&] {
        torch_reset_peak();
        base = torch_allocated_now();
      },
      [&] {
        out.peak_extra =
            std::max(out.peak_extra, static_cast<double>(torch_allocated_peak() - base));
      });
  if (!step_ms) return std::nullopt;
  out.step_ms = *step_ms;
  return out;
}
#endif

}  // namespace strata::bench
