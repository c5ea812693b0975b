// Lion as a step rule (See Note [Step rules] in step_rule.h; the update is lion_math.h's): one
// float32 state, exp_avg, and a float32 master copy where Adam keeps one.
#include <cmath>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "base/strings.h"
#include "optim/lion_kernels.h"
#include "optim/step_rule.h"

namespace strata::optim {
namespace {

class LionRule final : public StepRule {
 public:
  std::string_view name() const override { return "lion"; }

  std::vector<StateDecl> states(const AdamHyper&, rt::DType param_dtype, rt::StepPlace place,
                                StateType) const override {
    std::vector<StateDecl> out = {{.name = "exp_avg", .suffix = "exp_avg"}};
    declare_master(param_dtype, place, out);
    return out;
  }

  // The settings Lion's reference implementations accept (lr and weight_decay finite and >= 0,
  // betas in [0, 1)); eps is not used. What it has no meaning for is refused, not ignored.
  absl::Status check(const AdamHyper& h, StateType moments, std::size_t group) const override {
    STRATA_RETURN_IF_ERROR(check_lr_betas_decay("Lion", h, group));
    if (h.amsgrad || !h.decoupled) {
      return absl::InvalidArgumentError(
          str_cat("Lion: group ", group, ": ", h.amsgrad ? "amsgrad" : "coupled (L2) weight decay",
                  " is Adam's; Lion takes lr, betas, weight_decay (decoupled) and maximize"));
    }
    if (moments != StateType::kF32) {
      return absl::InvalidArgumentError(str_cat("Lion keeps its momentum in float32; state_dtype ",
                                                state_dtype_name(moments),
                                                " is Adam's: use state_dtype float32 with Lion"));
    }
    return absl::OkStatus();
  }

  void step_host(const StepTensor* tensors, std::size_t count, const AdamHyper& hyper,
                 float inv_grad_scale, ThreadPool* pool) const override {
    lion_step_cpu(tensors, count, lion_scalars(hyper), inv_grad_scale, pool);
  }

#ifdef STRATA_HAS_CUDA
  cudaError_t step_gpu(const StepTensor* tensors, std::size_t count, const AdamHyper& hyper,
                       const float* grad_scale, const float* found_inf,
                       cudaStream_t stream) const override {
    return lion_step_cuda(tensors, count, lion_scalars(hyper), grad_scale, found_inf, stream);
  }
#endif
};

}  // namespace

std::shared_ptr<const StepRule> lion_rule() {
  static const std::shared_ptr<const StepRule> rule = std::make_shared<LionRule>();
  return rule;
}

}  // namespace strata::optim
