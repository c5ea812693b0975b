// bench/allocator_pool.cpp: one allocate+deallocate pair on strata's warm pool (host bookkeeping
// only), and the same pair done by the CUDA allocators it replaces: cudaMalloc, cudaMallocAsync on
// the default pool, cudaHostAlloc (bench/allocator_bench.h).
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/stats.h"
#include "base/strings.h"
#include "bench/allocator_bench.h"
#include "bench/bench_util.h"

namespace strata::bench {

using alloc::DeviceBackend;
using alloc::Tier;
using alloc::TieredAllocator;

#ifdef STRATA_HAS_CUDA
namespace {

// A CUDA allocator's pair: allocate(&p), then release(p), each returning its CUDA error and named
// `allocate_name` / `release_name` when it fails, which skips the benchmark. One untimed pair
// first ("warm-up ..."; it keeps the context's lazy set-up out of the loop), then `settle` (if
// given; false once it has skipped the benchmark), then one pair per iteration.
template <typename Allocate, typename Release>
void cuda_pairs(benchmark::State& state, const char* allocate_name, const char* release_name,
                Allocate allocate, Release release, const std::function<bool()>& settle = {}) {
  void* p = nullptr;
  if (!cuda_ok(state, allocate(&p), str_cat("warm-up ", allocate_name).c_str())) return;
  if (!cuda_ok(state, release(p), str_cat("warm-up ", release_name).c_str())) return;
  if (settle && !settle()) return;
  for (auto _ : state) {
    if (!cuda_ok(state, allocate(&p), allocate_name)) break;
    benchmark::DoNotOptimize(p);
    if (!cuda_ok(state, release(p), release_name)) break;
  }
}

}  // namespace
#endif  // STRATA_HAS_CUDA

void BM_StrataAllocFree(benchmark::State& state, DeviceBackend backend, Tier tier) {
  if (backend == DeviceBackend::kCuda && !require_gpu(state)) return;
  const auto bytes = static_cast<std::size_t>(state.range(0));
  absl::StatusOr<std::unique_ptr<TieredAllocator>> created = make_allocator(backend);
  if (!created.ok()) return skip(state, "TieredAllocator::create", created.status());
  TieredAllocator& allocator = **created;

  // The first allocation takes a segment from the upstream (cudaMalloc, cudaHostAlloc, mmap);
  // doing it here leaves the loop with the pool's own work.
  absl::StatusOr<void*> warm = allocator.allocate(tier, bytes);
  if (!warm.ok()) return skip(state, "warm-up allocate", warm.status());
  if (absl::Status s = allocator.deallocate(tier, *warm); !s.ok()) {
    return skip(state, "warm-up deallocate", s);
  }
  const std::int64_t segment_allocs_before = allocator.stats(tier).num_segment_allocs;

  for (auto _ : state) {
    absl::StatusOr<void*> p = allocator.allocate(tier, bytes);
    if (!p.ok()) {
      skip(state, "allocate", p.status());
      break;
    }
    benchmark::DoNotOptimize(*p);
    if (absl::Status s = allocator.deallocate(tier, *p); !s.ok()) {
      skip(state, "deallocate", s);
      break;
    }
  }

  // Anything but 0 means the loop timed upstream calls, not the pool.
  state.counters["upstream_allocs"] =
      static_cast<double>(allocator.stats(tier).num_segment_allocs - segment_allocs_before);
  state.SetLabel(str_cat(alloc::device_backend_name(backend), " ", alloc::tier_name(tier), " over ",
                         allocator.upstream(tier).name()));
}

void BM_CudaMallocFree(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifdef STRATA_HAS_CUDA
  const auto bytes = static_cast<std::size_t>(state.range(0));
  cuda_pairs(
      state, "cudaMalloc", "cudaFree", [bytes](void** p) { return cudaMalloc(p, bytes); },
      [](void* p) { return cudaFree(p); });
  state.SetLabel("cudaMalloc+cudaFree");
#endif
}

void BM_CudaMallocAsync(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifdef STRATA_HAS_CUDA
  const auto bytes = static_cast<std::size_t>(state.range(0));
  cudaMemPool_t pool = nullptr;
  if (!cuda_ok(state, cudaDeviceGetDefaultMemPool(&pool, 0), "cudaDeviceGetDefaultMemPool")) {
    return;
  }
  // The default threshold (0) hands memory back to the driver at every synchronization; with
  // UINT64_MAX the pool keeps it, which is how a caching peer would configure it.
  std::uint64_t old_threshold = 0;
  if (!cuda_ok(state,
               cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &old_threshold),
               "cudaMemPoolGetAttribute")) {
    return;
  }
  std::uint64_t keep_everything = std::numeric_limits<std::uint64_t>::max();
  if (!cuda_ok(state,
               cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_everything),
               "cudaMemPoolSetAttribute")) {
    return;
  }
  cudaStream_t stream = nullptr;
  const cudaError_t stream_err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  // Later benchmarks get the pool as they would have found it, and its memory back.
  ScopeExit restore([&] {
    if (stream != nullptr) {
      (void)cudaStreamSynchronize(stream);
      (void)cudaStreamDestroy(stream);
    }
    (void)cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &old_threshold);
    (void)cudaMemPoolTrimTo(pool, 0);
  });
  if (!cuda_ok(state, stream_err, "cudaStreamCreate")) return;

  // Frees are stream-ordered and nothing else runs on the stream, so this is host-side time: what
  // a framework thread spends per pair, the figure strata's pool is compared on.
  cuda_pairs(
      state, "cudaMallocAsync", "cudaFreeAsync",
      [bytes, stream](void** p) { return cudaMallocAsync(p, bytes, stream); },
      [stream](void* p) { return cudaFreeAsync(p, stream); },
      [&] { return cuda_ok(state, cudaStreamSynchronize(stream), "cudaStreamSynchronize"); });
  state.SetLabel("cudaMallocAsync+cudaFreeAsync, default pool, release threshold UINT64_MAX");
#endif
}

void BM_CudaHostAlloc(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifdef STRATA_HAS_CUDA
  const auto bytes = static_cast<std::size_t>(state.range(0));
  // Portable, as strata's pinned upstream asks for it.
  constexpr unsigned int kFlags = cudaHostAllocPortable;
  cuda_pairs(
      state, "cudaHostAlloc", "cudaFreeHost",
      [bytes](void** p) { return cudaHostAlloc(p, bytes, kFlags); },
      [](void* p) { return cudaFreeHost(p); });
  state.SetLabel("cudaHostAlloc+cudaFreeHost");
#endif
}

}  // namespace strata::bench
