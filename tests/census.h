// tests/census.h: the bad-input census of RELIABILITY.md. Each check names itself once, however
// many times it runs (a check that applies to three tiers is one), and expects the whole message.
// The census binary (tests/reliability) links every suite's checks and prints how many distinct
// ones it tried.
//
// Example:
//   expect_refused("allocate size 0", allocator.allocate(tier, 0).status(),
//                  absl::StatusCode::kInvalidArgument, "allocate in tier gpu: size 0; ...");
#pragma once

#include <set>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace strata::testing {

// Every distinct check tried so far, by name.
inline std::set<std::string>& census_checks() {
  static std::set<std::string> checks;
  return checks;
}

// Expects exactly `code` and exactly `message`, and counts the check `name`.
inline void expect_refused(const std::string& name, const absl::Status& status,
                           absl::StatusCode code, const std::string& message) {
  census_checks().insert(name);
  EXPECT_EQ(status.code(), code) << name << ": " << status;
  EXPECT_EQ(std::string(status.message()), message) << name;
}

}  // namespace strata::testing
