// allocator/tiered_allocator.h: the three-tier allocator that the rest of strata stands on.
//
// One BlockPool per tier (GPU, pinned host, pageable host), each over its own upstream, with a
// budget, stats, a fragmentation figure and, in tracking mode, a leak report of live allocations
// with owner tags. The GPU tier is real CUDA memory when a GPU is present and a simulated device
// (host memory with a capacity) otherwise, or when asked for.
//
// Example:
//   AllocatorOptions options;
//   options.budgets[tier_index(Tier::kGpu)] = 8 * kGiB;
//   options.track_allocations = true;
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<TieredAllocator> allocator,
//                           TieredAllocator::create(std::move(options)));
//   STRATA_ASSIGN_OR_RETURN(void* states, allocator->allocate(Tier::kPinnedHost, 64 * kMiB,
//                                                             {.owner = "layer3.exp_avg"}));
//   ...
//   STRATA_RETURN_IF_ERROR(allocator->deallocate(Tier::kPinnedHost, states));
//   std::printf("%s", allocator->format_leak_report().c_str());   // "no live allocations"
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/block_pool.h"
#include "allocator/stats.h"
#include "allocator/stream_ops.h"
#include "allocator/tier.h"
#include "allocator/upstream.h"

namespace strata::alloc {

enum class DeviceBackend {
  kAuto,       // CUDA when a GPU is visible, the simulated device otherwise
  kCuda,       // CUDA; kUnavailable when there is no GPU
  kSimulated,  // host memory standing in for the GPU, also on a machine that has one
};

std::string_view device_backend_name(DeviceBackend backend);

// Note [Host budgets]
// ~~~~~~~~~~~~~~~~~~~
// Host memory that runs out does not fail an allocation, it brings the kernel's out-of-memory
// killer (or, pinned, stalls the machine), so the host tiers have budgets by default, read from
// /proc/meminfo when the allocator is made: pinned host memory at most half of the machine's memory
// and no more than is available then; pageable memory no more than is available then. A request
// above one is an out-of-memory error naming the default and how to set another. Where the
// machine's memory cannot be read, or a tier has an upstream of the caller's, there is no default
// budget.
inline constexpr std::size_t kMachineBudget = kNoBudget - 1;

// How the GPU tier lays out large blocks (See Note [Expandable segments] in block_pool_expand.cpp):
// in ranges that grow and shrink by mapping memory (kExpandable), or in segments of fixed size,
// one upstream allocation each (kFixed). kAuto: expandable where the upstream can map (the CUDA
// virtual-memory upstream and the simulated device), unless the environment variable
// STRATA_GPU_SEGMENTS=fixed|expandable says otherwise. An upstream that cannot map (cudaMalloc)
// always gives fixed segments.
enum class GpuSegments { kAuto, kExpandable, kFixed };
std::string_view gpu_segments_name(GpuSegments segments);
// "auto", "expandable" or "fixed" (strata-train's --strata_gpu_segments, STRATA_GPU_SEGMENTS).
absl::StatusOr<GpuSegments> parse_gpu_segments(std::string_view name);

struct AllocatorOptions {
  DeviceBackend device = DeviceBackend::kAuto;
  // The CUDA device the GPU tier's memory and events are on (the runtime sets the one it runs on).
  int cuda_device = 0;
  // Used when the GPU tier is simulated.
  SimulatedDeviceOptions simulated_device = {};
  // See Note [Pinned upstream] in pinned_upstream.cpp: mmap + cudaHostRegister pins and unpins
  // faster than cudaHostAlloc, with the same copy bandwidth; bench/results has the run.
  PinnedMethod pinned_method = PinnedMethod::kMmapRegister;
  // How the GPU tier gets its segments (See Note [Device memory method] in
  // cuda_device_upstream.cpp): by default virtual memory where supported, so a phase switch's frees
  // overlap its copies.
  DeviceMethod device_method = DeviceMethod::kAuto;
  GpuSegments gpu_segments = GpuSegments::kAuto;
  // Cap on each tier's reserved bytes: kNoBudget for none, kMachineBudget (the host tiers'
  // default) for one derived from the machine's memory (See Note [Host budgets]).
  std::array<std::size_t, kNumTiers> budgets = {kNoBudget, kMachineBudget, kMachineBudget};
  // Bytes reserved in each tier at creation (one segment each), e.g. to pin host memory once up
  // front. Must not exceed the tier's budget.
  std::array<std::size_t, kNumTiers> initial_reservation = {0, 0, 0};
  // Keep owner tags for the leak report.
  bool track_allocations = false;
  // Test seams: replace a tier's upstream, or the stream events.
  std::array<std::unique_ptr<Upstream>, kNumTiers> upstreams;
  std::shared_ptr<StreamOps> stream_ops;
};

class TieredAllocator {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TieredAllocator>> create(
      AllocatorOptions options = {});

  [[nodiscard]] absl::StatusOr<void*> allocate(Tier tier, std::size_t bytes,
                                               const AllocOptions& options = {});
  // Frees a block of `tier`. A pointer live in another tier is kInvalidArgument naming both tiers.
  [[nodiscard]] absl::Status deallocate(Tier tier, void* ptr);
  [[nodiscard]] absl::Status record_stream(Tier tier, void* ptr, StreamHandle stream);
  // See BlockPool::mark_last_use (Note [Last use] in block_pool.h).
  [[nodiscard]] absl::Status mark_last_use(Tier tier, void* ptr, StreamHandle stream);
  [[nodiscard]] absl::Status synchronize_pending();
  // Returns entirely free segments of a tier (or all tiers) to their upstreams; returns bytes
  // freed.
  [[nodiscard]] absl::StatusOr<std::size_t> trim(Tier tier);
  [[nodiscard]] absl::StatusOr<std::size_t> trim_all();
  [[nodiscard]] absl::Status set_budget(Tier tier, std::size_t budget);
  // A tier's Budget, for pools outside the allocator that must stay within it too (the runtime's
  // staging ring draws on the GPU's): its reserved() and peak() count them all.
  const std::shared_ptr<Budget>& budget(Tier tier) const {
    return pools_[tier_index(tier)]->budget_account();
  }

  TierStats stats(Tier tier) const;
  void reset_peak_stats();
  // Every live allocation of every tier, tier by tier in allocation order.
  std::vector<LiveAllocation> leak_report() const;
  // "no live allocations", or one line per live block with tier, address, size and owner.
  std::string format_leak_report() const;
  // A table: one row per statistic, one column per tier.
  std::string format_stats() const;
  // {"gpu": {...}, "pinned_host": {...}, "pageable_host": {...}}
  std::string stats_json() const;

  bool gpu_is_simulated() const { return gpu_simulated_; }
  bool track_allocations() const { return track_allocations_; }
  const Upstream& upstream(Tier tier) const { return pools_[tier_index(tier)]->upstream(); }
  BlockPool& pool(Tier tier) { return *pools_[tier_index(tier)]; }
  const std::shared_ptr<StreamOps>& stream_ops() const { return stream_ops_; }

 private:
  TieredAllocator() = default;
  std::array<std::unique_ptr<BlockPool>, kNumTiers> pools_;
  std::shared_ptr<StreamOps> stream_ops_;
  bool gpu_simulated_ = true;
  bool track_allocations_ = false;
};

}  // namespace strata::alloc
