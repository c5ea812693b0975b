// optim/lion_math.h: the per-element Lion update (Chen et al., 2023, "Symbolic Discovery of
// Optimization Algorithms"), shared by the host and CUDA kernels so both compute the same
// function. Plain C++ (no Abseil) so .cu files can include it.
//
// Lion keeps one state, the momentum m, and steps each element by the sign of an interpolation of
// m and the gradient, so every update has the same size, lr:
//   g = grad * inv_grad_scale;  g = maximize ? -g : g
//   p = fma(-(lr * weight_decay), p, p)              (decoupled weight decay, as AdamW's)
//   c = fma(beta1, m, fma(-beta1, g, g))             (beta1 * m + (1 - beta1) * g)
//   p = fma(-lr, sign(c), p)
//   m = fma(beta2, m, fma(-beta2, g, g))             (beta2 * m + (1 - beta2) * g)
// The interpolations are written as Adam's moments are (adam_math.h), with explicit fused
// multiply-adds and nothing the compiler may contract (See Note [No contraction] in adam_math.h),
// and no scalar depends on the step count: the host kernel gives the CUDA kernel's bits with no
// help from the device. sign(0) is 0 and sign(NaN) is NaN, as torch.sign's. Its state is 4 bytes a
// parameter to stream or keep (8 with a master copy), against Adam's 8 (12).
//
// Example:
//   LionScalars s = lion_scalars({.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.99, .weight_decay = 0.1});
//   for (std::size_t i = 0; i < n; ++i) lion_element(p[i], g[i], m[i], s, 1.0f);
#pragma once

#include "optim/adam_math.h"

namespace strata::optim {

// The hyperparameters Lion takes, rounded to float32 once.
struct LionScalars {
  float lr;
  float beta1;
  float beta2;
  float decay;  // -(lr * weight_decay)
  bool maximize;
};

inline LionScalars lion_scalars(const AdamHyper& h) {
  const auto lr = static_cast<float>(h.lr);
  return {lr, static_cast<float>(h.beta1), static_cast<float>(h.beta2),
          -(lr * static_cast<float>(h.weight_decay)), h.maximize};
}

STRATA_HD float sign_of(float c) { return c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c * 0.0f); }

STRATA_HD void lion_element(float& p, float grad, float& m, const LionScalars& s,
                            float inv_grad_scale) {
  float g = grad * inv_grad_scale;
  if (s.maximize) g = -g;
  if (s.decay != 0.0f) p = fmaf(s.decay, p, p);
  const float c = fmaf(s.beta1, m, fmaf(-s.beta1, g, g));
  p = fmaf(-s.lr, sign_of(c), p);
  m = fmaf(s.beta2, m, fmaf(-s.beta2, g, g));
}

}  // namespace strata::optim
