// bench/allocator_torch.cpp: the LibTorch peers of strata_allocator_bench
// (bench/allocator_bench.h): one raw_alloc+raw_delete pair of c10's CUDA caching allocator, one
// torch::empty (what a framework pays on top of the allocator), and the training-step replays of
// bench/allocator_replay.cpp through the caching allocator. Compiled in with LibTorch and CUDA only
// (STRATA_BENCH_TORCH).
#include "bench/allocator_bench.h"

#ifdef STRATA_BENCH_TORCH
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <string>

#include "base/strings.h"
#include "bench/bench_util.h"
#include "bench/replay_trace.h"

namespace strata::bench {
namespace {

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

// A LibTorch peer's pair: `pair` once untimed (it fills the cache for the size), then once per
// iteration, the cache emptied after; an exception from LibTorch skips the benchmark.
template <typename Pair>
void torch_pairs(benchmark::State& state, const char* label, Pair pair) {
  if (!require_gpu(state)) return;
  torch_guarded(state, [&] {
    init_torch_cuda();
    pair();
    for (auto _ : state) pair();
    torch_alloc::emptyCache();
  });
  state.SetLabel(label);
}

}  // namespace

void BM_TorchCachingAllocator(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  torch_pairs(state, "c10::cuda::CUDACachingAllocator raw_alloc+raw_delete", [bytes] {
    void* p = torch_alloc::raw_alloc(bytes);
    benchmark::DoNotOptimize(p);
    torch_alloc::raw_delete(p);
  });
}

void BM_TorchEmptyTensor(benchmark::State& state) {
  const std::int64_t bytes = state.range(0);
  const torch::TensorOptions options = torch::dtype(torch::kUInt8).device(torch::kCUDA);
  // Includes what a framework pays on top of the allocator: TensorImpl, storage, dispatch.
  torch_pairs(state, "torch::empty(uint8, cuda), dropped", [bytes, &options] {
    torch::Tensor t = torch::empty({bytes}, options);
    benchmark::DoNotOptimize(t.data_ptr());
  });
}

void BM_ReplayTorch(benchmark::State& state, std::string_view trace_name) {
  if (!require_gpu(state)) return;
  const ReplayTrace& trace = replay_trace_named(trace_name);
  torch_guarded(state, [&] {
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
  });
  // The allocator's behaviour depends on this setting (expandable_segments, ...); record it.
  const char* conf = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  state.SetLabel(str_cat("c10 CUDACachingAllocator, PYTORCH_CUDA_ALLOC_CONF=",
                         conf != nullptr ? conf : "", ", ", trace.name, " shapes"));
}

}  // namespace strata::bench

#endif  // STRATA_BENCH_TORCH
