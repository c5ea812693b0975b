// bench/bench_util.h: helpers shared by strata's benchmark binaries.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "allocator/upstream.h"
#include "base/strings.h"
#include "benchmark/benchmark.h"

namespace strata::bench {

inline void skip(benchmark::State& state, const std::string& message) {
  // Google Benchmark allows one SkipWithError per run.
  if (!state.error_occurred()) state.SkipWithError(message.c_str());
}

inline void skip(benchmark::State& state, const std::string& what, const absl::Status& status) {
  skip(state, str_cat(what, ": ", status.ToString()));
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
