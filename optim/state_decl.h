// optim/state_decl.h: the states an optimizer declares for a parameter, from which they are
// registered with the runtime (role optimizer_state, See Note [Roles] in runtime/tensor.h) and
// named in checkpoints and state dicts.
//
// Note [Declared states]
// ~~~~~~~~~~~~~~~~~~~~~~
// An optimizer says, per parameter, which states it keeps: a name (TensorSpec::state and the key
// of torch's state dict: "exp_avg"), the suffix its tensor's name takes after the parameter's
// ("layer3.w.exp_avg"; kept as checkpoints already name them), a dtype, and whether it starts as
// zeros or as the parameter's values (a master copy). The runtime registers each one as a tensor of
// role optimizer_state in the parameter's layer; it never learns more. Policies see only the role,
// so what they do holds for any optimizer's states; the bytes a parameter's states take
// (state_bytes) are what a policy weighs when it streams them or steps the layer on the host.
//
// Example:
//   for (const StateDecl& d : adam_rule()->states(hyper, rt::DType::kBFloat16,
//                                                 rt::StepPlace::kGpu, StateType::kF32)) ...;
//   // exp_avg, exp_avg_sq (float32 zeros), master_param (float32, from the parameter)
//   STRATA_ASSIGN_OR_RETURN(StateType t, parse_state_dtype("int8"));
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "optim/state_codec.h"
#include "runtime/tensor.h"

namespace strata::optim {

struct StateDecl {
  std::string name;    // "exp_avg"
  std::string suffix;  // "exp_avg": the tensor is "<parameter's name>.<suffix>"
  rt::DType dtype = rt::DType::kFloat32;
  // Starts as the parameter's values converted to `dtype` (a master copy); else zeros.
  bool from_parameter = false;
  // Stored as int8 codes and a float32 scale per block (See Note [Compressed moments] in
  // state_codec.h): a 1-d uint8 tensor of int8_state_bytes(numel) bytes, not the parameter's shape.
  bool int8_blocks = false;

  bool operator==(const StateDecl&) const = default;
};

// Bytes a state of a parameter of `numel` elements takes, and all of a parameter's together.
std::int64_t state_bytes(const StateDecl& state, std::int64_t numel);
std::int64_t state_bytes(const std::vector<StateDecl>& states, std::int64_t numel);

// How moments are stored, by the name users give (state_dtype): "float32", "bfloat16" or "int8";
// kInvalidArgument naming the choices for any other.
absl::StatusOr<StateType> parse_state_dtype(std::string_view name);
std::string_view state_dtype_name(StateType type);

}  // namespace strata::optim
