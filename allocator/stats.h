// allocator/stats.h: the per-tier statistics, declared once.
//
// STRATA_TIER_STATS lists every statistic with its kind; the struct, the printer and the JSON
// writer are all generated from it, so a new statistic is one line here. Names follow PyTorch's
// caching allocator where the meaning matches.
//   kGauge:   a level with its peak (current / peak)
//   kCounter: a monotone count of events
//   kDerived: computed from the free lists when stats are read
//
// Example:
//   TierStats s = allocator.stats(Tier::kGpu);
//   std::printf("%lld bytes allocated, peak %lld, fragmentation %.3f\n",
//               (long long)s.allocated_bytes.current, (long long)s.allocated_bytes.peak,
//               s.fragmentation);
//   s.for_each([](std::string_view name, StatKind kind, std::int64_t current, std::int64_t peak)
//   {});
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

namespace strata::alloc {

// X(name, kind, what it counts)
#define STRATA_TIER_STATS(X)                                                                       \
  X(allocated_bytes, kGauge, "bytes in blocks handed out (sizes after rounding)")                  \
  X(requested_bytes, kGauge, "bytes callers asked for")                                            \
  X(reserved_bytes, kGauge, "bytes held from the upstream in segments")                            \
  X(active_blocks, kGauge, "blocks handed out and not yet freed")                                  \
  X(segments, kGauge, "segments held from the upstream (an expandable one counts once)")           \
  X(pending_free_bytes, kGauge, "freed bytes waiting for stream events before reuse")              \
  X(withheld_bytes, kGauge, "freed bytes whose streams could not be waited for yet (withheld)")    \
  X(num_allocs, kCounter, "successful allocate calls")                                             \
  X(num_frees, kCounter, "successful deallocate calls")                                            \
  X(num_segment_allocs, kCounter, "upstream allocate calls that succeeded (cudaMalloc, ...)")      \
  X(num_segment_frees, kCounter, "segments returned to the upstream")                              \
  X(upstream_alloc_ns, kCounter, "nanoseconds spent in upstream allocate calls (cudaMalloc, ...)") \
  X(upstream_free_ns, kCounter, "nanoseconds spent in upstream deallocate calls (cudaFree, ...)")  \
  X(num_maps, kCounter, "memory mapped into expandable segments (map_range calls)")                \
  X(num_unmaps, kCounter, "memory unmapped from expandable segments (unmap_range calls)")          \
  X(num_alloc_retries, kCounter, "allocations that freed cached segments or waited, then retried") \
  X(num_ooms, kCounter, "allocations that ended in out of memory")                                 \
  X(num_event_waits, kCounter, "host waits on stream events to reclaim blocks")                    \
  X(num_withheld_blocks, kCounter, "freed blocks withheld from reuse until an event can be had")   \
  X(inactive_split_bytes, kDerived, "free bytes in segments that also hold live blocks")           \
  X(free_bytes, kDerived, "free bytes in all segments")                                            \
  X(largest_free_block, kDerived, "largest free block")

enum class StatKind { kGauge, kCounter, kDerived };

struct Gauge {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  void add(std::int64_t delta) {
    current += delta;
    peak = std::max(peak, current);
  }
  void reset_peak() { peak = current; }
};

namespace stats_detail {
template <StatKind K>
struct StatType {
  using type = std::int64_t;
};
template <>
struct StatType<StatKind::kGauge> {
  using type = Gauge;
};
}  // namespace stats_detail

struct TierStats {
#define STRATA_DECLARE_STAT_(name, kind, help) \
  typename stats_detail::StatType<StatKind::kind>::type name{};
  STRATA_TIER_STATS(STRATA_DECLARE_STAT_)
#undef STRATA_DECLARE_STAT_

  // 1 - largest free block / total free bytes; 0 when nothing is free. The share of free memory
  // that a single allocation could not use.
  double fragmentation = 0.0;

  // Calls fn(name, kind, current, peak) for every statistic in declaration order; counters and
  // derived values pass peak == current.
  template <typename Fn>
  void for_each(Fn&& fn) const {
#define STRATA_VISIT_STAT_(name, kind, help) visit_(fn, #name, StatKind::kind, name);
    STRATA_TIER_STATS(STRATA_VISIT_STAT_)
#undef STRATA_VISIT_STAT_
  }

 private:
  template <typename Fn>
  static void visit_(Fn& fn, std::string_view name, StatKind kind, const Gauge& g) {
    fn(name, kind, g.current, g.peak);
  }
  template <typename Fn>
  static void visit_(Fn& fn, std::string_view name, StatKind kind, std::int64_t v) {
    fn(name, kind, v, v);
  }
};

// What each statistic counts, by name (from STRATA_TIER_STATS); "" for an unknown name.
std::string_view stat_help(std::string_view name);

// One JSON object: {"allocated_bytes": {"current": 0, "peak": 0}, ..., "fragmentation": 0.0}.
std::string stats_to_json(const TierStats& stats);

}  // namespace strata::alloc
