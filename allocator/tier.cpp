#include "allocator/tier.h"

#include "base/strings.h"

namespace strata::alloc {

std::string_view tier_name(Tier tier) {
  switch (tier) {
    case Tier::kGpu:
      return "gpu";
    case Tier::kPinnedHost:
      return "pinned_host";
    case Tier::kPageableHost:
      return "pageable_host";
  }
  return "unknown_tier";
}

absl::StatusOr<Tier> parse_tier(std::string_view name) {
  for (Tier tier : kAllTiers) {
    if (name == tier_name(tier)) return tier;
  }
  return absl::InvalidArgumentError(
      str_cat("unknown tier '", name, "'; valid tiers: gpu, pinned_host, pageable_host"));
}

}  // namespace strata::alloc
