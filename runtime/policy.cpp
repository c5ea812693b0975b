#include "runtime/policy.h"

#include <cstdlib>

#include "absl/flags/flag.h"
#include "base/strings.h"
#include "runtime/runtime.h"

namespace strata::rt {

bool AbslParseFlag(absl::string_view text, PolicyFlag* flag, std::string* error) {
  flag->name = std::string(text.data(), text.size());
  return true;
}

std::string AbslUnparseFlag(const PolicyFlag& flag) { return flag.name.value_or(""); }

}  // namespace strata::rt

ABSL_FLAG(strata::rt::PolicyFlag, strata_policy, strata::rt::PolicyFlag{},
          "Residency policy of the strata runtime (keep_on_gpu, bulk, layer_prefetch); "
          "RuntimeOptions::policy wins over it, and it over STRATA_POLICY");

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

PolicyChoice choose_policy_name(const std::optional<std::string>& option) {
  if (option.has_value()) return {*option, "RuntimeOptions::policy"};
  const PolicyFlag flag = absl::GetFlag(FLAGS_strata_policy);
  if (flag.name.has_value()) return {*flag.name, "--strata_policy"};
  if (const char* env = std::getenv("STRATA_POLICY")) return {env, "STRATA_POLICY"};
  return {std::string(kDefaultPolicy), "default"};
}

}  // namespace strata::rt
