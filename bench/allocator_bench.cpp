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
#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

// The LibTorch peers use its CUDA caching allocator, so they need CUDA as well.
#if defined(STRATA_WITH_TORCH) && defined(STRATA_HAS_CUDA)
#define STRATA_BENCH_TORCH 1
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/types.h>
#include <torch/version.h>
#endif

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/stats.h"
#include "allocator/tier.h"
#include "allocator/tiered_allocator.h"
#include "allocator/upstream.h"
#include "base/strings.h"
#include "base/units.h"
#include "bench/bench_util.h"
#include "bench/replay_trace.h"

namespace {

using strata::kKiB;
using strata::kMiB;
using strata::str_cat;
using strata::alloc::AllocatorOptions;
using strata::alloc::DeviceBackend;
using strata::alloc::PinnedMethod;
using strata::alloc::SimulatedBacking;
using strata::alloc::Tier;
using strata::alloc::TieredAllocator;
using strata::alloc::TierStats;
using strata::alloc::Upstream;
using Clock = std::chrono::steady_clock;

constexpr std::size_t kTiB = std::size_t{1} << 40;

// A small-pool block, a mid-size one, the largest small-pool size, a large block and a segment
// the size of a layer's optimizer states.
constexpr std::array<std::int64_t, 5> kPooledSizes = {512, 64 * kKiB, 1 * kMiB, 16 * kMiB,
                                                      256 * kMiB};

void pooled_sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t bytes : kPooledSizes) b->Arg(bytes);
}

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

using strata::bench::bytes_counter;
using strata::bench::gb_per_s;
using strata::bench::have_gpu;
using strata::bench::require_gpu;
using strata::bench::seconds_between;
using strata::bench::skip;

#ifdef STRATA_HAS_CUDA
bool cuda_ok(benchmark::State& state, cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  (void)cudaGetLastError();  // so the next benchmark does not inherit a sticky-looking error
  skip(state, str_cat(what, " failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
  return false;
}
#endif

absl::StatusOr<std::unique_ptr<TieredAllocator>> make_allocator(DeviceBackend backend) {
  AllocatorOptions options;
  options.device = backend;
  // Address-only: the simulated GPU reserves address space it never touches, so the simulated
  // benchmarks measure bookkeeping alone and the replay's ~13 GB costs no memory on a CPU box.
  options.simulated_device = {.capacity = kTiB, .backing = SimulatedBacking::kAddressOnly};
  return TieredAllocator::create(std::move(options));
}

// ---------------------------------------------------------------------------------------------
// 1. strata's pooled alloc+free.

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
  state.SetLabel(str_cat(strata::alloc::device_backend_name(backend), " ",
                         strata::alloc::tier_name(tier), " over ",
                         allocator.upstream(tier).name()));
}

BENCHMARK_CAPTURE(BM_StrataAllocFree, simulated_gpu, DeviceBackend::kSimulated, Tier::kGpu)
    ->Apply(pooled_sizes);
BENCHMARK_CAPTURE(BM_StrataAllocFree, gpu, DeviceBackend::kCuda, Tier::kGpu)->Apply(pooled_sizes);
BENCHMARK_CAPTURE(BM_StrataAllocFree, pinned_host, DeviceBackend::kCuda, Tier::kPinnedHost)
    ->Apply(pooled_sizes);
BENCHMARK_CAPTURE(BM_StrataAllocFree, pageable_host, DeviceBackend::kCuda, Tier::kPageableHost)
    ->Apply(pooled_sizes);

// ---------------------------------------------------------------------------------------------
// 2. Peers: the same pair through CUDA and LibTorch.

void BM_CudaMallocFree(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifdef STRATA_HAS_CUDA
  const auto bytes = static_cast<std::size_t>(state.range(0));
  void* p = nullptr;
  // Keeps the context's lazy set-up out of the loop.
  if (!cuda_ok(state, cudaMalloc(&p, bytes), "warm-up cudaMalloc")) return;
  if (!cuda_ok(state, cudaFree(p), "warm-up cudaFree")) return;
  for (auto _ : state) {
    if (!cuda_ok(state, cudaMalloc(&p, bytes), "cudaMalloc")) break;
    benchmark::DoNotOptimize(p);
    if (!cuda_ok(state, cudaFree(p), "cudaFree")) break;
  }
  state.SetLabel("cudaMalloc+cudaFree");
#endif
}
BENCHMARK(BM_CudaMallocFree)->Apply(pooled_sizes);

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

  void* p = nullptr;
  if (!cuda_ok(state, cudaMallocAsync(&p, bytes, stream), "warm-up cudaMallocAsync")) return;
  if (!cuda_ok(state, cudaFreeAsync(p, stream), "warm-up cudaFreeAsync")) return;
  if (!cuda_ok(state, cudaStreamSynchronize(stream), "cudaStreamSynchronize")) return;
  // Frees are stream-ordered and nothing else runs on the stream, so this is host-side time: what
  // a framework thread spends per pair, the figure strata's pool is compared on.
  for (auto _ : state) {
    if (!cuda_ok(state, cudaMallocAsync(&p, bytes, stream), "cudaMallocAsync")) break;
    benchmark::DoNotOptimize(p);
    if (!cuda_ok(state, cudaFreeAsync(p, stream), "cudaFreeAsync")) break;
  }
  state.SetLabel("cudaMallocAsync+cudaFreeAsync, default pool, release threshold UINT64_MAX");
#endif
}
BENCHMARK(BM_CudaMallocAsync)->Apply(pooled_sizes);

void BM_CudaHostAlloc(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifdef STRATA_HAS_CUDA
  const auto bytes = static_cast<std::size_t>(state.range(0));
  void* p = nullptr;
  // Portable, as strata's pinned upstream asks for it.
  constexpr unsigned int kFlags = cudaHostAllocPortable;
  if (!cuda_ok(state, cudaHostAlloc(&p, bytes, kFlags), "warm-up cudaHostAlloc")) return;
  if (!cuda_ok(state, cudaFreeHost(p), "warm-up cudaFreeHost")) return;
  for (auto _ : state) {
    if (!cuda_ok(state, cudaHostAlloc(&p, bytes, kFlags), "cudaHostAlloc")) break;
    benchmark::DoNotOptimize(p);
    if (!cuda_ok(state, cudaFreeHost(p), "cudaFreeHost")) break;
  }
  state.SetLabel("cudaHostAlloc+cudaFreeHost");
#endif
}
// Pinning costs time per page (PERF.md: ~0.7 ms per MiB), so 16 MiB gets a few fixed iterations
// and 256 MiB is left to BM_PinnedUpstream.
BENCHMARK(BM_CudaHostAlloc)->Arg(512)->Arg(64 * kKiB)->Arg(1 * kMiB);
BENCHMARK(BM_CudaHostAlloc)->Arg(16 * kMiB)->Iterations(10)->Unit(benchmark::kMillisecond);

#ifdef STRATA_BENCH_TORCH
namespace torch_alloc = c10::cuda::CUDACachingAllocator;

// Index of StatType::AGGREGATE in the caching allocator's StatArrays (all pools together).
constexpr std::size_t kTorchAggregate = 0;
constexpr c10::DeviceIndex kTorchDevice = 0;

// raw_alloc indexes per-device state that exists only after LibTorch initialized CUDA; creating a
// tensor is the public way to make it do so.
void init_torch_cuda() {
  static const bool initialized = [] {
    torch::Tensor t = torch::empty({1}, torch::dtype(torch::kUInt8).device(torch::kCUDA));
    return t.defined();
  }();
  (void)initialized;
}

void BM_TorchCachingAllocator(benchmark::State& state) {
  if (!require_gpu(state)) return;
  const auto bytes = static_cast<std::size_t>(state.range(0));
  try {
    init_torch_cuda();
    torch_alloc::raw_delete(torch_alloc::raw_alloc(bytes));  // fills the cache for this size
    for (auto _ : state) {
      void* p = torch_alloc::raw_alloc(bytes);
      benchmark::DoNotOptimize(p);
      torch_alloc::raw_delete(p);
    }
    torch_alloc::emptyCache();
  } catch (const std::exception& e) {
    skip(state, str_cat("LibTorch: ", e.what()));
  }
  state.SetLabel("c10::cuda::CUDACachingAllocator raw_alloc+raw_delete");
}
BENCHMARK(BM_TorchCachingAllocator)->Apply(pooled_sizes);

void BM_TorchEmptyTensor(benchmark::State& state) {
  if (!require_gpu(state)) return;
  const std::int64_t bytes = state.range(0);
  try {
    init_torch_cuda();
    const torch::TensorOptions options = torch::dtype(torch::kUInt8).device(torch::kCUDA);
    (void)torch::empty({bytes}, options);
    // Includes what a framework pays on top of the allocator: TensorImpl, storage, dispatch.
    for (auto _ : state) {
      torch::Tensor t = torch::empty({bytes}, options);
      benchmark::DoNotOptimize(t.data_ptr());
    }
    torch_alloc::emptyCache();
  } catch (const std::exception& e) {
    skip(state, str_cat("LibTorch: ", e.what()));
  }
  state.SetLabel("torch::empty(uint8, cuda), dropped");
}
BENCHMARK(BM_TorchEmptyTensor)->Apply(pooled_sizes);
#endif  // STRATA_BENCH_TORCH

// ---------------------------------------------------------------------------------------------
// 3. Which pinned method: how fast each pins, and how fast its memory copies.

void BM_PinnedUpstream(benchmark::State& state, PinnedMethod method) {
  if (!require_gpu(state)) return;
  const auto bytes = static_cast<std::size_t>(state.range(0));
  absl::StatusOr<std::unique_ptr<Upstream>> upstream =
      strata::alloc::make_pinned_host_upstream(method);
  if (!upstream.ok()) return skip(state, "make_pinned_host_upstream", upstream.status());

  // The first pin in a process also creates the CUDA context; keep that out of the figures.
  {
    absl::StatusOr<void*> p = (*upstream)->allocate(kMiB);
    if (!p.ok()) return skip(state, "warm-up allocate", p.status());
    if (absl::Status s = (*upstream)->deallocate(*p, kMiB); !s.ok()) {
      return skip(state, "warm-up deallocate", s);
    }
  }

  double pin_seconds = 0;
  double unpin_seconds = 0;
  for (auto _ : state) {
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<void*> p = (*upstream)->allocate(bytes);
    const Clock::time_point t1 = Clock::now();
    if (!p.ok()) {
      skip(state, "allocate", p.status());
      break;
    }
    const absl::Status s = (*upstream)->deallocate(*p, bytes);
    const Clock::time_point t2 = Clock::now();
    if (!s.ok()) {
      skip(state, "deallocate", s);
      break;
    }
    pin_seconds += seconds_between(t0, t1);
    unpin_seconds += seconds_between(t1, t2);
    state.SetIterationTime(seconds_between(t0, t2));
  }
  if (state.error_occurred() || state.iterations() == 0) return;

  const double iterations = static_cast<double>(state.iterations());
  const double total_bytes = static_cast<double>(bytes) * iterations;
  state.counters["pin_GBps"] = total_bytes / pin_seconds / 1e9;
  state.counters["pin_ms"] = pin_seconds / iterations * 1e3;
  state.counters["unpin_ms"] = unpin_seconds / iterations * 1e3;
  state.SetBytesProcessed(static_cast<std::int64_t>(total_bytes));
  state.SetLabel(std::string((*upstream)->name()));
}
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

void BM_PinnedH2D(benchmark::State& state, PinnedMethod method) {
  if (!require_gpu(state)) return;
#ifdef STRATA_HAS_CUDA
  // Large enough that each copy runs ~5 ms at PCIe gen5 speed, so launch latency does not count.
  constexpr std::size_t kBytes = 256 * kMiB;
  absl::StatusOr<std::unique_ptr<Upstream>> upstream =
      strata::alloc::make_pinned_host_upstream(method);
  if (!upstream.ok()) return skip(state, "make_pinned_host_upstream", upstream.status());
  absl::StatusOr<void*> host = (*upstream)->allocate(kBytes);
  if (!host.ok()) return skip(state, "pinned allocate", host.status());
  ScopeExit free_host([&] { (void)(*upstream)->deallocate(*host, kBytes); });
  std::memset(*host, 1, kBytes);

  void* device = nullptr;
  cudaStream_t stream = nullptr;
  std::array<cudaEvent_t, 3> events = {};  // start, H2D done, D2H done
  ScopeExit free_cuda([&] {
    if (stream != nullptr) (void)cudaStreamSynchronize(stream);
    for (cudaEvent_t e : events) {
      if (e != nullptr) (void)cudaEventDestroy(e);
    }
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
    if (device != nullptr) (void)cudaFree(device);
  });
  if (!cuda_ok(state, cudaMalloc(&device, kBytes), "cudaMalloc")) return;
  if (!cuda_ok(state, cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
               "cudaStreamCreate")) {
    return;
  }
  for (cudaEvent_t& e : events) {
    if (!cuda_ok(state, cudaEventCreate(&e), "cudaEventCreate")) return;
  }

  auto round_trip = [&]() -> cudaError_t {
    cudaError_t err = cudaEventRecord(events[0], stream);
    if (err == cudaSuccess) {
      err = cudaMemcpyAsync(device, *host, kBytes, cudaMemcpyHostToDevice, stream);
    }
    if (err == cudaSuccess) err = cudaEventRecord(events[1], stream);
    if (err == cudaSuccess) {
      err = cudaMemcpyAsync(*host, device, kBytes, cudaMemcpyDeviceToHost, stream);
    }
    if (err == cudaSuccess) err = cudaEventRecord(events[2], stream);
    if (err == cudaSuccess) err = cudaEventSynchronize(events[2]);
    return err;
  };
  if (!cuda_ok(state, round_trip(), "warm-up copies")) return;

  double h2d_seconds = 0;
  double d2h_seconds = 0;
  for (auto _ : state) {
    if (!cuda_ok(state, round_trip(), "copies")) break;
    float h2d_ms = 0;
    float d2h_ms = 0;
    if (!cuda_ok(state, cudaEventElapsedTime(&h2d_ms, events[0], events[1]), "elapsed") ||
        !cuda_ok(state, cudaEventElapsedTime(&d2h_ms, events[1], events[2]), "elapsed")) {
      break;
    }
    h2d_seconds += h2d_ms / 1e3;
    d2h_seconds += d2h_ms / 1e3;
    state.SetIterationTime((h2d_ms + d2h_ms) / 1e3);
  }
  if (state.error_occurred() || state.iterations() == 0) return;

  const double bytes_each_way =
      static_cast<double>(kBytes) * static_cast<double>(state.iterations());
  state.counters["h2d_GBps"] = gb_per_s(bytes_each_way, h2d_seconds);
  state.counters["d2h_GBps"] = gb_per_s(bytes_each_way, d2h_seconds);
  state.counters["bytes"] = bytes_counter(static_cast<double>(kBytes));
  state.SetBytesProcessed(static_cast<std::int64_t>(2 * bytes_each_way));
  state.SetLabel(str_cat(std::string((*upstream)->name()), " <-> cudaMalloc, 256 MiB"));
#endif
}
BENCHMARK_CAPTURE(BM_PinnedH2D, cudaHostAlloc, PinnedMethod::kCudaHostAlloc)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PinnedH2D, mmap_register, PinnedMethod::kMmapRegister)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// ---------------------------------------------------------------------------------------------
// 4. Replays of training steps' allocation traces (bench/replay_trace.h), fixed and variable
// shapes, through strata's GPU tier with expandable or fixed segments and through PyTorch's caching
// allocator (run the binary again with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for its
// expandable segments: the setting is read once per process).

using strata::alloc::GpuSegments;
using strata::bench::fixed_replay_trace;
using strata::bench::ReplayResult;
using strata::bench::ReplayTrace;
using strata::bench::report_replay;
using strata::bench::run_replay;
using strata::bench::variable_replay_trace;

const ReplayTrace& trace_named(std::string_view name) {
  return name == "variable" ? variable_replay_trace() : fixed_replay_trace();
}

void BM_ReplayStrata(benchmark::State& state, DeviceBackend backend, std::string_view trace_name,
                     GpuSegments segments) {
  if (backend == DeviceBackend::kCuda && !require_gpu(state)) return;
  const ReplayTrace& trace = trace_named(trace_name);  // built before the clock starts
  AllocatorOptions options;
  options.device = backend;
  options.gpu_segments = segments;
  options.simulated_device = {.capacity = kTiB, .backing = SimulatedBacking::kAddressOnly};
  absl::StatusOr<std::unique_ptr<TieredAllocator>> created =
      TieredAllocator::create(std::move(options));
  if (!created.ok()) return skip(state, "TieredAllocator::create", created.status());
  TieredAllocator& allocator = **created;

  for (auto _ : state) {
    std::string last_error;
    const ReplayResult result = run_replay(
        trace,
        [&](std::size_t bytes) -> void* {
          absl::StatusOr<void*> p = allocator.allocate(Tier::kGpu, bytes);
          if (p.ok()) return *p;
          last_error = p.status().ToString();
          return nullptr;
        },
        [&](void* p) {
          const absl::Status s = allocator.deallocate(Tier::kGpu, p);
          if (!s.ok()) last_error = s.ToString();
          return s.ok();
        });
    if (!result.error.empty()) {
      skip(state, str_cat("replay: ", result.error, ": ", last_error));
      break;
    }
    const TierStats stats = allocator.stats(Tier::kGpu);
    report_replay(state, trace, result,
                  {.reserved_bytes = stats.reserved_bytes.current,
                   .reserved_peak_bytes = stats.reserved_bytes.peak,
                   .peak_allocated_bytes = stats.allocated_bytes.peak,
                   .upstream_allocs = stats.num_segment_allocs,
                   .maps = stats.num_maps,
                   .upstream_alloc_ms = static_cast<double>(stats.upstream_alloc_ns) * 1e-6,
                   .upstream_free_ms = static_cast<double>(stats.upstream_free_ns) * 1e-6});
  }
  state.SetLabel(str_cat("strata ", strata::alloc::device_backend_name(backend), " gpu tier over ",
                         allocator.upstream(Tier::kGpu).name(), ", ",
                         allocator.pool(Tier::kGpu).expandable() ? "expandable" : "fixed",
                         " segments, ", trace.name, " shapes"));
}
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
void BM_ReplayTorch(benchmark::State& state, std::string_view trace_name) {
  if (!require_gpu(state)) return;
  const ReplayTrace& trace = trace_named(trace_name);
  try {
    init_torch_cuda();
    // Start from an empty cache with fresh peaks, so every figure is the replay's own.
    torch_alloc::emptyCache();
    torch_alloc::resetPeakStats(kTorchDevice);
    torch_alloc::resetAccumulatedStats(kTorchDevice);
    for (auto _ : state) {
      std::string last_error;
      const ReplayResult result = run_replay(
          trace,
          [&](std::size_t bytes) -> void* {
            try {
              return torch_alloc::raw_alloc(bytes);
            } catch (const std::exception& e) {  // c10::OutOfMemoryError among them
              last_error = e.what();
              return nullptr;
            }
          },
          [](void* p) {
            torch_alloc::raw_delete(p);
            return true;
          });
      if (!result.error.empty()) {
        skip(state, str_cat("replay: ", result.error, ": ", last_error));
        break;
      }
      const auto stats = torch_alloc::getDeviceStats(kTorchDevice);
      report_replay(state, trace, result,
                    {.reserved_bytes = stats.reserved_bytes[kTorchAggregate].current,
                     .reserved_peak_bytes = stats.reserved_bytes[kTorchAggregate].peak,
                     .peak_allocated_bytes = stats.allocated_bytes[kTorchAggregate].peak,
                     .upstream_allocs = stats.segment[kTorchAggregate].allocated});
    }
    torch_alloc::emptyCache();
  } catch (const std::exception& e) {
    skip(state, str_cat("LibTorch: ", e.what()));
  }
  // The allocator's behaviour depends on this setting (expandable_segments, ...); record it.
  const char* conf = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  state.SetLabel(str_cat("c10 CUDACachingAllocator, PYTORCH_CUDA_ALLOC_CONF=",
                         conf != nullptr ? conf : "", ", ", trace.name, " shapes"));
}
BENCHMARK_CAPTURE(BM_ReplayTorch, fixed_shapes, "fixed")
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ReplayTorch, variable_shapes, "variable")
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
#endif  // STRATA_BENCH_TORCH

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("gpu", strata::alloc::cuda_device_name(0));
  benchmark::AddCustomContext("cuda_devices", std::to_string(strata::alloc::cuda_device_count()));
  benchmark::AddCustomContext(
      "pinned_default",
      std::string(strata::alloc::pinned_method_name(AllocatorOptions{}.pinned_method)));
  for (const ReplayTrace* trace : {&fixed_replay_trace(), &variable_replay_trace()}) {
    std::string tokens;
    for (std::size_t t : trace->tokens) strata::str_append(&tokens, tokens.empty() ? "" : ",", t);
    benchmark::AddCustomContext(
        str_cat("replay_", trace->name),
        str_cat("layers=", strata::bench::kReplayLayers, " hidden=", strata::bench::kReplayHidden,
                " fp16 tokens_per_step=", tokens, " trace_peak_bytes=", trace->peak_bytes,
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
