// bench/runtime_raw_copy.cpp: BM_RawPinnedCopy, raw cudaMemcpyAsync between cudaMalloc and
// cudaHostAlloc memory in each direction and both at once: the reference every runtime figure of
// strata_runtime_bench is divided by (bench/runtime_bench.h).
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/strings.h"
#include "bench/bench_util.h"
#include "bench/runtime_bench.h"

namespace strata::bench {

void BM_RawPinnedCopy(benchmark::State& state, Direction direction) {
  if (!require_gpu(state)) return;
#ifdef STRATA_HAS_CUDA
  absl::StatusOr<LinkRig*> rig = raw_rig();
  if (!rig.ok()) return skip(state, "raw copy buffers", rig.status());
  if (absl::StatusOr<LinkTiming> warm = run_raw(**rig, direction); !warm.ok()) {
    return skip(state, "warm-up copies", warm.status());
  }

  double h2d_seconds = 0;
  double d2h_seconds = 0;
  double span_seconds = 0;
  for (auto _ : state) {
    absl::StatusOr<LinkTiming> t = run_raw(**rig, direction);
    if (!t.ok()) {
      skip(state, "copies", t.status());
      break;
    }
    h2d_seconds += t->h2d_ms / 1e3;
    d2h_seconds += t->d2h_ms / 1e3;
    span_seconds += t->span_ms / 1e3;
    state.SetIterationTime(t->span_ms / 1e3);
  }
  if (state.error_occurred() || state.iterations() == 0) return;

  const double iterations = static_cast<double>(state.iterations());
  const double per_direction = static_cast<double>(kBytesPerDirection);
  const double bytes = direction == Direction::kBoth ? 2 * per_direction : per_direction;
  state.counters["bytes"] = bytes_counter(bytes);
  state.counters["gbps"] = gb_per_s(bytes * iterations, span_seconds);
  if (direction != Direction::kD2H) {
    state.counters["h2d_gbps"] = gb_per_s(per_direction * iterations, h2d_seconds);
  }
  if (direction != Direction::kH2D) {
    state.counters["d2h_gbps"] = gb_per_s(per_direction * iterations, d2h_seconds);
  }
  if (direction == Direction::kBoth) {
    state.counters["sum_gbps"] = gb_per_s(per_direction * iterations, h2d_seconds) +
                                 gb_per_s(per_direction * iterations, d2h_seconds);
  }
  state.SetLabel(str_cat("cudaMemcpyAsync cudaMalloc <-> cudaHostAlloc, ", kPieces,
                         " x 256 MiB per direction, CUDA events"));
#endif
}

}  // namespace strata::bench
