// bench/runtime_rig.h: the runtime benchmarks' shared rig (strata_runtime_bench): a runtime under
// bulk with every role, tensors registered with pseudo-random payloads that are read back and
// compared after a run, migrations queued and their placement checked, the runtime's counters read
// around a timed region (strata_optim_bench reports them too), and the raw pinned copies every
// runtime figure is divided by (bench/link_rig.h), kept for the whole process.
//
// Example:
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<rt::Runtime> runtime,
//                           make_bulk_runtime(rt::DeviceKind::kSimulated));
//   STRATA_ASSIGN_OR_RETURN(std::vector<rt::TensorHandle> t,
//                           register_filled(*runtime, "state.", 2, kMiB, alloc::Tier::kGpu));
//   const Snapshot before = snapshot(*runtime);
//   STRATA_RETURN_IF_ERROR(queue_moves(*runtime, {{t[0], alloc::Tier::kPinnedHost}}));
//   STRATA_RETURN_IF_ERROR(runtime->wait_all());
//   Deltas deltas;
//   deltas.add(before, snapshot(*runtime));
//   STRATA_RETURN_IF_ERROR(verify_payload(*runtime, t[0], 0));
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/tier.h"
#include "bench/bench_util.h"
#include "bench/link_rig.h"
#include "runtime/device.h"
#include "runtime/runtime.h"
#include "runtime/tensor.h"

namespace strata::bench {

// Which way a run moves its bytes over the link.
enum class Direction { kH2D, kD2H, kBoth };

// ---------------------------------------------------------------------------------------------
// Payloads.

// kPieceBytes of pseudo-random words: every payload here is a prefix of it, with word 0 replaced
// by the tensor's tag.
const std::vector<std::uint64_t>& payload_pattern();
std::uint64_t payload_tag(int tensor_index);

// Reads the tensor back (a host wait, outside every timed region) and compares it with its payload.
absl::Status verify_payload(rt::Runtime& runtime, rt::TensorHandle tensor, int tensor_index);

// ---------------------------------------------------------------------------------------------
// The runtime.

// Policy bulk with every role: each tensor placed on its spec's home tier and moved only when
// asked; offload_all / reload_all move everything registered.
absl::StatusOr<std::unique_ptr<rt::Runtime>> make_bulk_runtime(rt::DeviceKind device);

// Registers `count` tensors of `bytes` (fp32, two per layer: exp_avg and exp_avg_sq) on `home`
// and writes each one's payload: tensor i holds payload_pattern() with word 0 replaced by
// payload_tag(i).
absl::StatusOr<std::vector<rt::TensorHandle>> register_filled(rt::Runtime& runtime,
                                                              std::string_view prefix, int count,
                                                              std::size_t bytes, alloc::Tier home);

// What the benchmarks read before and after a timed region.
struct Snapshot {
  std::int64_t gpu_segment_allocs = 0;
  std::int64_t pinned_segment_allocs = 0;
  rt::RuntimeStats runtime;
};
Snapshot snapshot(rt::Runtime& runtime);

// Sums of (after - before) over timed regions.
struct Deltas {
  std::int64_t gpu_segment_allocs = 0;
  std::int64_t pinned_segment_allocs = 0;
  std::int64_t host_syncs = 0;
  std::int64_t failed_migrations = 0;
  std::int64_t timed_bytes_h2d = 0;
  std::int64_t timed_bytes_d2h = 0;
  double h2d_busy_ms = 0;
  double d2h_busy_ms = 0;

  void add(const Snapshot& before, const Snapshot& after) {
    gpu_segment_allocs += after.gpu_segment_allocs - before.gpu_segment_allocs;
    pinned_segment_allocs += after.pinned_segment_allocs - before.pinned_segment_allocs;
    host_syncs += after.runtime.host_syncs - before.runtime.host_syncs;
    failed_migrations += after.runtime.failed_migrations - before.runtime.failed_migrations;
    timed_bytes_h2d += after.runtime.timed_bytes_h2d - before.runtime.timed_bytes_h2d;
    timed_bytes_d2h += after.runtime.timed_bytes_d2h - before.runtime.timed_bytes_d2h;
    h2d_busy_ms += after.runtime.h2d_busy_ms - before.runtime.h2d_busy_ms;
    d2h_busy_ms += after.runtime.d2h_busy_ms - before.runtime.d2h_busy_ms;
  }
};

// The runtime's own view of its copy streams (GPU-timed busy time), next to the host wall time:
// engine_h2d_gbps and engine_d2h_gbps, where that direction was busy.
void report_engine(benchmark::State& state, const Deltas& d);

// ---------------------------------------------------------------------------------------------
// Migrations.

struct Move {
  rt::TensorHandle tensor;
  alloc::Tier dst;
};

absl::Status queue_moves(rt::Runtime& runtime, const std::vector<Move>& moves);

// After wait_all(): every tensor is where it was sent and nothing is in flight. Guards against a
// migration that silently did nothing (and so took no time).
absl::Status check_placement(rt::Runtime& runtime, const std::vector<Move>& moves);

// ---------------------------------------------------------------------------------------------
// Raw pinned copies: the reference every runtime figure is divided by.

#ifdef STRATA_HAS_CUDA
// Made on first use, kept for the whole process, freed by release_raw_rig() from main: no CUDA
// call in static destructors.
absl::StatusOr<LinkRig*> raw_rig();

// One pass: 16 pieces of 256 MiB in each direction asked for; returns once the copies are done.
absl::StatusOr<LinkTiming> run_raw(LinkRig& rig, Direction direction);
#endif  // STRATA_HAS_CUDA

void release_raw_rig();

}  // namespace strata::bench
