// optim/step_rule.h: the optimizer interface. A StepRule is what makes one optimizer differ from
// another: the states it keeps for a parameter, the hyperparameters it accepts, and two kernels
// that step a list of one layer's tensors, one on the GPU and one on the host. The layer-by-layer
// machinery (optim/adam.h: states registered with the runtime, streamed or placed by the policy,
// the step taken in backward and validated, host-stepped layers, checkpoints) is the rule's
// client and the same for every rule. Adam / AdamW (adam_rule.cpp) and Lion (lion_rule.cpp) are
// the rules strata has.
//
// Note [Step rules]
// ~~~~~~~~~~~~~~~~~
// A rule sees a parameter only as a StepTensor: the parameter and its gradient where the kernel
// reads them, each declared state in the order states() declared it, and the float32 master copy
// of a parameter stepped through one. A rule's update must be elementwise (each element's new
// values depend on its own old values and the step's scalars only) and exact across its two
// kernels: the host kernel gives the GPU kernel's bits, so a layer may step on either side and the
// step is the same (See Note [No contraction] in adam_math.h). Those two properties are what the
// speculative step in backward and the hybrid policy build on; a rule that cannot keep them is not
// one strata can place. The hyperparameters are the group's AdamHyper: the fields torch's
// optimizers share (lr, betas, eps, weight_decay and the flags); a rule reads those it takes and
// refuses, in check(), a setting it has no meaning for.
//
// Example:
//   STRATA_ASSIGN_OR_RETURN(std::shared_ptr<const StepRule> rule, make_step_rule("lion"));
//   AdamOptions options;
//   options.rule = rule;
//   for (const StateDecl& d : rule->states(hyper, rt::DType::kFloat32, rt::StepPlace::kGpu,
//                                          StateType::kF32)) ...;   // exp_avg
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/thread_pool.h"
#include "optim/adam_math.h"
#include "optim/state_codec.h"
#include "optim/state_decl.h"
#include "optim/step_tensor.h"
#include "runtime/policy.h"
#include "runtime/tensor.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::optim {

class StepRule {
 public:
  virtual ~StepRule() = default;
  // "adam", "lion": the name make_step_rule takes, and messages' and the log's.
  virtual std::string_view name() const = 0;
  // The states a parameter of `param_dtype` keeps under `hyper`, stepped at `place`, its moments
  // stored as `moments` says (See Note [Declared states] in state_decl.h). At most kMaxStates.
  virtual std::vector<StateDecl> states(const AdamHyper& hyper, rt::DType param_dtype,
                                        rt::StepPlace place, StateType moments) const = 0;
  // kInvalidArgument, naming group `group` and the fix, for hyperparameters or a moments' storage
  // the rule does not take.
  virtual absl::Status check(const AdamHyper& hyper, StateType moments,
                             std::size_t group) const = 0;
  // Steps `count` tensors of one group on the host, split over `pool` (nullptr: this thread),
  // gradients multiplied by `inv_grad_scale`. Deterministic whatever the split.
  virtual void step_host(const StepTensor* tensors, std::size_t count, const AdamHyper& hyper,
                         float inv_grad_scale, ThreadPool* pool) const = 0;
  // A step that found_inf skipped, on the host: each tensor's skipped count goes up by 1.
  void count_skipped_host(const StepTensor* tensors, std::size_t count) const;

  // Note [Scalars from the device]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A rule whose update takes a scalar that the host and the GPU compute differently (Adam's bias
  // corrections take powf: See Note [Bias corrections from the device] in adam_kernels.h) has the
  // device compute it for the host kernel: host_scalars() floats per (group, settled step t),
  // which the host kernel reads at StepTensor::device_scalars. 0: the host needs none.
  virtual int host_scalars() const { return 0; }
  // The same values on the host, for the simulated device (whose kernel is the host's).
  virtual void host_scalars_cpu(const AdamHyper& hyper, std::int64_t t, float* out) const;
#ifdef STRATA_HAS_CUDA
  // Queues a step of `count` tensors of one group on `stream`; grad_scale and found_inf are device
  // pointers or null (found_inf != 0: nothing is updated, each skipped count goes up by 1).
  virtual cudaError_t step_gpu(const StepTensor* tensors, std::size_t count, const AdamHyper& hyper,
                               const float* grad_scale, const float* found_inf,
                               cudaStream_t stream) const = 0;
  // Queues on `stream` the host_scalars() of each (hyper, t) into `out` (device-accessible
  // memory), host_scalars() floats each, in order.
  virtual cudaError_t queue_host_scalars(const std::vector<const AdamHyper*>& hypers,
                                         const std::vector<std::int64_t>& steps, float* out,
                                         cudaStream_t stream) const;
#endif
};

// What the rules share. The hyperparameter checks torch's optimizers make: lr and weight_decay
// finite and >= 0, betas in [0, 1) (NaN fails every comparison, so it is refused too); the error
// names `optimizer`, `group` and the fix.
absl::Status check_lr_betas_decay(std::string_view optimizer, const AdamHyper& h,
                                  std::size_t group);
// Declares the float32 master copy, from the parameter, that a bfloat16 or float16 parameter (See
// Note [Mixed precision] in adam_math.h) or a host-stepped one (See Note [Host-stepped layers] in
// adam_host_step.cpp) is stepped through.
void declare_master(rt::DType param_dtype, rt::StepPlace place, std::vector<StateDecl>& out);

// The rules strata has: Adam / AdamW (hyper.decoupled chooses) and Lion.
std::shared_ptr<const StepRule> adam_rule();
std::shared_ptr<const StepRule> lion_rule();
// By name: "adam" (also "adamw") or "lion"; kInvalidArgument naming the choices otherwise.
absl::StatusOr<std::shared_ptr<const StepRule>> make_step_rule(std::string_view name);

}  // namespace strata::optim
