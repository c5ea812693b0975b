#include "bridge/grad_stats.h"

#include <torch/torch.h>

namespace strata::bridge {

void GradientStats::add_layer(int layer, const std::vector<at::Tensor>& grads) {
  TORCH_CHECK(norms_.count(layer) == 0, "GradientStats: layer ", layer,
              " was added twice in one step");
  if (grads.empty()) return;
  // Each tensor's norm in float32, as clip_grad_norm_ takes it of float32 master gradients.
  std::vector<at::Tensor> norms;
  at::Tensor bad = torch::zeros({}, grads.front().options().dtype(torch::kBool));
  for (const at::Tensor& g : grads) {
    const at::Tensor f = g.to(torch::kFloat);
    norms.push_back(f.norm());
    bad = bad.logical_or(f.isfinite().logical_not().any());
  }
  norms_[layer] = torch::stack(norms);
  non_finite_[layer] = bad;
}

void GradientStats::reset() {
  norms_.clear();
  non_finite_.clear();
}

at::Tensor GradientStats::total_norm(const at::Tensor& loss_scale) const {
  TORCH_CHECK(!norms_.empty(), "GradientStats: no layer was added this step");
  std::vector<at::Tensor> norms;
  for (const auto& [layer, n] : norms_) norms.push_back(n);  // in layer order
  const at::Tensor total = torch::cat(norms).norm();
  return loss_scale.defined() ? total / loss_scale : total;
}

at::Tensor GradientStats::found_inf() const {
  TORCH_CHECK(!non_finite_.empty(), "GradientStats: no layer was added this step");
  at::Tensor bad = non_finite_.begin()->second.clone();
  for (const auto& [layer, b] : non_finite_) bad = bad.logical_or(b);
  return bad.to(torch::kFloat).contiguous();
}

at::Tensor GradientStats::grad_scale(const at::Tensor& loss_scale, double max_norm) const {
  TORCH_CHECK(!norms_.empty(), "GradientStats: no layer was added this step");
  const at::Tensor scale =
      loss_scale.defined()
          ? loss_scale.to(torch::kFloat).reshape({})
          : torch::ones({}, norms_.begin()->second.options().dtype(torch::kFloat));
  if (!(max_norm > 0)) return scale.contiguous();
  const at::Tensor coef = (max_norm / (total_norm(loss_scale) + 1e-6)).clamp_max(1.0);
  return (scale / coef).contiguous();
}

}  // namespace strata::bridge
