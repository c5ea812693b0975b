#include "bridge/grad_stats.h"

#include <torch/torch.h>

#include "base/strings.h"
#include "bridge/status.h"

namespace strata::bridge {

void GradientStats::add_layer(int layer, const std::vector<at::Tensor>& grads) {
  if (norms_.count(layer) != 0) {
    check(absl::FailedPreconditionError(str_cat(
        "GradientStats: layer ", layer, " was added twice in one step; reset() between steps")));
  }
  if (grads.empty()) return;
  std::vector<at::Tensor> norms;
  std::vector<at::Tensor> finite;
  for (const at::Tensor& g : grads) {
    // Each tensor's norm in float32, as clip_grad_norm_ takes it of float32 master gradients; to()
    // returns a float32 gradient itself, so only half-precision ones are converted.
    norms.push_back(g.to(torch::kFloat).norm());
    // Read in the gradient's own dtype: converting to float32 keeps every value finite or not.
    if (check_non_finite_) finite.push_back(g.isfinite().all());
  }
  norms_[layer] = torch::stack(norms);
  if (check_non_finite_) non_finite_[layer] = torch::stack(finite).all().logical_not();
}

void GradientStats::require_layers() const {
  if (norms_.empty()) {
    check(absl::FailedPreconditionError(
        "GradientStats: no layer's gradients were added this step (add_layer after each layer's "
        "backward)"));
  }
}

void GradientStats::reset() {
  norms_.clear();
  non_finite_.clear();
}

at::Tensor GradientStats::total_norm(const at::Tensor& loss_scale) const {
  require_layers();
  std::vector<at::Tensor> norms;
  for (const auto& [layer, n] : norms_) norms.push_back(n);  // in layer order
  const at::Tensor total = torch::cat(norms).norm();
  return loss_scale.defined() ? total / loss_scale : total;
}

at::Tensor GradientStats::found_inf() const {
  require_layers();
  if (non_finite_.size() != norms_.size()) {
    check(absl::FailedPreconditionError(
        str_cat("GradientStats: found_inf needs set_check_non_finite(true) before the step's "
                "layers are added; ",
                non_finite_.size(), " of ", norms_.size(), " layers were checked")));
  }
  at::Tensor bad = non_finite_.begin()->second.clone();
  for (const auto& [layer, b] : non_finite_) bad = bad.logical_or(b);
  return bad.to(torch::kFloat).contiguous();
}

at::Tensor GradientStats::grad_scale(const at::Tensor& loss_scale, double max_norm) const {
  require_layers();
  const at::Tensor scale =
      loss_scale.defined() ? loss_scale.to(torch::kFloat).reshape({})
                           : torch::ones({}, norms_.begin()->second.options().dtype(torch::kFloat));
  if (!(max_norm > 0)) return scale.contiguous();
  const at::Tensor coef = (max_norm / (total_norm(loss_scale) + 1e-6)).clamp_max(1.0);
  return (scale / coef).contiguous();
}

}  // namespace strata::bridge
