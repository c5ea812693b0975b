#include "runtime/policy.h"

#include <cstdlib>

#include "base/strings.h"
#include "runtime/runtime.h"

namespace strata::rt {

std::string_view step_place_name(StepPlace place) {
  return place == StepPlace::kHost ? "host" : "gpu";
}

std::vector<int> ResidencyPolicy::optimizer_layer_order(const PolicyContext& rt) const {
  return rt.layers();
}

absl::Status PolicyRegistry::add(std::string name, PolicyFactory factory) {
  if (name.empty()) return absl::InvalidArgumentError("a policy needs a name");
  if (!factories_.emplace(name, std::move(factory)).second) {
    return absl::AlreadyExistsError(str_cat("policy '", name, "' is registered already"));
  }
  return absl::OkStatus();
}

std::vector<std::string> PolicyRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& [name, factory] : factories_) out.push_back(name);
  return out;
}

absl::StatusOr<std::unique_ptr<ResidencyPolicy>> PolicyRegistry::create(
    std::string_view name, const PolicyConfig& config) const {
  auto it = factories_.find(name);
  if (it == factories_.end()) {
    std::string valid;
    for (const auto& [n, f] : factories_) str_append(&valid, valid.empty() ? "" : ", ", n);
    return absl::InvalidArgumentError(
        str_cat(name.empty() ? "empty policy name" : str_cat("unknown policy '", name, "'"),
                "; valid policies: ", valid));
  }
  return it->second(config);
}

absl::StatusOr<Overlap> parse_overlap(std::string_view name) {
  if (name == "none") return Overlap::kNone;
  if (name == "backward") return Overlap::kBackward;
  return absl::InvalidArgumentError(
      str_cat("unknown overlap '", name,
              "'; use none (the optimizer steps after backward) or "
              "backward (each layer steps as soon as its backward is done)"));
}

std::string_view overlap_name(Overlap overlap) {
  return overlap == Overlap::kBackward ? "backward" : "none";
}

PolicyChoice choose_policy_name(const std::optional<std::string>& given,
                                std::string_view given_source) {
  if (given.has_value()) return {*given, std::string(given_source)};
  if (const char* env = std::getenv("STRATA_POLICY")) return {env, "STRATA_POLICY"};
  return {std::string(kDefaultPolicy), "default"};
}

}  // namespace strata::rt
