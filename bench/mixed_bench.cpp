// bench/mixed_bench.cpp: the mixed-precision optimizer step (bfloat16 parameters and gradients,
// float32 master weights and Adam moments: 12 bytes of optimizer state a parameter) under strata
// and the best ways PyTorch offers, in one process on the same shapes and values.
//
// Model and approaches: bench/mixed_rig.h. strata_optim_compare --parts=mixed runs the same
// approaches in alternation with a verdict per comparison; this runs them one after another.
//
// Measures (issue "Train the way LLMs are trained", its GPU must-show):
//   BM_MixedStrataLayerPrefetch  optim::Adam, policy layer_prefetch K=1 streaming masters and
//                                moments (optimizer_states) from pinned memory; parameters and
//                                gradients on the GPU. floor = 12 B/param each way over the raw
//                                pinned bandwidth per direction with both directions running,
//                                from link passes right before each step (See Note [Adjacent floor]
//                                in link_rig.h). Target: <= 1.03 x floor. Also the own-memory
//                                floor (See Note [Own-memory floor]).
//   BM_MixedTorchPipeline        PyTorch's best way to stream the same state: masters and moments
//                                in pinned CPU tensors, a per-layer pipeline with one stream per
//                                direction and two GPU slots, the gradients cast to float32, the
//                                fused AdamW (at::_fused_adamw_) on the slot, the bfloat16
//                                parameters copied from the slot's masters. Same floor.
//   BM_MixedStrataResident       optim::Adam under keep_on_gpu: everything on the GPU.
//   BM_MixedTorchResident        PyTorch resident with float32 masters: gradients cast to float32
//                                (_foreach), at::_fused_adamw_ over the masters, parameters copied
//                                from them (_foreach_copy_). Target: strata resident <= 1.00 x.
// Timing: host wall from an idle device to cudaDeviceSynchronize() after the step; 2 warm-up
// steps, then 5 timed. After each benchmark the first 1024 masters of the first and last tensors
// are compared with float32 AdamW on the host over the steps taken (within 1e-5 relative: the GPU
// fuses multiply-adds), so a fast but wrong step fails the run.
//
// Run (a machine without a GPU skips every benchmark):
//   build/bin/strata_mixed_bench --benchmark_out=mixed.json --benchmark_out_format=json
#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/strings.h"
#include "bench/bench_util.h"
#include "bench/mixed_rig.h"
#include "benchmark/benchmark.h"

#ifdef STRATA_BENCH_TORCH
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace strata {
namespace {

using bench::skip;

#ifdef STRATA_BENCH_TORCH
using bench::HostBuffers;
using bench::OwnMemoryFloor;
using bench::time_to_idle;

bool have_gpu(benchmark::State& state) {
  if (alloc::cuda_device_count() > 0) return true;
  skip(state, "no GPU on this machine");
  return false;
}

// The link right before each offloaded step, both directions at once.
bench::LinkRig* g_link = nullptr;

// The pinned buffers a floor pass covers, listed before each pass.
using BufferList = std::function<absl::StatusOr<HostBuffers>()>;

// Warm-up, then timed steps; with `link`, a link sample before every step and each step's
// ratio to its floor; with `own`, also a pass of the own-memory floor over own_buffers() before
// every step. Reports step_ms (mean), ratio median/min/max.
void run_steps(benchmark::State& state, const std::function<absl::Status()>& step,
               bench::AdjacentLink* link, OwnMemoryFloor* own = nullptr,
               const BufferList& own_buffers = {}) {
  for (int i = 0; i < bench::kWarmupSteps; ++i) {
    if (absl::Status s = step(); !s.ok()) return skip(state, "warm-up step", s);
  }
  const double bytes_each_way = bench::mixed_state_bytes();
  std::vector<double> ms, ratio, own_ratio;
  double own_bytes = 0, own_ms = 0;
  for (auto _ : state) {
    double floor_ms = 0, own_floor_ms = 0;
    if (link != nullptr) {
      if (absl::Status s = link->sample(); !s.ok()) return skip(state, "link sample", s);
      floor_ms = bytes_each_way / (link->span_gbps() * 1e9) * 1e3;
    }
    if (own != nullptr) {
      auto buffers = own_buffers();
      if (!buffers.ok()) return skip(state, "own-memory buffers", buffers.status());
      absl::StatusOr<double> pass = own->pass_ms(*buffers);
      if (!pass.ok()) return skip(state, "own-memory floor", pass.status());
      for (const auto& b : *buffers) own_bytes += static_cast<double>(b.second);
      own_ms += *pass;
      own_floor_ms = *pass;
    }
    absl::StatusOr<double> t = time_to_idle(step);
    if (!t.ok()) return skip(state, "step", t.status());
    ms.push_back(*t);
    if (floor_ms > 0) ratio.push_back(*t / floor_ms);
    if (own_floor_ms > 0) own_ratio.push_back(*t / own_floor_ms);
    state.SetIterationTime(*t / 1e3);
  }
  std::sort(ms.begin(), ms.end());
  state.counters["step_ms_median"] = ms[ms.size() / 2];
  state.counters["step_ms_min"] = ms.front();
  state.counters["step_ms_max"] = ms.back();
  if (!ratio.empty()) {
    std::sort(ratio.begin(), ratio.end());
    state.counters["ratio_to_floor_median"] = ratio[ratio.size() / 2];
    state.counters["ratio_to_floor_min"] = ratio.front();
    state.counters["ratio_to_floor_max"] = ratio.back();
    state.counters["link_per_direction_gbps"] = link->span_gbps();
  }
  if (!own_ratio.empty()) {
    std::sort(own_ratio.begin(), own_ratio.end());
    state.counters["ratio_to_own_floor_median"] = own_ratio[own_ratio.size() / 2];
    state.counters["ratio_to_own_floor_min"] = own_ratio.front();
    state.counters["ratio_to_own_floor_max"] = own_ratio.back();
    state.counters["own_floor_per_direction_gbps"] = own_bytes / (own_ms * 1e6);
  }
}

// --- strata ---

void strata_bench(benchmark::State& state, const std::string& policy, int depth = 1) {
  if (!have_gpu(state)) return;
  absl::StatusOr<std::unique_ptr<bench::MixedStrataRig>> made =
      bench::make_mixed_strata_rig(policy, depth);
  if (!made.ok()) return skip(state, "strata rig", made.status());
  bench::MixedStrataRig& r = **made;
  const bool streamed = policy == "layer_prefetch";
  if (streamed && g_link == nullptr) return skip(state, "no link rig for the floor");
  std::unique_ptr<bench::AdjacentLink> link;
  OwnMemoryFloor own;
  if (streamed) {
    link = std::make_unique<bench::AdjacentLink>(*g_link, true, true);
    if (absl::Status s = own.init(static_cast<std::size_t>(bench::mixed_state_bytes())); !s.ok()) {
      return skip(state, "own-memory floor", s);
    }
  }
  run_steps(
      state, [&] { return bench::mixed_strata_step(r); }, link.get(), streamed ? &own : nullptr,
      [&] { return bench::mixed_strata_buffers(r); });
  if (state.error_occurred()) return;
  if (absl::Status s = bench::check_mixed_strata(r); !s.ok()) return skip(state, "result check", s);
  state.counters["staging_bytes"] = bench::bytes_counter(r.runtime->stats().staging_bytes);
  state.SetLabel(
      str_cat("optim::Adam, bfloat16 params and grads on the GPU, float32 masters and "
              "moments ",
              streamed ? str_cat("in pinned memory, layer_prefetch K=", depth) : "on the GPU",
              "; 1.152e9 params"));
}

void BM_MixedStrataLayerPrefetch(benchmark::State& state) { strata_bench(state, "layer_prefetch"); }
// Two layers ahead: the H2D stream need not wait for the D2H copies that free the slot it fills.
void BM_MixedStrataLayerPrefetchK2(benchmark::State& state) {
  strata_bench(state, "layer_prefetch", 2);
}
void BM_MixedStrataResident(benchmark::State& state) { strata_bench(state, "keep_on_gpu"); }

// --- PyTorch ---

// Resident (masters and moments on the GPU) or streamed (pinned, the per-layer pipeline with 2
// GPU slots, each step judged against the link and its own buffers), as strata_bench for strata;
// `what` names the result check.
void torch_bench(benchmark::State& state, bool streamed, const char* what, const char* label) {
  if (!have_gpu(state)) return;
  if (streamed && g_link == nullptr) return skip(state, "no link rig for the floor");
  {
    absl::StatusOr<std::unique_ptr<bench::TorchMixedModel>> t =
        bench::make_torch_mixed_model(/*pinned=*/streamed);
    if (!t.ok()) return skip(state, "torch model", t.status());
    bench::TorchMixedModel& model = **t;
    std::optional<bench::AdjacentLink> link;
    OwnMemoryFloor own;
    if (streamed) {
      link.emplace(*g_link, true, true);
      if (absl::Status s = own.init(static_cast<std::size_t>(bench::mixed_state_bytes()));
          !s.ok()) {
        return skip(state, "own-memory floor", s);
      }
    }
    run_steps(
        state,
        [&] {
          return streamed ? bench::torch_mixed_pipeline_step(model, 2)
                          : bench::torch_mixed_resident_step(model);
        },
        streamed ? &*link : nullptr, streamed ? &own : nullptr,
        [&]() -> absl::StatusOr<HostBuffers> { return bench::torch_mixed_buffers(model); });
    if (state.error_occurred()) return;
    if (absl::Status s = bench::check_mixed_torch(what, model); !s.ok()) {
      return skip(state, "result check", s);
    }
    state.SetLabel(label);
  }
  c10::cuda::CUDACachingAllocator::emptyCache();
}

void BM_MixedTorchResident(benchmark::State& state) {
  torch_bench(state, /*streamed=*/false, "torch resident",
              "at::_fused_adamw_ over float32 masters, gradients cast with .to(float32), "
              "parameters copied with _foreach_copy_, all on the GPU");
}

void BM_MixedTorchPipeline(benchmark::State& state) {
  torch_bench(state, /*streamed=*/true, "torch pipeline",
              "masters and moments in pinned CPU tensors, per-layer pipeline: H2D and D2H "
              "streams, 2 GPU slots, at::_fused_adamw_ on the slot, parameters copied from it");
}
#else
void BM_MixedStrataLayerPrefetch(benchmark::State& state) {
  skip(state, "needs CUDA and LibTorch");
}
void BM_MixedStrataLayerPrefetchK2(benchmark::State& state) {
  skip(state, "needs CUDA and LibTorch");
}
void BM_MixedStrataResident(benchmark::State& state) { skip(state, "needs CUDA and LibTorch"); }
void BM_MixedTorchResident(benchmark::State& state) { skip(state, "needs CUDA and LibTorch"); }
void BM_MixedTorchPipeline(benchmark::State& state) { skip(state, "needs CUDA and LibTorch"); }
#endif

// Interleaved: each strata approach next to its PyTorch peer.
BENCHMARK(BM_MixedStrataLayerPrefetch)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MixedTorchPipeline)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MixedStrataLayerPrefetchK2)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MixedStrataResident)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MixedTorchResident)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("gpu", strata::alloc::cuda_device_name(0));
  benchmark::AddCustomContext("params", "1152000000");
#ifdef STRATA_BENCH_TORCH
  strata::bench::LinkRig link;
  if (strata::alloc::cuda_device_count() > 0) {
    if (absl::Status s = strata::bench::init_link_rig(link, 1); s.ok()) {
      strata::g_link = &link;
    } else {
      benchmark::AddCustomContext("link_error", s.ToString());
    }
  }
#endif
  benchmark::RunSpecifiedBenchmarks();
#ifdef STRATA_BENCH_TORCH
  strata::g_link = nullptr;
#endif
  benchmark::Shutdown();
  return 0;
}
