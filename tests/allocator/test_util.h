// tests/allocator/test_util.h: small helpers shared by the allocator suites.
#pragma once

#include <memory>
#include <random>
#include <string>

#include "allocator/block_pool.h"
#include "allocator/stream_ops.h"
#include "allocator/tiered_allocator.h"
#include "allocator/upstream.h"
#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"

namespace strata::alloc::testing {

inline std::unique_ptr<Upstream> address_only_device(std::size_t capacity = std::size_t{64} << 30) {
  return make_simulated_device_upstream(
      {.capacity = capacity, .backing = SimulatedBacking::kAddressOnly});
}

inline TierStats stats_of(const BlockPool& pool) { return pool.stats(); }

// A fresh seed per run unless STRATA_TEST_SEED is set; the suites print the seed they use.
inline std::uint64_t test_seed(std::uint64_t fixed) {
  if (const char* env = std::getenv("STRATA_TEST_SEED")) return std::stoull(env);
  return fixed;
}

inline std::uint64_t fresh_seed() {
  if (const char* env = std::getenv("STRATA_TEST_SEED")) return std::stoull(env);
  return std::random_device{}();
}

// Two stats are equal in everything a failed call must not change.
inline bool same_levels(const TierStats& a, const TierStats& b) {
  return a.allocated_bytes.current == b.allocated_bytes.current &&
         a.requested_bytes.current == b.requested_bytes.current &&
         a.reserved_bytes.current == b.reserved_bytes.current &&
         a.active_blocks.current == b.active_blocks.current &&
         a.segments.current == b.segments.current && a.free_bytes == b.free_bytes &&
         a.largest_free_block == b.largest_free_block;
}

}  // namespace strata::alloc::testing
