// bench/runtime_migrate.cpp: BM_RuntimeMigrate, the raw copies' bytes (bench/runtime_raw_copy.cpp)
// as 256 MiB tensors moved by the runtime's migrate(), each timed cycle next to a raw pass of the
// same direction (bench/runtime_bench.h).
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/tier.h"
#include "base/status.h"
#include "base/strings.h"
#include "bench/bench_util.h"
#include "bench/runtime_bench.h"

namespace strata::bench {
namespace {

using alloc::Tier;
using Clock = std::chrono::steady_clock;

// One runtime for the three directions (and every repetition), so pinning 8 GiB is paid once.
// Tensors 0..15 make the h2d / d2h runs; "both" moves 0..15 one way and 16..31 the other.
struct MigrateRig {
  std::unique_ptr<rt::Runtime> runtime;
  std::vector<rt::TensorHandle> tensors;  // 2 * kPieces of kPieceBytes, registered in pinned host
};

MigrateRig* g_migrate_rig = nullptr;

absl::StatusOr<MigrateRig*> migrate_rig() {
  if (g_migrate_rig != nullptr) return g_migrate_rig;
  auto rig = std::make_unique<MigrateRig>();
  STRATA_ASSIGN_OR_RETURN(rig->runtime, make_bulk_runtime(rt::DeviceKind::kCuda));
  STRATA_ASSIGN_OR_RETURN(rig->tensors, register_filled(*rig->runtime, "migrate.", 2 * kPieces,
                                                        kPieceBytes, Tier::kPinnedHost));
  g_migrate_rig = rig.release();
  return g_migrate_rig;
}

// The moves of cycle `cycle`: `setup` (untimed; no-ops once in steady state for "both") puts the
// tensors where `timed` starts from.
void plan_migrate_cycle(const std::vector<rt::TensorHandle>& t, Direction direction,
                        std::int64_t cycle, std::vector<Move>& setup, std::vector<Move>& timed) {
  setup.clear();
  timed.clear();
  for (int k = 0; k < kPieces; ++k) {
    switch (direction) {
      case Direction::kH2D:
        setup.push_back({t[k], Tier::kPinnedHost});
        timed.push_back({t[k], Tier::kGpu});
        break;
      case Direction::kD2H:
        setup.push_back({t[k], Tier::kGpu});
        timed.push_back({t[k], Tier::kPinnedHost});
        break;
      case Direction::kBoth: {
        // Alternate groups, so each cycle starts where the previous one ended.
        const bool even = cycle % 2 == 0;
        const rt::TensorHandle leaving = t[even ? k : kPieces + k];
        const rt::TensorHandle arriving = t[even ? kPieces + k : k];
        setup.push_back({leaving, Tier::kGpu});
        setup.push_back({arriving, Tier::kPinnedHost});
        // Interleaved, so both copy streams get work from the first call on.
        timed.push_back({leaving, Tier::kPinnedHost});
        timed.push_back({arriving, Tier::kGpu});
        break;
      }
    }
  }
}

}  // namespace

void BM_RuntimeMigrate(benchmark::State& state, Direction direction) {
  if (!require_gpu(state)) return;
  absl::StatusOr<MigrateRig*> rig = migrate_rig();
  if (!rig.ok()) return skip(state, "runtime with 32 x 256 MiB tensors", rig.status());
  rt::Runtime& runtime = *(*rig)->runtime;
  const std::vector<rt::TensorHandle>& tensors = (*rig)->tensors;

  std::vector<Move> setup;
  std::vector<Move> timed;
  Deltas deltas;
  // One cycle: untimed set-up, then the timed migrations; returns the timed seconds.
  auto run_cycle = [&](std::int64_t cycle, bool count) -> absl::StatusOr<double> {
    plan_migrate_cycle(tensors, direction, cycle, setup, timed);
    STRATA_RETURN_IF_ERROR(queue_moves(runtime, setup));
    STRATA_RETURN_IF_ERROR(runtime.wait_all());
    STRATA_RETURN_IF_ERROR(check_placement(runtime, setup));
    const Snapshot before = snapshot(runtime);
    const Clock::time_point start = Clock::now();
    STRATA_RETURN_IF_ERROR(queue_moves(runtime, timed));
    STRATA_RETURN_IF_ERROR(runtime.wait_all());
    const Clock::time_point end = Clock::now();
    const Snapshot after = snapshot(runtime);
    STRATA_RETURN_IF_ERROR(check_placement(runtime, timed));
    if (count) deltas.add(before, after);
    return seconds_between(start, end);
  };

  // A full cycle first, so the GPU and pinned pools hold every block the timed cycles use.
  std::int64_t cycle = 0;
  if (absl::StatusOr<double> warm = run_cycle(cycle++, false); !warm.ok()) {
    return skip(state, "warm-up cycle", warm.status());
  }
#ifdef STRATA_HAS_CUDA
  // The raw copies of the same direction right before each timed cycle (See Note [Adjacent floor]).
  absl::StatusOr<LinkRig*> raw = raw_rig();
  if (!raw.ok()) return skip(state, "raw copy buffers", raw.status());
  AdjacentLink link(**raw, direction != Direction::kD2H, direction != Direction::kH2D);
#endif
  double seconds = 0;
  for (auto _ : state) {
#ifdef STRATA_HAS_CUDA
    if (absl::Status s = link.sample(); !s.ok()) {
      skip(state, "raw copies next to the cycle", s);
      break;
    }
#endif
    absl::StatusOr<double> s = run_cycle(cycle++, true);
    if (!s.ok()) {
      skip(state, "migrate cycle", s.status());
      break;
    }
    seconds += *s;
    state.SetIterationTime(*s);
  }
  if (state.error_occurred() || state.iterations() == 0) return;

  // The data arrived intact: one tensor of each group that moved, read back.
  std::vector<int> to_verify = {0, kPieces - 1};
  if (direction == Direction::kBoth) to_verify.push_back(2 * kPieces - 1);
  for (int i : to_verify) {
    if (absl::Status s = verify_payload(runtime, tensors[i], i); !s.ok()) {
      return skip(state, "read-back", s);
    }
  }

  const double iterations = static_cast<double>(state.iterations());
  const double per_direction = static_cast<double>(kBytesPerDirection);
  const double bytes = direction == Direction::kBoth ? 2 * per_direction : per_direction;
  state.counters["bytes"] = bytes_counter(bytes);
  state.counters["gbps"] = gb_per_s(bytes * iterations, seconds);
#ifdef STRATA_HAS_CUDA
  // The target's ratio: against the raw copies taken next to each cycle.
  const double raw_gbps = link.span_gbps() * (direction == Direction::kBoth ? 2 : 1);
  state.counters["raw_gbps"] = raw_gbps;
  state.counters["ratio_to_raw"] =
      raw_gbps > 0 ? gb_per_s(bytes * iterations, seconds) / raw_gbps : 0;
#endif
  // Each must be 0: a cudaMalloc or pinning call inside the timed region would be measured too.
  state.counters["gpu_segment_allocs"] = static_cast<double>(deltas.gpu_segment_allocs);
  state.counters["pinned_segment_allocs"] = static_cast<double>(deltas.pinned_segment_allocs);
  state.counters["failed_migrations"] = static_cast<double>(deltas.failed_migrations);
  state.counters["host_syncs"] = static_cast<double>(deltas.host_syncs) / iterations;
  report_engine(state, deltas);
  state.SetLabel(str_cat("runtime migrate()+wait_all(), policy bulk, ",
                         direction == Direction::kBoth ? 2 * kPieces : kPieces,
                         " x 256 MiB tensors, host wall time"));
}

void release_migrate_rig() {
  delete g_migrate_rig;
  g_migrate_rig = nullptr;
}

}  // namespace strata::bench
