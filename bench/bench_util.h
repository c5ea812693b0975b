// bench/bench_util.h: helpers shared by strata's benchmark binaries.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>

#include "absl/status/status.h"
#include "allocator/upstream.h"
#include "base/strings.h"
#include "benchmark/benchmark.h"

// STRATA_BENCH_TORCH: LibTorch and CUDA are both there, so the LibTorch peers (which use its CUDA
// caching allocator and streams) are compiled in.
#if defined(STRATA_WITH_TORCH) && defined(STRATA_HAS_CUDA)
#define STRATA_BENCH_TORCH 1
#endif

namespace strata::bench {

inline double seconds_between(std::chrono::steady_clock::time_point start,
                              std::chrono::steady_clock::time_point end) {
  return std::chrono::duration<double>(end - start).count();
}

// Decimal GB/s, the unit PCIe figures and PERF.md use.
inline double gb_per_s(double bytes, double seconds) {
  return seconds > 0 ? bytes / seconds / 1e9 : 0;
}

// Byte counts print as Ki/Mi/Gi in the console table; the JSON keeps the exact value.
inline benchmark::Counter bytes_counter(double bytes) {
  return benchmark::Counter(bytes, benchmark::Counter::kDefaults, benchmark::Counter::kIs1024);
}

// SplitMix64: a fixed sequence on every platform, unlike the <random> distributions.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9;
    z = (z ^ (z >> 27)) * 0x94d049bb133111eb;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1), 24 random bits.
  float symmetric() { return static_cast<float>(next() >> 40) * 0x1p-23f - 1.0f; }

 private:
  std::uint64_t state_;
};

inline void skip(benchmark::State& state, const std::string& message) {
  // Google Benchmark allows one SkipWithError per run.
  if (!state.error_occurred()) state.SkipWithError(message.c_str());
}

inline void skip(benchmark::State& state, const std::string& what, const absl::Status& status) {
  skip(state, str_cat(what, ": ", status.ToString()));
}

// Runs a LibTorch benchmark body: LibTorch reports failures (out of memory, a missing kernel) by
// throwing, and an exception escaping a benchmark would end the whole binary, not just skip it.
template <typename Fn>
void torch_guarded(benchmark::State& state, Fn fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    skip(state, str_cat("LibTorch: ", e.what()));
  }
}

inline bool have_gpu() {
  static const int count = alloc::cuda_device_count();
  return count > 0;
}

// False, with the benchmark marked skipped, on a machine without a GPU, so one binary serves both.
inline bool require_gpu(benchmark::State& state) {
  if (have_gpu()) return true;
  skip(state, "no GPU");
  return false;
}

}  // namespace strata::bench
