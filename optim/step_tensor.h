// optim/step_tensor.h: one parameter as a step rule's kernels see it (See Note [Step rules] in
// step_rule.h). Plain C++ (no Abseil) so .cu files can include it.
//
// Example:
//   StepTensor t;
//   t.param = p; t.grad = g; t.states[0] = m; t.numel = n;   // Lion: its momentum
//   lion_step_cpu(&t, 1, lion_scalars(hyper), 1.0f, &pool);
#pragma once

#include <array>
#include <cstdint>

#include "optim/adam_math.h"
#include "optim/kept_states.h"
#include "optim/state_codec.h"

namespace strata::optim {

inline constexpr int kMaxStates = 4;
static_assert(kMaxKeptStates == kMaxStates);

// One parameter as a rule's kernel sees it for one step.
struct StepTensor {
  void* param = nullptr;       // of param_type
  const void* grad = nullptr;  // of grad_type
  // The declared states in declaration order (null past the last); the master copy among them.
  std::array<void*, kMaxStates> states = {};
  // The float32 master copy the step updates and the parameter is rounded from (See Note [Mixed
  // precision] in adam_math.h); null when the parameter is stepped in place.
  float* master = nullptr;
  std::int64_t numel = 0;
  ElemType param_type = ElemType::kF32;
  ElemType grad_type = ElemType::kF32;
  StateType state_type = StateType::kF32;
  // The key of compressed states' stochastic rounding (state_seed of the parameter's name).
  std::uint32_t seed = 0;
  // The parameter's own step count, this step included, and the device's count of the steps
  // found_inf skipped (See Note [Skipped steps] in adam_kernels.h); null where none can be.
  std::int64_t step = 1;
  std::int64_t* skipped = nullptr;
  // The host kernel only: the host_scalars() the device computed for this tensor's step.
  const float* device_scalars = nullptr;
  // The host kernel only: states it keeps before overwriting them (See Note [Undo in the host
  // kernel] in kept_states.h); null keeps none.
  const KeptStates* keep = nullptr;
};

}  // namespace strata::optim
