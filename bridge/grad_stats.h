// bridge/grad_stats.h: global gradient-norm clipping and loss scaling's non-finite check, taken
// layer by layer while backward produces the gradients, on their device, with no host wait.
//
// A streamed gradient leaves the GPU right after its layer's backward (the runtime's
// after_backward), so anything computed over every gradient must take its part of each layer
// before that: add_layer() queues the layer's sum of squares on torch's current stream, and its
// inf/NaN check only when set_check_non_finite(true) asked for it (See Note [Opt-in inf check]).
// After backward, grad_scale() gives Adam the one device scalar its kernel divides gradients by
// (the loss scale, and the clip coefficient of torch.nn.utils.clip_grad_norm_), and found_inf()
// the flag a step is skipped by (See Note [Skipped steps] in optim/adam_kernels.h). Misuse (a layer
// added twice in a step, totals with no layer added, found_inf without the check) throws
// kFailedPrecondition. Partial sums are added in layer order, so the result does not depend on
// where the policy keeps the gradients.
//
// Note [Opt-in inf check]
// ~~~~~~~~~~~~~~~~~~~~~~~
// The check reads every gradient element once more each step, and only loss scaling uses it, so it
// is off unless the owner scales its loss. It cannot be derived from the norm: a finite gradient
// whose square overflows float32 makes the norm inf, yet GradScaler (and so found_inf) counts only
// inf and NaN elements. The norms are always taken: every owner reads total_norm (strata-train
// reports it each step), and a streamed gradient is gone by the time one could ask for it.
//
// Example (each step):
//   GradientStats stats;
//   stats.set_check_non_finite(true);  // once, when the loss is scaled
//   ...in the hook that runs once layer l's backward is done, before runtime.after_backward(l):
//   stats.add_layer(l, grads_of_layer[l]);
//   ...after backward:
//   torch::Tensor scale = stats.grad_scale(loss_scale, /*max_norm=*/1.0);  // loss_scale: a scalar
//   torch::Tensor inf = stats.found_inf();
//   check(adam->step(scale.data_ptr<float>(), inf.data_ptr<float>()));
//   float norm = stats.total_norm(loss_scale).item<float>();  // as clip_grad_norm_ returns it
//   stats.reset();
#pragma once

#include <map>
#include <vector>

#include "ATen/core/Tensor.h"

namespace strata::bridge {

class GradientStats {
 public:
  // Takes the part of `grads` (one layer's) in the total: each tensor's float32 norm and, when
  // asked for, whether any element is inf or NaN, on the gradients' device. Once per layer per
  // step.
  void add_layer(int layer, const std::vector<at::Tensor>& grads);
  // Forgets the step's parts; the setting of set_check_non_finite stays.
  void reset();
  // Whether add_layer also takes the inf/NaN check found_inf() reads (See Note [Opt-in inf check]);
  // off by default. Set it before a step's first add_layer.
  void set_check_non_finite(bool on) { check_non_finite_ = on; }

  // The gradients' global 2-norm, divided by loss_scale (a float32 scalar on their device, as
  // GradScaler keeps it; undefined: 1): a float32 scalar on their device.
  at::Tensor total_norm(const at::Tensor& loss_scale = {}) const;
  // 1 when any gradient held inf or NaN, else 0: a float32 scalar on their device. Throws
  // kFailedPrecondition unless every layer of the step was checked (set_check_non_finite).
  at::Tensor found_inf() const;
  // What Adam divides each gradient by: loss_scale, and with max_norm > 0 also the clip
  // coefficient min(1, max_norm / (total_norm + 1e-6)) as torch.nn.utils.clip_grad_norm_ takes
  // it. A float32 scalar on the gradients' device.
  at::Tensor grad_scale(const at::Tensor& loss_scale, double max_norm) const;

  bool empty() const { return norms_.empty(); }

 private:
  // Throws kFailedPrecondition when no layer was added this step.
  void require_layers() const;
  // The total is the norm of every tensor's norm, in layer order, as clip_grad_norm_ takes it.
  std::map<int, at::Tensor> norms_;
  std::map<int, at::Tensor> non_finite_;
  bool check_non_finite_ = false;
};

}  // namespace strata::bridge
