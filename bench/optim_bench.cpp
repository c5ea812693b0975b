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
//
// The benchmarks live in bench/optim_bench_strata.cpp and bench/optim_bench_torch.cpp
// (bench/optim_bench.h) over the rig of bench/optim_bench_rig.h; this file registers them in the
// order they run and holds main.
#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>

#include <benchmark/benchmark.h>

#include "absl/status/statusor.h"
#include "allocator/upstream.h"
#include "base/strings.h"
#include "bench/optim_bench.h"
#include "bench/optim_bench_rig.h"

#ifdef STRATA_BENCH_TORCH
#include <ATen/Parallel.h>
#include <torch/version.h>
#endif

namespace strata::bench {
namespace {

BENCHMARK(BM_StrataResident)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
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
BENCHMARK(BM_SimulatedLayerPrefetch)
    ->UseManualTime()
    ->Iterations(10)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  using namespace strata::bench;  // NOLINT: the benchmark's whole vocabulary
  using strata::str_cat;
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
