#include "runtime/tensor.h"

#include "base/strings.h"
#include "base/units.h"

namespace strata::rt {

std::string_view role_name(Role role) {
  switch (role) {
    case Role::kParameter:
      return "parameter";
    case Role::kGradient:
      return "gradient";
    case Role::kOptimizerState:
      return "optimizer_state";
    case Role::kOther:
      return "other";
  }
  return "unknown";
}

absl::StatusOr<Role> parse_role(std::string_view name) {
  for (int i = 0; i < kNumRoles; ++i) {
    if (name == role_name(static_cast<Role>(i))) return static_cast<Role>(i);
  }
  return absl::InvalidArgumentError(
      str_cat("unknown role '", name,
              "'; valid roles: parameter, gradient, optimizer_state, other (an optimizer's "
              "states move together as optimizer_state; See Note [Roles] in runtime/tensor.h)"));
}

std::string RoleSet::to_string() const {
  std::string out;
  for (int i = 0; i < kNumRoles; ++i) {
    if (contains(static_cast<Role>(i))) {
      if (!out.empty()) out += ",";
      out += role_name(static_cast<Role>(i));
    }
  }
  return out.empty() ? "none" : out;
}

absl::StatusOr<RoleSet> RoleSet::parse(std::string_view text) {
  if (text == "all") return RoleSet::all();
  if (text == "optimizer_states") return RoleSet::optimizer_states();
  RoleSet out;
  while (!text.empty()) {
    const std::size_t comma = text.find(',');
    const std::string_view item = text.substr(0, comma);
    absl::StatusOr<Role> role = parse_role(item);
    if (!role.ok()) return role.status();
    out.bits_ |= bit(*role);
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  if (out.empty()) return absl::InvalidArgumentError("empty role set");
  return out;
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kUInt8:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat64:
      return "float64";
    case DType::kInt64:
      return "int64";
    case DType::kInt32:
      return "int32";
    case DType::kUInt8:
      return "uint8";
  }
  return "unknown";
}

absl::StatusOr<std::size_t> spec_bytes(const TensorSpec& spec) {
  std::size_t numel = 1;
  for (std::int64_t d : spec.shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          str_cat("tensor '", spec.name, "': negative dimension ", d, " in its shape"));
    }
    std::optional<std::size_t> n = checked_mul(numel, static_cast<std::size_t>(d));
    if (!n) return absl::InvalidArgumentError(str_cat("tensor '", spec.name, "': numel overflows"));
    numel = *n;
  }
  std::optional<std::size_t> bytes = checked_mul(numel, dtype_size(spec.dtype));
  if (!bytes)
    return absl::InvalidArgumentError(str_cat("tensor '", spec.name, "': size overflows"));
  return *bytes;
}

}  // namespace strata::rt
