// bench/optim_bench_torch.cpp: the LibTorch peers in strata_optim_bench (bench/optim_bench.h):
// PyTorch's fused AdamW with everything resident, the bulk .to() round trip and the per-layer
// pipeline with LibTorch streams (both over pinned moments), and torch::optim::AdamW on the CPU.
// What each measures: bench/optim_bench.cpp. Without LibTorch and CUDA (STRATA_BENCH_TORCH) each
// is skipped.
#include <optional>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status.h"
#include "base/strings.h"
#include "bench/bench_util.h"
#include "bench/optim_bench.h"
#include "bench/optim_bench_rig.h"

#ifdef STRATA_BENCH_TORCH
#include <ATen/Parallel.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace strata::bench {

#ifdef STRATA_BENCH_TORCH
namespace {

// A LibTorch peer: run only with a GPU (and the bandwidths, if it is judged against a floor), its
// rig named `key` made by `make` unless it is the current one (skipped, "`what`: <error>", when it
// cannot be), then body(rig); LibTorch's exceptions skip the benchmark instead of ending the
// binary.
template <typename R, typename Make, typename Body>
void torch_bench(benchmark::State& state, bool needs_bandwidths, std::string_view key,
                 const char* what, Make make, Body body) {
  if (!require_gpu(state)) return;
  if (needs_bandwidths && !require_bandwidths(state)) return;
  torch_guarded(state, [&] {
    absl::StatusOr<R*> made = rig<R>(key, make);
    if (!made.ok()) return skip(state, what, made.status());
    body(**made);
  });
}

// An offloading peer over the pinned moments of TorchOffloadRig, timed from an idle device to the
// device idle again with a link sample of `floor` before each step.
struct OffloadPeer {
  LinkFloor::Kind floor;
  absl::Status (*step)(const Model& model, TorchOffloadRig& r);
  const char* check;     // the name its result check goes by
  bool per_layer;        // also achieved_gbps_per_direction and largest_layer_moment_bytes
  const char* how;       // the label, before the model
  const char* floor_as;  // the strata benchmark whose floor it shares
};

void torch_offload_bench(benchmark::State& state, const OffloadPeer& peer) {
  const Model& model = full_model();
  torch_bench<TorchOffloadRig>(
      state, /*needs_bandwidths=*/true, "torch/offload", "LibTorch tensors of the model",
      [&] { return make_torch_offload_rig(model); },
      [&](TorchOffloadRig& r) {
        LinkFloor link(peer.floor);
        auto step =
            sampled(link, [&] { return time_to_idle([&] { return peer.step(model, r); }); });
        const std::optional<TimedSteps> timed = time_torch_offload_steps(state, step);
        if (!timed) return;
        if (absl::Status s = check_torch_offload(peer.check, model, r); !s.ok()) {
          return skip(state, "result check", s);
        }
        const double moments = model.moment_bytes();
        report_offloaded(state, link, moments, timed->step_ms);
        state.counters["peak_extra_gpu_bytes"] = bytes_counter(timed->peak_extra);
        if (peer.per_layer) {
          state.counters["achieved_gbps_per_direction"] = gb_per_s(moments, timed->step_ms / 1e3);
          state.counters["largest_layer_moment_bytes"] =
              bytes_counter(kMomentBytesPerParam * static_cast<double>(model.layer_numel()));
        }
        state.SetLabel(str_cat(peer.how, model.describe(), ", host wall to device idle; floor as ",
                               peer.floor_as));
      });
}

}  // namespace

void BM_TorchFusedAdamW(benchmark::State& state) {
  const Model& model = full_model();
  torch_bench<TorchResidentRig>(
      state, /*needs_bandwidths=*/true, "torch/resident", "LibTorch tensors of the model",
      [&] { return make_torch_resident_rig(model); },
      [&](TorchResidentRig& r) {
        const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream();
        EventPair ev;
        auto step = [&] {
          return time_on_stream(ev, compute.stream(), [&] { return torch_resident_step(r); });
        };
        if (!warm_up(state, step)) return;
        torch_reset_peak();
        const std::int64_t base = torch_allocated_now();
        const std::optional<double> step_ms = time_steps(state, step);
        if (!step_ms) return;
        const std::int64_t peak = torch_allocated_peak();
        if (absl::Status s = check_torch_resident("torch fused AdamW", model, r); !s.ok()) {
          return skip(state, "result check", s);
        }
        report_resident(state, model, *step_ms);
        state.counters["peak_extra_gpu_bytes"] = bytes_counter(static_cast<double>(peak - base));
        state.SetLabel(
            str_cat("at::_fused_adamw_ (+ _foreach_add_ of the float step counters), all "
                    "resident, ",
                    model.count(), " tensors in one call, ", model.describe(),
                    ", CUDA events on the current stream"));
      });
}

void BM_TorchBulkTo(benchmark::State& state) {
  torch_offload_bench(state,
                      {.floor = LinkFloor::kSequential,
                       .step = [](const Model&, TorchOffloadRig& r) { return torch_bulk_step(r); },
                       .check = "torch bulk .to()",
                       .per_layer = false,
                       .how = "moments pinned CPU tensors: .to(cuda, non_blocking) all, "
                              "at::_fused_adamw_, copy_(non_blocking) back, synchronize; ",
                       .floor_as = "StrataBulk"});
}

void BM_TorchPerLayerPipeline(benchmark::State& state) {
  torch_offload_bench(
      state,
      {.floor = LinkFloor::kConcurrent,
       .step = [](const Model& model, TorchOffloadRig& r) { return torch_pipeline_step(model, r); },
       .check = "torch per-layer pipeline",
       .per_layer = true,
       .how = "LibTorch streams: H2D + D2H from the pool, compute current, 2 slots "
              "of a layer's moments, CUDAEvents between them, at::_fused_adamw_ per "
              "layer; ",
       .floor_as = "StrataLayerPrefetch"});
}

void BM_TorchCpuAdamW(benchmark::State& state) {
  const Model& model = cpu_model();
  torch_bench<TorchCpuRig>(
      state, /*needs_bandwidths=*/false, "torch/cpu", "CPU tensors",
      [&] { return make_torch_cpu_rig(model); },
      [&](TorchCpuRig& r) {
        auto step = [&] { return time_on_host([&] { return torch_cpu_step(r); }); };
        if (!warm_up(state, step)) return;
        const std::optional<double> step_ms = time_steps(state, step);
        if (!step_ms) return;
        if (absl::Status s = check_torch_cpu("torch CPU AdamW", model, r); !s.ok()) {
          return skip(state, "result check", s);
        }
        state.counters["step_ms"] = *step_ms;
        state.counters["ms_scaled"] = *step_ms * kCpuScale;
        state.counters["scale"] = kCpuScale;
        state.counters["threads"] = at::get_num_threads();
        state.counters["params"] = static_cast<double>(model.params());
        state.counters["peak_extra_gpu_bytes"] = bytes_counter(0);
        state.SetLabel(str_cat("torch::optim::AdamW on CPU tensors, ", at::get_num_threads(),
                               " threads, 1/", kCpuScale, " of the model (", model.describe(),
                               "); ms_scaled = step_ms x ", kCpuScale,
                               "; scaled, transfers not counted"));
      });
}

#else  // STRATA_BENCH_TORCH

namespace {

void skip_without_torch(benchmark::State& state) {
  if (!require_gpu(state)) return;
  skip(state, "built without LibTorch (STRATA_WITH_TORCH off) or without CUDA");
}

}  // namespace

void BM_TorchFusedAdamW(benchmark::State& state) { skip_without_torch(state); }
void BM_TorchBulkTo(benchmark::State& state) { skip_without_torch(state); }
void BM_TorchPerLayerPipeline(benchmark::State& state) { skip_without_torch(state); }
void BM_TorchCpuAdamW(benchmark::State& state) { skip_without_torch(state); }

#endif  // STRATA_BENCH_TORCH

}  // namespace strata::bench
