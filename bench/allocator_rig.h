// bench/allocator_rig.h: the allocator benchmarks' shared rig (strata_allocator_bench): the sizes
// every alloc+free pair runs at, strata's TieredAllocator over the simulated or the CUDA device,
// a scope guard that frees what a skipped benchmark holds, and the CUDA call check that skips the
// benchmark on an error.
//
// Example:
//   void BM_Pair(benchmark::State& state) {
//     absl::StatusOr<std::unique_ptr<alloc::TieredAllocator>> a =
//         make_allocator(alloc::DeviceBackend::kSimulated);
//     if (!a.ok()) return skip(state, "TieredAllocator::create", a.status());
//     void* device = nullptr;
//     ScopeExit free_device([&] { (void)cudaFree(device); });  // also on the early returns
//     if (!cuda_ok(state, cudaMalloc(&device, kMiB), "cudaMalloc")) return;
//     for (auto _ : state) { ... (*a)->allocate(alloc::Tier::kGpu, state.range(0)) ... }
//   }
//   BENCHMARK(BM_Pair)->Apply(pooled_sizes);
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <utility>

#include <benchmark/benchmark.h>

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

#include "absl/status/statusor.h"
#include "allocator/tiered_allocator.h"
#include "base/units.h"
#include "bench/bench_util.h"

namespace strata::bench {

// A small-pool block, a mid-size one, the largest small-pool size, a large block and a segment
// the size of a layer's optimizer states.
inline constexpr std::array<std::int64_t, 5> kPooledSizes = {512, 64 * kKiB, 1 * kMiB, 16 * kMiB,
                                                             256 * kMiB};

// Gives a benchmark one run per kPooledSizes entry (its range(0)).
void pooled_sizes(benchmark::internal::Benchmark* b);

// Runs a callable when the scope ends, so the early returns of a skipped benchmark still free
// what it holds (GPU memory left behind would shrink the benchmarks after it).
template <typename F>
class ScopeExit {
 public:
  explicit ScopeExit(F f) : f_(std::move(f)) {}
  ~ScopeExit() { f_(); }
  ScopeExit(const ScopeExit&) = delete;
  ScopeExit& operator=(const ScopeExit&) = delete;

 private:
  F f_;
};

// strata's allocator over `backend`, its GPU tier with `segments`. Address-only: the simulated GPU
// (1 TiB) reserves address space it never touches, so the simulated benchmarks measure bookkeeping
// alone and the replay's ~13 GB costs no memory on a CPU box.
absl::StatusOr<std::unique_ptr<alloc::TieredAllocator>> make_allocator(
    alloc::DeviceBackend backend, alloc::GpuSegments segments = alloc::GpuSegments::kAuto);

#ifdef STRATA_HAS_CUDA
// True if `err` is cudaSuccess; otherwise clears the error and skips the benchmark, saying `what`
// failed.
bool cuda_ok(benchmark::State& state, cudaError_t err, const char* what);
#endif

}  // namespace strata::bench
