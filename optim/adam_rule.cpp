// Adam / AdamW as a step rule (See Note [Step rules] in step_rule.h): its states, the
// hyperparameters torch accepts, and its kernels (adam_kernels.h) over the rule's tensors.
#include <cmath>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "base/strings.h"
#include "optim/adam_kernels.h"
#include "optim/step_rule.h"

namespace strata::optim {
namespace {

// The Adam kernels' view of a rule's tensors: exp_avg, exp_avg_sq, then max_exp_avg_sq with
// amsgrad, in the order AdamRule::states declares them.
std::vector<AdamTensor> adam_tensors(const StepTensor* tensors, std::size_t count,
                                     const AdamHyper& hyper) {
  std::vector<AdamTensor> out(count);
  for (std::size_t i = 0; i < count; ++i) {
    const StepTensor& x = tensors[i];
    AdamTensor& t = out[i];
    t.param = x.param;
    t.grad = x.grad;
    t.exp_avg = x.states[0];
    t.exp_avg_sq = x.states[1];
    t.max_exp_avg_sq = hyper.amsgrad ? static_cast<float*>(x.states[2]) : nullptr;
    t.master = x.master;
    t.numel = x.numel;
    t.param_type = x.param_type;
    t.grad_type = x.grad_type;
    t.state_type = x.state_type;
    t.seed = x.seed;
    t.step = x.step;
    t.skipped = x.skipped;
    t.bias = x.device_scalars;
    t.keep = x.keep;
  }
  return out;
}

class AdamRule final : public StepRule {
 public:
  std::string_view name() const override { return "adam"; }

  std::vector<StateDecl> states(const AdamHyper& hyper, rt::DType param_dtype, rt::StepPlace place,
                                StateType moments) const override {
    std::vector<StateDecl> out = {{.name = "exp_avg", .suffix = "exp_avg"},
                                  {.name = "exp_avg_sq", .suffix = "exp_avg_sq"}};
    for (StateDecl& d : out) {  // See Note [Compressed moments] in state_codec.h
      if (moments == StateType::kBF16) d.dtype = rt::DType::kBFloat16;
      if (moments == StateType::kI8) {
        d.dtype = rt::DType::kUInt8;
        d.int8_blocks = true;
      }
    }
    if (hyper.amsgrad) out.push_back({.name = "max_exp_avg_sq", .suffix = "max_exp_avg_sq"});
    declare_master(param_dtype, place, out);
    return out;
  }

  // Hyperparameters torch.optim.AdamW would accept; NaN fails every comparison, so it is refused
  // too.
  absl::Status check(const AdamHyper& h, StateType moments, std::size_t group) const override {
    STRATA_RETURN_IF_ERROR(check_lr_betas_decay("Adam", h, group));
    if (!(h.eps > 0.0f) || std::isinf(h.eps)) {
      return absl::InvalidArgumentError(
          str_cat("Adam: group ", group, ": eps ", h.eps, " is invalid; use a finite eps > 0"));
    }
    if (h.amsgrad && moments != StateType::kF32) {
      return absl::InvalidArgumentError(str_cat(
          "Adam: group ", group, " has amsgrad, which needs float32 moments; state_dtype is ",
          state_dtype_name(moments), ": use state_dtype float32 or turn amsgrad off"));
    }
    return absl::OkStatus();
  }

  void step_host(const StepTensor* tensors, std::size_t count, const AdamHyper& hyper,
                 float inv_grad_scale, ThreadPool* pool) const override {
    const std::vector<AdamTensor> list = adam_tensors(tensors, count, hyper);
    adam_step_cpu(list.data(), list.size(), adam_scalars(hyper, 1), inv_grad_scale, pool);
  }

  // See Note [Bias corrections from the device] in adam_kernels.h: step_size and
  // bias_correction2_sqrt.
  int host_scalars() const override { return 2; }
  void host_scalars_cpu(const AdamHyper& hyper, std::int64_t t, float* out) const override {
    AdamScalars s = adam_scalars(hyper, 1);
    bias_corrections(s, t);
    out[0] = s.step_size;
    out[1] = s.bias_correction2_sqrt;
  }

#ifdef STRATA_HAS_CUDA
  cudaError_t step_gpu(const StepTensor* tensors, std::size_t count, const AdamHyper& hyper,
                       const float* grad_scale, const float* found_inf,
                       cudaStream_t stream) const override {
    const std::vector<AdamTensor> list = adam_tensors(tensors, count, hyper);
    return adam_step_cuda(list.data(), list.size(), adam_scalars(hyper, 1), grad_scale, found_inf,
                          stream);
  }

  cudaError_t queue_host_scalars(const std::vector<const AdamHyper*>& hypers,
                                 const std::vector<std::int64_t>& steps, float* out,
                                 cudaStream_t stream) const override {
    std::vector<BiasRequest> requests;
    for (std::size_t r = 0; r < hypers.size(); ++r) {
      requests.push_back({adam_scalars(*hypers[r], 1), steps[r]});
    }
    for (std::size_t r = 0; r < requests.size(); r += kMaxBiasRequests) {
      const int n = static_cast<int>(std::min<std::size_t>(kMaxBiasRequests, requests.size() - r));
      if (cudaError_t err = adam_bias_corrections_cuda(requests.data() + r, n, out + 2 * r, stream);
          err != cudaSuccess) {
        return err;
      }
    }
    return cudaSuccess;
  }
#endif
};

}  // namespace

std::shared_ptr<const StepRule> adam_rule() {
  static const std::shared_ptr<const StepRule> rule = std::make_shared<AdamRule>();
  return rule;
}

}  // namespace strata::optim
