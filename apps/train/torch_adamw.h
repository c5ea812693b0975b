// apps/train/torch_adamw.h: the PyTorch baseline's optimizer, torch's fused AdamW
// (torch._fused_adamw_, the kernel torch.optim.AdamW(fused=True) runs) over parameter groups, with
// its state kept as torch keeps it: exp_avg, exp_avg_sq and a float32 step tensor per parameter on
// the parameter's device. A GradScaler's found_inf goes to the kernel, which then changes nothing,
// and the step counters are taken back as torch.optim.AdamW does.
//
// Example:
//   TorchFusedAdamW adam({{decay, /*lr=*/1e-3, /*weight_decay=*/0.01}, {no_decay, 1e-3, 0.0}});
//   ...backward (float32 gradients on the parameters)...
//   adam.step(found_inf);  // found_inf: undefined, or a float32 scalar on the parameters' device
#pragma once

#include <ATen/ops/_fused_adamw.h>
#include <torch/torch.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace strata::apps {

class TorchFusedAdamW {
 public:
  struct Group {
    std::vector<torch::Tensor> params;
    double lr = 1e-3;
    double weight_decay = 0.0;
  };

  explicit TorchFusedAdamW(std::vector<Group> groups, double beta1 = 0.9, double beta2 = 0.999,
                           double eps = 1e-8)
      : groups_(std::move(groups)), beta1_(beta1), beta2_(beta2), eps_(eps) {}

  void step(const torch::Tensor& found_inf = {}) {
    torch::NoGradGuard no_grad;
    for (Group& g : groups_) {
      std::vector<torch::Tensor> params, grads;
      for (const torch::Tensor& p : g.params) {
        if (!p.grad().defined()) continue;
        params.push_back(p);
        grads.push_back(p.grad());
      }
      if (params.empty()) continue;
      std::vector<torch::Tensor> m, v, steps;
      for (const torch::Tensor& p : params) {
        State& s = state_of(p);
        m.push_back(s.exp_avg);
        v.push_back(s.exp_avg_sq);
        steps.push_back(s.step);
      }
      at::_foreach_add_(steps, 1);
      const std::optional<at::Tensor> inf =
          found_inf.defined() ? std::optional<at::Tensor>(found_inf) : std::nullopt;
      at::_fused_adamw_(params, grads, m, v, /*max_exp_avg_sqs=*/{}, steps, g.lr, beta1_, beta2_,
                        g.weight_decay, eps_, /*amsgrad=*/false, /*maximize=*/false,
                        /*grad_scale=*/std::nullopt, inf);
      if (inf.has_value()) at::_foreach_sub_(steps, std::vector<torch::Tensor>(steps.size(), *inf));
    }
  }

  // Every state tensor, for moving them between devices (assign the moved tensor back).
  std::vector<torch::Tensor*> states() {
    std::vector<torch::Tensor*> out;
    for (State& s : states_) {
      out.push_back(&s.exp_avg);
      out.push_back(&s.exp_avg_sq);
      out.push_back(&s.step);
    }
    return out;
  }

  std::int64_t moment_bytes() const {
    std::int64_t bytes = 0;
    for (const State& s : states_) bytes += s.exp_avg.nbytes() + s.exp_avg_sq.nbytes();
    return bytes;
  }

 private:
  struct State {
    torch::Tensor exp_avg, exp_avg_sq, step;
  };

  // Keyed by the parameter's TensorImpl, which set_data keeps (as torch keys state by parameter).
  State& state_of(const torch::Tensor& p) {
    const auto [it, added] = index_.try_emplace(p.unsafeGetTensorImpl(), states_.size());
    if (added) {
      states_.push_back({torch::zeros_like(p), torch::zeros_like(p),
                         torch::zeros({}, p.options().dtype(torch::kFloat))});
    }
    return states_[it->second];
  }

  std::vector<Group> groups_;
  std::vector<State> states_;
  std::unordered_map<const void*, std::size_t> index_;
  double beta1_, beta2_, eps_;
};

}  // namespace strata::apps
