// bench/allocator_bench.h: the benchmarks of strata_allocator_bench, one group a file, registered
// in the order they run by bench/allocator_bench.cpp:
//   bench/allocator_pool.cpp     strata's pooled alloc+free, and the same pair through CUDA
//   bench/allocator_torch.cpp    the LibTorch peers: the caching allocator's pair, torch::empty,
//                                and the training-step replay through the caching allocator
//   bench/allocator_pinned.cpp   which pinned method: how fast each pins, how fast it copies
//   bench/allocator_replay.cpp   the training-step replays through strata's GPU tier
//
// Example:
//   BENCHMARK_CAPTURE(BM_PinnedH2D, mmap_register, alloc::PinnedMethod::kMmapRegister)
//       ->UseManualTime()
//       ->Unit(benchmark::kMillisecond);
#pragma once

#include <string_view>

#include <benchmark/benchmark.h>

#include "allocator/tier.h"
#include "allocator/tiered_allocator.h"
#include "allocator/upstream.h"
#include "bench/allocator_rig.h"

namespace strata::bench {

// bench/allocator_pool.cpp
void BM_StrataAllocFree(benchmark::State& state, alloc::DeviceBackend backend, alloc::Tier tier);
void BM_CudaMallocFree(benchmark::State& state);
void BM_CudaMallocAsync(benchmark::State& state);
void BM_CudaHostAlloc(benchmark::State& state);

// bench/allocator_torch.cpp (only with STRATA_BENCH_TORCH)
#ifdef STRATA_BENCH_TORCH
void BM_TorchCachingAllocator(benchmark::State& state);
void BM_TorchEmptyTensor(benchmark::State& state);
void BM_ReplayTorch(benchmark::State& state, std::string_view trace_name);
#endif

// bench/allocator_pinned.cpp
void BM_PinnedUpstream(benchmark::State& state, alloc::PinnedMethod method);
void BM_PinnedH2D(benchmark::State& state, alloc::PinnedMethod method);

// bench/allocator_replay.cpp
void BM_ReplayStrata(benchmark::State& state, alloc::DeviceBackend backend,
                     std::string_view trace_name, alloc::GpuSegments segments);

}  // namespace strata::bench
