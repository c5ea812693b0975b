#include "allocator/stats.h"

#include <cstdio>

#include "base/strings.h"

namespace strata::alloc {

std::string_view stat_help(std::string_view name) {
#define STRATA_HELP_(stat, kind, help) \
  if (name == #stat) return help;
  STRATA_TIER_STATS(STRATA_HELP_)
#undef STRATA_HELP_
  return "";
}

std::string stats_to_json(const TierStats& stats) {
  std::string out = "{";
  stats.for_each(
      [&](std::string_view name, StatKind kind, std::int64_t current, std::int64_t peak) {
        if (kind == StatKind::kGauge) {
          str_append(&out, "\"", name, "\": {\"current\": ", current, ", \"peak\": ", peak, "}, ");
        } else {
          str_append(&out, "\"", name, "\": ", current, ", ");
        }
      });
  char frag[32];
  std::snprintf(frag, sizeof(frag), "%.6f", stats.fragmentation);
  str_append(&out, "\"fragmentation\": ", frag, "}");
  return out;
}

}  // namespace strata::alloc
