#include "bridge/model_hooks.h"

#include <algorithm>

#include "base/strings.h"
#include "bridge/status.h"

namespace strata::bridge {

// Note [Zeroing streamed gradients]: backward accumulates into the bound gradients, so they must
// be zero before a layer's backward starts. Zeroing them after the step would write them where
// they rest, which for streamed gradients is pinned host memory, through unified addressing (about
// 100 ms a step for 5 GB on an H200, on the compute stream). Instead each layer's gradients are
// zeroed just before its backward: the policy has brought them to the GPU for it by then (held
// from forward for the last layer, or fetched at the next layer's after_backward).

ModelHooks::ModelHooks(rt::Runtime& runtime, bool zero_before_backward)
    : runtime_(runtime), zero_before_backward_(zero_before_backward) {}

void ModelHooks::set_layer_gradients(std::vector<std::vector<at::Tensor>> grads) {
  if (in_step_) {
    check(absl::FailedPreconditionError("ModelHooks: layers cannot change during a step"));
  }
  grads_ = std::move(grads);
}

void ModelHooks::set_layer_parameters(std::vector<std::vector<at::Tensor>> params,
                                      const TorchBinding& binding) {
  if (in_step_) {
    check(absl::FailedPreconditionError("ModelHooks: layers cannot change during a step"));
  }
  params_ = std::move(params);
  binding_ = &binding;
}

void ModelHooks::begin_step() {
  check(runtime_.begin_step());
  in_step_ = true;
  forwarded_.clear();
  backward_done_.assign(grads_.size(), false);
  stats_.reset();
}

void ModelHooks::before_forward(int layer) {
  if (!in_step_) begin_step();
  check(runtime_.before_forward(layer));
  if (binding_ != nullptr && layer >= 0 && layer < static_cast<int>(params_.size())) {
    for (const at::Tensor& p : params_[static_cast<std::size_t>(layer)]) {
      binding_->check_accessible(p);
    }
  }
  if (std::find(forwarded_.begin(), forwarded_.end(), layer) == forwarded_.end()) {
    forwarded_.push_back(layer);
  }
}

void ModelHooks::zero(int layer) {
  if (layer < 0 || layer >= num_layers()) return;
  for (at::Tensor& g : grads_[static_cast<std::size_t>(layer)]) g.zero_();
}

void ModelHooks::begin_backward() {
  if (zero_before_backward_ && !forwarded_.empty()) zero(forwarded_.back());
}

void ModelHooks::after_backward(int layer) {
  if (layer < 0 || layer >= num_layers()) {
    check(absl::InvalidArgumentError(
        str_cat("ModelHooks: layer ", layer, " is not one of the ", num_layers(), " layers")));
  }
  if (backward_done_[static_cast<std::size_t>(layer)]) {
    check(absl::FailedPreconditionError(
        str_cat("ModelHooks: after_backward(", layer, ") twice in one step")));
  }
  backward_done_[static_cast<std::size_t>(layer)] = true;
  stats_.add_layer(layer, grads_[static_cast<std::size_t>(layer)]);
  check(runtime_.after_backward(layer));
  if (zero_before_backward_) {
    const auto it = std::find(forwarded_.begin(), forwarded_.end(), layer);
    if (it != forwarded_.begin() && it != forwarded_.end()) zero(*(it - 1));
  }
}

void ModelHooks::finish_backward() {
  if (!in_step_) begin_step();
  if (forwarded_.empty()) {
    for (int l = 0; l < num_layers(); ++l) before_forward(l);
  }
  for (auto it = forwarded_.rbegin(); it != forwarded_.rend(); ++it) {
    if (!backward_done_[static_cast<std::size_t>(*it)]) after_backward(*it);
  }
}

void ModelHooks::end_step() {
  check(runtime_.end_step());
  in_step_ = false;
}

}  // namespace strata::bridge
