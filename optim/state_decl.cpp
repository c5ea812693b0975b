#include "optim/state_decl.h"

#include "base/strings.h"

namespace strata::optim {

std::int64_t state_bytes(const StateDecl& state, std::int64_t numel) {
  if (state.int8_blocks) return int8_state_bytes(numel);
  return numel * static_cast<std::int64_t>(rt::dtype_size(state.dtype));
}

std::int64_t state_bytes(const std::vector<StateDecl>& states, std::int64_t numel) {
  std::int64_t bytes = 0;
  for (const StateDecl& d : states) bytes += state_bytes(d, numel);
  return bytes;
}

absl::StatusOr<StateType> parse_state_dtype(std::string_view name) {
  if (name == "float32") return StateType::kF32;
  if (name == "bfloat16") return StateType::kBF16;
  if (name == "int8") return StateType::kI8;
  return absl::InvalidArgumentError(str_cat("state_dtype '", name,
                                            "' is not one strata stores moments in; use float32, "
                                            "bfloat16 or int8"));
}

std::string_view state_dtype_name(StateType type) {
  switch (type) {
    case StateType::kBF16:
      return "bfloat16";
    case StateType::kI8:
      return "int8";
    default:
      return "float32";
  }
}

}  // namespace strata::optim
