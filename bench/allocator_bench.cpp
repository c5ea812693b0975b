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
//   BM_ReplayStrata/{simulated,gpu},    a GPT-like training step's allocation trace (5 steps), run
//   BM_ReplayTorch                      once: reserved bytes against peak allocated bytes (target:
//                                       reserved / peak allocated <= 1.05).
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
// 4. Replay of a training step's allocation trace.
//
// The model: GPT-like, fp16 activations. Sizes, with T tokens (batch * sequence) and hidden h:
//   one T x h activation  T*h*2  = 32 MiB;  T x 3h = 96 MiB;  T x 4h = 128 MiB
//   parameters per layer  12*h*h*2 = 96 MiB (qkv 24, proj 8, fc1 32, fc2 32) plus 4 x 4 KiB
//   saved activations per layer: x, qkv, attention out, fc1 out, gelu out = 13*T*h*2 = 416 MiB
// Peak (start of backward): 24 x 416 MiB activations + 2.25 GiB parameters + gradient
// temporaries ~ 12.2 GiB (13.1 GB), under the ~20 GB the trace may use; trace_peak_bytes reports
// the exact figure.
constexpr int kReplayLayers = 24;
constexpr std::size_t kReplayHidden = 2048;
constexpr std::size_t kReplayTokens = 8192;
constexpr std::size_t kFp16Bytes = 2;
constexpr int kReplaySteps = 5;
constexpr std::size_t kMinSmallBytes = 512;
constexpr std::size_t kMaxSmallBytes = 64 * kKiB;
constexpr std::uint64_t kReplaySeed = 0x5eed'a110c'8a7e;

struct TraceEvent {
  enum class Kind : std::uint8_t { kAlloc, kFree };
  Kind kind = Kind::kAlloc;
  std::uint32_t slot = 0;  // names the allocation; a kFree frees the pointer its kAlloc got
  std::size_t bytes = 0;
};

struct ReplayTrace {
  std::vector<TraceEvent> setup;  // parameters, before step 1
  std::vector<std::vector<TraceEvent>> steps;
  std::vector<TraceEvent> teardown;  // frees the parameters
  std::uint32_t num_slots = 0;
  std::size_t peak_bytes = 0;  // largest sum of requested bytes live at once
  std::size_t allocs_per_step = 0;
};

using strata::bench::SplitMix64;

class TraceBuilder {
 public:
  // Events go to `out` until the next call.
  void set_output(std::vector<TraceEvent>* out) { out_ = out; }

  std::uint32_t allocate(std::size_t bytes) {
    const auto slot = static_cast<std::uint32_t>(slot_bytes_.size());
    slot_bytes_.push_back(bytes);
    out_->push_back({TraceEvent::Kind::kAlloc, slot, bytes});
    live_bytes_ += bytes;
    peak_bytes_ = std::max(peak_bytes_, live_bytes_);
    return slot;
  }

  void release(std::uint32_t slot) {
    out_->push_back({TraceEvent::Kind::kFree, slot, slot_bytes_[slot]});
    live_bytes_ -= slot_bytes_[slot];
  }

  std::size_t bytes(std::uint32_t slot) const { return slot_bytes_[slot]; }
  std::uint32_t num_slots() const { return static_cast<std::uint32_t>(slot_bytes_.size()); }
  std::size_t peak_bytes() const { return peak_bytes_; }

 private:
  std::vector<TraceEvent>* out_ = nullptr;
  std::vector<std::size_t> slot_bytes_;
  std::size_t live_bytes_ = 0;
  std::size_t peak_bytes_ = 0;
};

// 512 B .. 64 KiB, a whole number of fp16 elements.
std::size_t small_bytes(SplitMix64& rng) {
  const std::size_t span = kMaxSmallBytes - kMinSmallBytes + 1;
  return (kMinSmallBytes + static_cast<std::size_t>(rng.next() % span)) & ~std::size_t{1};
}

ReplayTrace build_replay_trace() {
  const std::size_t th = kReplayTokens * kReplayHidden * kFp16Bytes;  // one T x h activation
  const std::size_t hh = kReplayHidden * kReplayHidden * kFp16Bytes;  // one h x h weight
  const std::size_t vec = kReplayHidden * kFp16Bytes;                 // a bias or layernorm weight
  const std::size_t row_stat = kReplayTokens * sizeof(float);         // layernorm mean or rstd
  const std::array<std::size_t, 8> param_bytes = {3 * hh, hh, 4 * hh, 4 * hh, vec, vec, vec, vec};

  ReplayTrace trace;
  TraceBuilder b;
  SplitMix64 rng(kReplaySeed);

  b.set_output(&trace.setup);
  std::vector<std::uint32_t> params;
  for (int layer = 0; layer < kReplayLayers; ++layer) {
    for (std::size_t bytes : param_bytes) params.push_back(b.allocate(bytes));
  }

  struct Saved {
    std::uint32_t x, mean, rstd, qkv, attn, fc1, gelu, small;
  };
  trace.steps.resize(kReplaySteps);
  for (int step = 0; step < kReplaySteps; ++step) {
    b.set_output(&trace.steps[step]);

    // Forward: saved activations stay live until backward reaches the layer; the temporaries
    // die inside it, leaving holes between saved blocks as a real forward pass does.
    std::vector<Saved> saved(kReplayLayers);
    for (Saved& s : saved) {
      s.x = b.allocate(th);
      s.mean = b.allocate(row_stat);
      s.rstd = b.allocate(row_stat);
      s.qkv = b.allocate(3 * th);
      const std::uint32_t workspace = b.allocate(kMiB);
      s.attn = b.allocate(th);
      b.release(workspace);
      const std::uint32_t small_a = b.allocate(small_bytes(rng));
      const std::uint32_t small_b = b.allocate(small_bytes(rng));
      s.fc1 = b.allocate(4 * th);
      const std::uint32_t gelu_temp = b.allocate(4 * th);
      s.gelu = b.allocate(4 * th);
      b.release(gelu_temp);
      b.release(small_a);
      s.small = b.allocate(small_bytes(rng));  // e.g. a dropout seed or mask summary
      b.release(small_b);
    }

    // Backward, last layer first. Parameter gradients are made on the step's first (only)
    // backward pass and live until the optimizer has used them.
    std::vector<std::uint32_t> grads;
    std::uint32_t dy = b.allocate(th);  // gradient of the loss w.r.t. the last layer's output
    for (int layer = kReplayLayers - 1; layer >= 0; --layer) {
      const Saved& s = saved[layer];
      const std::uint32_t g4 = b.allocate(4 * th);
      grads.push_back(b.allocate(4 * hh));  // fc2
      b.release(s.gelu);
      grads.push_back(b.allocate(4 * hh));  // fc1
      b.release(s.fc1);
      const std::uint32_t small = b.allocate(small_bytes(rng));
      const std::uint32_t g3 = b.allocate(3 * th);
      b.release(g4);
      grads.push_back(b.allocate(hh));  // proj
      b.release(s.attn);
      grads.push_back(b.allocate(3 * hh));  // qkv
      b.release(s.qkv);
      for (int i = 0; i < 4; ++i) grads.push_back(b.allocate(vec));  // biases, layernorms
      const std::uint32_t g1 = b.allocate(th);  // gradient w.r.t. the layer's input
      b.release(g3);
      b.release(s.mean);
      b.release(s.rstd);
      b.release(s.x);
      b.release(s.small);
      b.release(small);
      b.release(dy);
      dy = g1;
    }
    b.release(dy);

    // Optimizer: one temporary per parameter, then the gradients go (zero_grad(set_to_none)).
    for (std::uint32_t grad : grads) b.release(b.allocate(b.bytes(grad)));
    for (std::uint32_t grad : grads) b.release(grad);
  }

  b.set_output(&trace.teardown);
  for (std::uint32_t param : params) b.release(param);

  trace.num_slots = b.num_slots();
  trace.peak_bytes = b.peak_bytes();
  for (const TraceEvent& e : trace.steps.front()) {
    if (e.kind == TraceEvent::Kind::kAlloc) ++trace.allocs_per_step;
  }
  return trace;
}

const ReplayTrace& replay_trace() {
  static const ReplayTrace* const trace = new ReplayTrace(build_replay_trace());
  return *trace;
}

struct ReplayResult {
  std::string error;  // empty when the whole trace ran
  std::vector<double> step_seconds;
};

// Plays replay_trace() through `allocate` (bytes -> pointer, nullptr on failure) and `deallocate`
// (pointer -> success). Every block is freed on return, parameters included, so the allocator's
// reserved bytes are read afterwards: both allocators keep freed segments cached.
template <typename Allocate, typename Free>
ReplayResult run_replay(Allocate allocate, Free deallocate) {
  const ReplayTrace& trace = replay_trace();
  std::vector<void*> ptrs(trace.num_slots, nullptr);
  ReplayResult result;
  auto play = [&](const std::vector<TraceEvent>& events) {
    for (const TraceEvent& e : events) {
      if (e.kind == TraceEvent::Kind::kAlloc) {
        void* p = allocate(e.bytes);
        if (p == nullptr) {
          result.error = str_cat("allocation of ", strata::format_bytes(e.bytes), " failed");
          return false;
        }
        ptrs[e.slot] = p;
      } else {
        void* p = std::exchange(ptrs[e.slot], nullptr);
        if (!deallocate(p)) {
          result.error = str_cat("free of ", strata::format_bytes(e.bytes), " failed");
          return false;
        }
      }
    }
    return true;
  };

  bool ok = play(trace.setup);
  for (const std::vector<TraceEvent>& step : trace.steps) {
    if (!ok) break;
    const Clock::time_point start = Clock::now();
    ok = play(step);
    result.step_seconds.push_back(seconds_between(start, Clock::now()));
  }
  if (ok) ok = play(trace.teardown);
  if (!ok) {
    // Leave the allocator empty for the benchmarks after this one.
    for (void* p : ptrs) {
      if (p != nullptr) (void)deallocate(p);
    }
  }
  return result;
}

// What each allocator says about its memory after the replay.
struct ReplayMemory {
  std::int64_t reserved_bytes = 0;  // at the end
  std::int64_t reserved_peak_bytes = 0;
  std::int64_t peak_allocated_bytes = 0;  // after the allocator's rounding
  std::int64_t upstream_allocs = 0;       // cudaMalloc (or simulated) calls
};

void report_replay(benchmark::State& state, const ReplayResult& result,
                   const ReplayMemory& memory) {
  const ReplayTrace& trace = replay_trace();
  const auto trace_peak = static_cast<double>(trace.peak_bytes);
  const auto reserved_peak = static_cast<double>(memory.reserved_peak_bytes);
  const auto peak_allocated = static_cast<double>(memory.peak_allocated_bytes);
  state.counters["reserved_bytes"] = bytes_counter(static_cast<double>(memory.reserved_bytes));
  state.counters["reserved_peak_bytes"] = bytes_counter(reserved_peak);
  state.counters["peak_allocated_bytes"] = bytes_counter(peak_allocated);
  state.counters["trace_peak_bytes"] = bytes_counter(trace_peak);
  // Peak reserved rather than reserved at the end: the two agree unless an allocator released
  // segments on the way, and the peak is what the GPU had to hold.
  state.counters["reserved_over_peak_allocated"] =
      peak_allocated > 0 ? reserved_peak / peak_allocated : 0;
  state.counters["reserved_over_trace_peak"] = trace_peak > 0 ? reserved_peak / trace_peak : 0;
  state.counters["upstream_allocs"] = static_cast<double>(memory.upstream_allocs);
  state.counters["allocs_per_step"] = static_cast<double>(trace.allocs_per_step);

  // Step 1 pays for growing the pool; the later steps are the steady state.
  const std::vector<double>& steps = result.step_seconds;
  if (!steps.empty()) {
    double total = 0;
    for (double s : steps) total += s;
    state.counters["step_ms"] = total / static_cast<double>(steps.size()) * 1e3;
    state.counters["first_step_ms"] = steps.front() * 1e3;
    if (steps.size() > 1) {
      state.counters["steady_step_ms"] =
          (total - steps.front()) / static_cast<double>(steps.size() - 1) * 1e3;
    }
  }
}

void BM_ReplayStrata(benchmark::State& state, DeviceBackend backend) {
  if (backend == DeviceBackend::kCuda && !require_gpu(state)) return;
  (void)replay_trace();  // build the trace before the clock starts
  absl::StatusOr<std::unique_ptr<TieredAllocator>> created = make_allocator(backend);
  if (!created.ok()) return skip(state, "TieredAllocator::create", created.status());
  TieredAllocator& allocator = **created;

  for (auto _ : state) {
    std::string last_error;
    const ReplayResult result = run_replay(
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
    report_replay(state, result,
                  {.reserved_bytes = stats.reserved_bytes.current,
                   .reserved_peak_bytes = stats.reserved_bytes.peak,
                   .peak_allocated_bytes = stats.allocated_bytes.peak,
                   .upstream_allocs = stats.num_segment_allocs});
  }
  state.SetLabel(str_cat("strata ", strata::alloc::device_backend_name(backend), " gpu tier over ",
                         allocator.upstream(Tier::kGpu).name()));
}
BENCHMARK_CAPTURE(BM_ReplayStrata, simulated, DeviceBackend::kSimulated)
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ReplayStrata, gpu, DeviceBackend::kCuda)
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

#ifdef STRATA_BENCH_TORCH
void BM_ReplayTorch(benchmark::State& state) {
  if (!require_gpu(state)) return;
  (void)replay_trace();
  try {
    init_torch_cuda();
    // Start from an empty cache with fresh peaks, so every figure is the replay's own.
    torch_alloc::emptyCache();
    torch_alloc::resetPeakStats(kTorchDevice);
    torch_alloc::resetAccumulatedStats(kTorchDevice);
    for (auto _ : state) {
      std::string last_error;
      const ReplayResult result = run_replay(
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
      report_replay(state, result,
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
  state.SetLabel(
      str_cat("c10 CUDACachingAllocator, PYTORCH_CUDA_ALLOC_CONF=", conf != nullptr ? conf : ""));
}
BENCHMARK(BM_ReplayTorch)->Iterations(1)->Unit(benchmark::kMillisecond);
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
  const ReplayTrace& trace = replay_trace();
  benchmark::AddCustomContext(
      "replay_model",
      str_cat("layers=", kReplayLayers, " hidden=", kReplayHidden, " tokens=", kReplayTokens,
              " fp16 steps=", kReplaySteps, " trace_peak_bytes=", trace.peak_bytes,
              " allocs_per_step=", trace.allocs_per_step));
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
