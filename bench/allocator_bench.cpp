// bench/allocator_bench.cpp: what strata's allocator costs, next to the allocators it replaces.
//
// Measures (targets in /work/shared/PERF.md):
//   BM_StrataAllocFree/<tier>/<bytes>   one allocate+deallocate pair on a warm pool: host
//                                       bookkeeping only (target: median <= 200 ns). Its
//                                       simulated_gpu tier runs anywhere; the others need a GPU.
//   BM_CudaMallocFree, BM_CudaMallocAsync, BM_CudaHostAlloc, BM_TorchCachingAllocator,
//   BM_TorchEmptyTensor                 the same pair done by the peers, same sizes.
//   BM_PinnedUpstream/<method>/<bytes>  pinning rate of cudaHostAlloc vs mmap+cudaHostRegister;
//   BM_PinnedH2D/<method>               H2D and D2H copy bandwidth from a segment of each. Together
//                                       they decide AllocatorOptions::pinned_method's default.
//   BM_ReplayStrata/<device>_<shapes>_<segments>, BM_ReplayTorch/<shapes>
//                                       a GPT-like training run's allocation trace, fixed shapes (5
//                                       steps) or variable ones (20 steps of drawn token counts),
//                                       run once: reserved bytes against peak allocated bytes
//                                       (targets: <= 1.05 fixed, <= 1.01 variable with expandable
//                                       segments), with what mapping cost. PyTorch's expandable
//                                       segments: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
//
// Run (on a machine without a GPU everything but the simulated benchmarks reports "no GPU"):
//   build/bin/strata_allocator_bench --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true
//       --benchmark_out=allocator.json --benchmark_out_format=json   (one command line)
//   build/bin/strata_allocator_bench --benchmark_filter='Replay'
// The JSON context carries the GPU name and the default pinned method.
//
// The benchmarks live one group a file (bench/allocator_bench.h) over the shared rig
// (bench/allocator_rig.h); this file registers them in the order they run and holds main.
#include <cstddef>
#include <string>

#include <benchmark/benchmark.h>

#include "allocator/tier.h"
#include "allocator/tiered_allocator.h"
#include "allocator/upstream.h"
#include "base/strings.h"
#include "base/units.h"
#include "bench/allocator_bench.h"
#include "bench/replay_trace.h"

#ifdef STRATA_BENCH_TORCH
#include <torch/version.h>
#endif

namespace strata::bench {
namespace {

using alloc::DeviceBackend;
using alloc::GpuSegments;
using alloc::PinnedMethod;
using alloc::Tier;

// 1. strata's pooled alloc+free (bench/allocator_pool.cpp).
BENCHMARK_CAPTURE(BM_StrataAllocFree, simulated_gpu, DeviceBackend::kSimulated, Tier::kGpu)
    ->Apply(pooled_sizes);
BENCHMARK_CAPTURE(BM_StrataAllocFree, gpu, DeviceBackend::kCuda, Tier::kGpu)->Apply(pooled_sizes);
BENCHMARK_CAPTURE(BM_StrataAllocFree, pinned_host, DeviceBackend::kCuda, Tier::kPinnedHost)
    ->Apply(pooled_sizes);
BENCHMARK_CAPTURE(BM_StrataAllocFree, pageable_host, DeviceBackend::kCuda, Tier::kPageableHost)
    ->Apply(pooled_sizes);

// 2. Peers: the same pair through CUDA (bench/allocator_pool.cpp) and LibTorch
// (bench/allocator_torch.cpp).
BENCHMARK(BM_CudaMallocFree)->Apply(pooled_sizes);
BENCHMARK(BM_CudaMallocAsync)->Apply(pooled_sizes);
// Pinning costs time per page (PERF.md: ~0.7 ms per MiB), so 16 MiB gets a few fixed iterations
// and 256 MiB is left to BM_PinnedUpstream.
BENCHMARK(BM_CudaHostAlloc)->Arg(512)->Arg(64 * kKiB)->Arg(1 * kMiB);
BENCHMARK(BM_CudaHostAlloc)->Arg(16 * kMiB)->Iterations(10)->Unit(benchmark::kMillisecond);
#ifdef STRATA_BENCH_TORCH
BENCHMARK(BM_TorchCachingAllocator)->Apply(pooled_sizes);
BENCHMARK(BM_TorchEmptyTensor)->Apply(pooled_sizes);
#endif  // STRATA_BENCH_TORCH

// 3. Which pinned method: how fast each pins, and how fast its memory copies
// (bench/allocator_pinned.cpp).
BENCHMARK_CAPTURE(BM_PinnedUpstream, cudaHostAlloc, PinnedMethod::kCudaHostAlloc)
    ->Arg(64 * kMiB)
    ->Arg(256 * kMiB)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PinnedUpstream, mmap_register, PinnedMethod::kMmapRegister)
    ->Arg(64 * kMiB)
    ->Arg(256 * kMiB)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PinnedH2D, cudaHostAlloc, PinnedMethod::kCudaHostAlloc)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PinnedH2D, mmap_register, PinnedMethod::kMmapRegister)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// 4. Replays of training steps' allocation traces (bench/replay_trace.h), fixed and variable
// shapes, through strata's GPU tier with expandable or fixed segments and through PyTorch's caching
// allocator (run the binary again with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for its
// expandable segments: the setting is read once per process).
#define STRATA_REPLAY_STRATA_(name, backend, trace, segments)                     \
  BENCHMARK_CAPTURE(BM_ReplayStrata, name, backend, trace, GpuSegments::segments) \
      ->Iterations(1)                                                             \
      ->Unit(benchmark::kMillisecond)
STRATA_REPLAY_STRATA_(simulated_fixed_shapes_expandable, DeviceBackend::kSimulated, "fixed",
                      kExpandable);
STRATA_REPLAY_STRATA_(simulated_fixed_shapes_fixed, DeviceBackend::kSimulated, "fixed", kFixed);
STRATA_REPLAY_STRATA_(simulated_variable_shapes_expandable, DeviceBackend::kSimulated, "variable",
                      kExpandable);
STRATA_REPLAY_STRATA_(simulated_variable_shapes_fixed, DeviceBackend::kSimulated, "variable",
                      kFixed);
STRATA_REPLAY_STRATA_(gpu_fixed_shapes_expandable, DeviceBackend::kCuda, "fixed", kExpandable);
STRATA_REPLAY_STRATA_(gpu_fixed_shapes_fixed, DeviceBackend::kCuda, "fixed", kFixed);
STRATA_REPLAY_STRATA_(gpu_variable_shapes_expandable, DeviceBackend::kCuda, "variable",
                      kExpandable);
STRATA_REPLAY_STRATA_(gpu_variable_shapes_fixed, DeviceBackend::kCuda, "variable", kFixed);
#undef STRATA_REPLAY_STRATA_

#ifdef STRATA_BENCH_TORCH
BENCHMARK_CAPTURE(BM_ReplayTorch, fixed_shapes, "fixed")
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ReplayTorch, variable_shapes, "variable")
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
#endif  // STRATA_BENCH_TORCH

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("gpu", strata::alloc::cuda_device_name(0));
  benchmark::AddCustomContext("cuda_devices", std::to_string(strata::alloc::cuda_device_count()));
  benchmark::AddCustomContext("pinned_default",
                              std::string(strata::alloc::pinned_method_name(
                                  strata::alloc::AllocatorOptions{}.pinned_method)));
  for (const strata::bench::ReplayTrace* trace :
       {&strata::bench::fixed_replay_trace(), &strata::bench::variable_replay_trace()}) {
    std::string tokens;
    for (std::size_t t : trace->tokens) strata::str_append(&tokens, tokens.empty() ? "" : ",", t);
    benchmark::AddCustomContext(
        strata::str_cat("replay_", trace->name),
        strata::str_cat("layers=", strata::bench::kReplayLayers,
                        " hidden=", strata::bench::kReplayHidden, " fp16 tokens_per_step=", tokens,
                        " trace_peak_bytes=", trace->peak_bytes,
                        " allocs_per_step=", trace->allocs_per_step));
  }
#if defined(STRATA_BENCH_TORCH) && defined(TORCH_VERSION)
  benchmark::AddCustomContext("torch", TORCH_VERSION);
#elif defined(STRATA_BENCH_TORCH)
  benchmark::AddCustomContext("torch", "yes");
#else
  benchmark::AddCustomContext("torch", "no");
#endif
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
