// allocator/tier.h: the three memory tiers strata manages.
//
// Example:
//   for (strata::alloc::Tier tier : strata::alloc::kAllTiers) {
//     std::printf("%s\n", std::string(strata::alloc::tier_name(tier)).c_str());
//   }
//   absl::StatusOr<Tier> t = strata::alloc::parse_tier("pinned_host");
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace strata::alloc {

enum class Tier : std::uint8_t { kGpu = 0, kPinnedHost = 1, kPageableHost = 2 };

inline constexpr int kNumTiers = 3;
inline constexpr std::array<Tier, kNumTiers> kAllTiers = {Tier::kGpu, Tier::kPinnedHost,
                                                          Tier::kPageableHost};

constexpr int tier_index(Tier tier) { return static_cast<int>(tier); }

// "gpu", "pinned_host", "pageable_host": the names used in messages, stats and flags.
std::string_view tier_name(Tier tier);

absl::StatusOr<Tier> parse_tier(std::string_view name);

// The smallest alignment every block of a tier has: 256 B on the GPU (what cudaMalloc promises and
// vectorized kernels need), 64 B (a cache line) on the host.
constexpr std::size_t tier_min_alignment(Tier tier) { return tier == Tier::kGpu ? 256 : 64; }

}  // namespace strata::alloc
