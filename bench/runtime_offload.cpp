// bench/runtime_offload.cpp: BM_OffloadReload and BM_SimulatedOffloadReload, a phase switch
// (training <-> rollout) under bulk: offload_all + reload_all of every tensor, each timed cycle
// judged against raw passes of each direction taken right before it (bench/runtime_bench.h).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/stats.h"
#include "allocator/tier.h"
#include "allocator/tiered_allocator.h"
#include "base/status.h"
#include "base/strings.h"
#include "bench/bench_util.h"
#include "bench/runtime_bench.h"

namespace strata::bench {
namespace {

using alloc::Tier;
using Clock = std::chrono::steady_clock;

// Where offload_all left the tensors: bytes on the pinned tier, and how many went elsewhere.
struct Offloaded {
  std::size_t pinned_bytes = 0;
  int pageable_tensors = 0;
};

absl::StatusOr<Offloaded> check_offloaded(rt::Runtime& runtime,
                                          const std::vector<rt::TensorHandle>& tensors) {
  Offloaded out;
  for (rt::TensorHandle h : tensors) {
    STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, runtime.info(h));
    if (info.tier == Tier::kGpu || info.in_flight) {
      return absl::InternalError(str_cat(info.spec.name, " is on ", alloc::tier_name(info.tier),
                                         info.in_flight ? " (in flight)" : "",
                                         " after offload_all returned"));
    }
    if (info.tier == Tier::kPinnedHost) {
      out.pinned_bytes += info.bytes;
    } else {
      ++out.pageable_tensors;
    }
  }
  return out;
}

absl::Status check_all_on(rt::Runtime& runtime, const std::vector<rt::TensorHandle>& tensors,
                          Tier tier) {
  std::vector<Move> expected;
  expected.reserve(tensors.size());
  for (rt::TensorHandle h : tensors) expected.push_back({h, tier});
  return check_placement(runtime, expected);
}

// One benchmark: `count` tensors of `total_bytes` in all on `device`, offload_all (keeping the GPU
// segments cached or not, as BM_OffloadReload in bench/runtime_bench.h) and reload_all per timed
// cycle, after an untimed first cycle.
void run_offload_reload(benchmark::State& state, std::size_t total_bytes, int count,
                        rt::DeviceKind device, bool keep_cached) {
  const bool cuda = device == rt::DeviceKind::kCuda;
  if (cuda && !require_gpu(state)) return;
  const std::size_t tensor_bytes = total_bytes / static_cast<std::size_t>(count);
  STRATA_CHECK(tensor_bytes * static_cast<std::size_t>(count) == total_bytes,
               "bytes must split evenly: ", total_bytes, " / ", count);

  absl::StatusOr<std::unique_ptr<rt::Runtime>> created = make_bulk_runtime(device);
  if (!created.ok()) return skip(state, "Runtime::create", created.status());
  rt::Runtime& runtime = **created;
  absl::StatusOr<std::vector<rt::TensorHandle>> registered =
      register_filled(runtime, "state.", count, tensor_bytes, Tier::kGpu);
  if (!registered.ok()) return skip(state, "register", registered.status());
  const std::vector<rt::TensorHandle>& tensors = *registered;

  // The first cycle pins the host memory (and may grow pools); it is reported, not timed.
  const Clock::time_point w0 = Clock::now();
  absl::Status status = runtime.offload_all();
  absl::StatusOr<Offloaded> first_offload =
      status.ok() ? check_offloaded(runtime, tensors) : absl::StatusOr<Offloaded>(status);
  if (!first_offload.ok()) return skip(state, "first offload_all", first_offload.status());
  const Clock::time_point w1 = Clock::now();
  status = runtime.reload_all();
  if (status.ok()) status = check_all_on(runtime, tensors, Tier::kGpu);
  if (!status.ok()) return skip(state, "first reload_all", status);
  const Clock::time_point w2 = Clock::now();

#ifdef STRATA_HAS_CUDA
  // The floor's bandwidths: raw passes, each direction alone, right before each timed cycle
  // (See Note [Adjacent floor]).
  std::optional<AdjacentLink> raw_h2d;
  std::optional<AdjacentLink> raw_d2h;
  if (cuda) {
    absl::StatusOr<LinkRig*> rig = raw_rig();
    if (!rig.ok()) return skip(state, "raw copy buffers", rig.status());
    raw_h2d.emplace(**rig, /*h2d=*/true, /*d2h=*/false);
    raw_d2h.emplace(**rig, /*h2d=*/false, /*d2h=*/true);
    if (absl::StatusOr<LinkTiming> warm = run_link(**rig, true, true); !warm.ok()) {
      return skip(state, "raw copies, warm-up", warm.status());
    }
  }
#endif

  rt::OffloadOptions offload;
  offload.keep_cached = keep_cached;
  const Snapshot before = snapshot(runtime);
  const alloc::TierStats gpu_before = runtime.allocator().stats(Tier::kGpu);
  double offload_seconds = 0;
  double reload_seconds = 0;
  double worst_reserved_over_held = 0;
  std::int64_t pinned_reserved = 0;
  Offloaded held;
  for (auto _ : state) {
#ifdef STRATA_HAS_CUDA
    if (cuda) {
      status = raw_h2d->sample();
      if (status.ok()) status = raw_d2h->sample();
      if (!status.ok()) {
        skip(state, "raw copies next to the cycle", status);
        break;
      }
    }
#endif
    const Clock::time_point t0 = Clock::now();
    status = runtime.offload_all(offload);
    const Clock::time_point t1 = Clock::now();
    if (!status.ok()) {
      skip(state, "offload_all", status);
      break;
    }
    // Between the two halves, outside the clock: where everything went, and what it costs.
    absl::StatusOr<Offloaded> offloaded = check_offloaded(runtime, tensors);
    if (!offloaded.ok()) {
      skip(state, "offload_all", offloaded.status());
      break;
    }
    held = *offloaded;
    pinned_reserved = runtime.allocator().stats(Tier::kPinnedHost).reserved_bytes.current;
    if (held.pinned_bytes > 0) {
      worst_reserved_over_held =
          std::max(worst_reserved_over_held,
                   static_cast<double>(pinned_reserved) / static_cast<double>(held.pinned_bytes));
    }
    const Clock::time_point t2 = Clock::now();
    status = runtime.reload_all();
    const Clock::time_point t3 = Clock::now();
    if (status.ok()) status = check_all_on(runtime, tensors, Tier::kGpu);
    if (!status.ok()) {
      skip(state, "reload_all", status);
      break;
    }
    offload_seconds += seconds_between(t0, t1);
    reload_seconds += seconds_between(t2, t3);
    state.SetIterationTime(seconds_between(t0, t1) + seconds_between(t2, t3));
  }
  if (state.error_occurred() || state.iterations() == 0) return;
  const Snapshot after = snapshot(runtime);
  Deltas deltas;
  deltas.add(before, after);
  const alloc::TierStats gpu_after = runtime.allocator().stats(Tier::kGpu);

  for (int i : {0, count - 1}) {
    if (absl::Status s = verify_payload(runtime, tensors[i], i); !s.ok()) {
      return skip(state, "read-back", s);
    }
  }

  const double iterations = static_cast<double>(state.iterations());
  const double seconds = (offload_seconds + reload_seconds) / iterations;
  const double moved = 2 * static_cast<double>(total_bytes);  // out and back
  state.counters["seconds"] = seconds;
  state.counters["offload_seconds"] = offload_seconds / iterations;
  state.counters["reload_seconds"] = reload_seconds / iterations;
  state.counters["first_cycle_seconds"] = seconds_between(w0, w2);
  state.counters["first_offload_seconds"] = seconds_between(w0, w1);
  state.counters["bytes"] = bytes_counter(moved);
  state.counters["gbps"] = gb_per_s(moved, seconds);
  state.counters["offload_gbps"] =
      gb_per_s(static_cast<double>(total_bytes) * iterations, offload_seconds);
  state.counters["reload_gbps"] =
      gb_per_s(static_cast<double>(total_bytes) * iterations, reload_seconds);
#ifdef STRATA_HAS_CUDA
  if (cuda) {
    // bulk moves everything out, then everything back: two sequential phases over the link.
    const double h2d = raw_h2d->h2d_gbps();
    const double d2h = raw_d2h->d2h_gbps();
    const double bytes_each_way = static_cast<double>(total_bytes);
    const double floor_seconds =
        h2d > 0 && d2h > 0 ? bytes_each_way / (h2d * 1e9) + bytes_each_way / (d2h * 1e9) : 0;
    state.counters["raw_h2d_gbps"] = h2d;
    state.counters["raw_d2h_gbps"] = d2h;
    state.counters["floor_seconds"] = floor_seconds;
    state.counters["ratio_to_floor"] = floor_seconds > 0 ? seconds / floor_seconds : 0;
    // The GPU tier's own driver calls (mapping and unmapping, or cudaMalloc and cudaFree) per
    // cycle: what giving the memory back adds beside the link.
    const double alloc_seconds =
        static_cast<double>(gpu_after.upstream_alloc_ns - gpu_before.upstream_alloc_ns) / 1e9 /
        iterations;
    state.counters["gpu_upstream_alloc_seconds"] = alloc_seconds;
    state.counters["gpu_upstream_free_seconds"] =
        static_cast<double>(gpu_after.upstream_free_ns - gpu_before.upstream_free_ns) / 1e9 /
        iterations;
    state.counters["ratio_to_floor_plus_alloc"] =
        floor_seconds > 0 ? seconds / (floor_seconds + alloc_seconds) : 0;
  }
#endif
  // Must be 0: no pinning (cudaHostAlloc / cudaHostRegister) after the first cycle.
  state.counters["pinned_host_allocs_after_first"] =
      static_cast<double>(deltas.pinned_segment_allocs);
  state.counters["gpu_segment_allocs_after_first"] = static_cast<double>(deltas.gpu_segment_allocs);
  // Worst over the timed cycles, right after offload_all; target <= 1.02.
  state.counters["pinned_reserved_over_held"] = worst_reserved_over_held;
  state.counters["pinned_reserved_bytes"] = bytes_counter(static_cast<double>(pinned_reserved));
  state.counters["pinned_held_bytes"] = bytes_counter(static_cast<double>(held.pinned_bytes));
  state.counters["pageable_tensors"] = static_cast<double>(held.pageable_tensors);
  state.counters["host_syncs"] = static_cast<double>(deltas.host_syncs) / iterations;
  state.counters["failed_migrations"] = static_cast<double>(deltas.failed_migrations);
  report_engine(state, deltas);
  state.SetLabel(
      cuda
          ? str_cat("offload_all+reload_all, policy bulk, roles all, ",
                    keep_cached ? "GPU memory kept cached, " : "GPU memory back to the driver, ",
                    count, " x ", tensor_bytes, " B, pinned tier over ",
                    runtime.allocator().upstream(Tier::kPinnedHost).name(),
                    ", floor from raw pinned 16 x 256 MiB each way alone before each cycle")
          : str_cat("simulated device: host memcpy, not PCIe; ", count, " x ", tensor_bytes, " B"));
}

}  // namespace

void BM_OffloadReload(benchmark::State& state, std::size_t total_bytes, int count,
                      bool keep_cached) {
  run_offload_reload(state, total_bytes, count, rt::DeviceKind::kCuda, keep_cached);
}

void BM_SimulatedOffloadReload(benchmark::State& state, std::size_t total_bytes, int count) {
  run_offload_reload(state, total_bytes, count, rt::DeviceKind::kSimulated, false);
}

}  // namespace strata::bench
