// optim/adam_math.h: the per-element Adam / AdamW update, shared by the CPU kernel and the CUDA
// kernel so both compute the same function. Plain C++ (no Abseil) so .cu files can include it.
//
// The math follows torch.optim.Adam / AdamW (and their fused CUDA kernel):
//   g = maximize ? -grad : grad;  g *= inv_grad_scale
//   AdamW: p *= 1 - lr * weight_decay          Adam: g += weight_decay * p
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   amsgrad: v_max = max(v_max, v), and v_max replaces v below
//   p -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// Bias corrections come from the host, where the step counter t lives as an int64.
//
// Example:
//   AdamScalars s = adam_scalars({.lr = 1e-3f, .weight_decay = 0.01f, .decoupled = true}, step);
//   for (std::size_t i = 0; i < n; ++i) adam_element(p[i], g[i], m[i], v[i], nullptr, s, 1.0f);
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define STRATA_HD __host__ __device__ __forceinline__
#else
#define STRATA_HD inline
#endif

namespace strata::optim {

struct AdamHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled = true;  // AdamW; false: Adam with L2 (coupled) weight decay
  bool amsgrad = false;
  bool maximize = false;
};

// What one step of one group needs, computed once on the host.
struct AdamScalars {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  bool decoupled;
  bool amsgrad;
  bool maximize;
};

inline AdamScalars adam_scalars(const AdamHyper& h, std::int64_t step) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(step));
  return AdamScalars{h.lr,
                     h.beta1,
                     h.beta2,
                     h.eps,
                     h.weight_decay,
                     static_cast<float>(h.lr / bc1),
                     static_cast<float>(std::sqrt(bc2)),
                     h.decoupled,
                     h.amsgrad,
                     h.maximize};
}

STRATA_HD void adam_element(float& p, float grad, float& m, float& v, float* v_max,
                            const AdamScalars& s, float inv_grad_scale) {
  float g = (s.maximize ? -grad : grad) * inv_grad_scale;
  if (s.weight_decay != 0.0f) {
    if (s.decoupled) {
      p *= 1.0f - s.lr * s.weight_decay;
    } else {
      g += s.weight_decay * p;
    }
  }
  m = s.beta1 * m + (1.0f - s.beta1) * g;
  v = s.beta2 * v + (1.0f - s.beta2) * g * g;
  float second = v;
  if (s.amsgrad) {
    *v_max = *v_max > v ? *v_max : v;
    second = *v_max;
  }
  const float denom = sqrtf(second) / s.bias_correction2_sqrt + s.eps;
  p -= s.step_size * m / denom;
}

}  // namespace strata::optim
