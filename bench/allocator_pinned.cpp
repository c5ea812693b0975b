// bench/allocator_pinned.cpp: which pinned method AllocatorOptions::pinned_method defaults to:
// how fast cudaHostAlloc and mmap + cudaHostRegister pin and unpin, and how fast a segment of each
// copies to and from the GPU (bench/allocator_bench.h).
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/strings.h"
#include "bench/allocator_bench.h"
#include "bench/bench_util.h"

namespace strata::bench {

using alloc::PinnedMethod;
using alloc::Upstream;
using Clock = std::chrono::steady_clock;

void BM_PinnedUpstream(benchmark::State& state, PinnedMethod method) {
  if (!require_gpu(state)) return;
  const auto bytes = static_cast<std::size_t>(state.range(0));
  absl::StatusOr<std::unique_ptr<Upstream>> upstream = alloc::make_pinned_host_upstream(method);
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

void BM_PinnedH2D(benchmark::State& state, PinnedMethod method) {
  if (!require_gpu(state)) return;
#ifdef STRATA_HAS_CUDA
  // Large enough that each copy runs ~5 ms at PCIe gen5 speed, so launch latency does not count.
  constexpr std::size_t kBytes = 256 * kMiB;
  absl::StatusOr<std::unique_ptr<Upstream>> upstream = alloc::make_pinned_host_upstream(method);
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

}  // namespace strata::bench
