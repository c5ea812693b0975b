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
//   for (const StateDecl& d : adam_states(hyper, rt::DType::kBFloat16)) ...;
//   // exp_avg, exp_avg_sq (float32 zeros), master_param (float32, from the parameter)
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "runtime/tensor.h"

namespace strata::optim {

struct StateDecl {
  std::string name;    // "exp_avg"
  std::string suffix;  // "exp_avg": the tensor is "<parameter's name>.<suffix>"
  rt::DType dtype = rt::DType::kFloat32;
  // Starts as the parameter's values converted to `dtype` (a master copy); else zeros.
  bool from_parameter = false;
};

// Bytes a parameter's declared states take together, per element of the parameter.
std::size_t state_bytes(const std::vector<StateDecl>& states);

}  // namespace strata::optim
