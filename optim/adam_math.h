// optim/adam_math.h: the per-element Adam / AdamW update, shared by the CPU kernel and the CUDA
// kernel so both compute the same function. Plain C++ (no Abseil) so .cu files can include it.
//
// The math is torch's fused Adam / AdamW CUDA kernel's (torch._fused_adamw_ as torch 2.11 runs it
// for float32 tensors), in its order and precision: the hyperparameters (doubles, as Python gives
// them) are rounded to float32 once, everything is float32, and the moments use explicit fused
// multiply-adds:
//   g = grad * inv_grad_scale;  g = maximize ? -g : g
//   AdamW: p = fma(-(lr * weight_decay), p, p)     Adam: g = fma(p, weight_decay, g)
//   m = fma(beta1, m, fma(-beta1, g, g))
//   v = fma(beta2, v, fma(-beta2, g * g, g * g))
//   amsgrad: v_max = max(v_max, v), and v_max replaces v below
//   bc1 = 1 - powf(beta1, t), step_size = lr / bc1, bc2_sqrt = sqrtf(1 - powf(beta2, t))
//   p -= step_size * m / (sqrtf(v) / bc2_sqrt + eps)
// So the CUDA kernel's master weights are bitwise torch's (its bias corrections use the device's
// powf, as torch's do); the CPU kernel's are bitwise the CUDA kernel's when it is given the
// device's bias corrections (See Note [Bias corrections from the device] in adam_kernels.h), and
// differ otherwise only where the host's powf rounds one differently.
//
// Note [No contraction]
// ~~~~~~~~~~~~~~~~~~~~~
// A compiler may fuse a multiply and an add into one fused multiply-add, which rounds once instead
// of twice; nvcc does by default and GCC does where the target has FMA. Then the same source gives
// different bits on the host and the GPU. Every fused multiply-add of the update is written out
// (fmaf), and the files that compile it forbid the compiler its own: nvcc -fmad=false for the
// CUDA kernel, -ffp-contract=off for the host kernel (optim/CMakeLists.txt).
//
// Example:
//   AdamScalars s = adam_scalars({.lr = 1e-3, .weight_decay = 0.01, .decoupled = true}, step);
//   for (std::size_t i = 0; i < n; ++i) adam_element(p[i], g[i], m[i], v[i], nullptr, s, 1.0f);
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define STRATA_HD __host__ __device__ __forceinline__
#else
#define STRATA_HD inline
#endif

namespace strata::optim {

// Note [Mixed precision]
// ~~~~~~~~~~~~~~~~~~~~~~
// Parameters and gradients may be float32, bfloat16 or float16; the math is float32 always. A
// bfloat16 or float16 parameter is stepped through its float32 master copy (optimizer state), and
// the parameter is the master rounded to nearest even. The conversions are written out in integer
// arithmetic here, so the CPU kernel and the CUDA kernel give the same bits (torch's c10::BFloat16
// and c10::Half round the same way; NaN becomes the canonical quiet NaN).
enum class ElemType : std::uint8_t { kF32, kBF16, kF16 };

STRATA_HD std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

STRATA_HD float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

STRATA_HD std::uint16_t float_to_bf16(float f) {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

STRATA_HD float bf16_to_float(std::uint16_t h) { return bits_float(std::uint32_t{h} << 16); }

STRATA_HD std::uint16_t float_to_f16(float f) {
  const std::uint32_t x = float_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);   // NaN
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (ax >= 0x38800000u) {  // a normal half: rebias the exponent (127 -> 15), round the mantissa
    return static_cast<std::uint16_t>(sign |
                                      ((ax - 0x38000000u + 0x0fffu + ((ax >> 13) & 1u)) >> 13));
  }
  // A subnormal half (or zero): the value in units of 2^-24, rounded to nearest even.
  const std::uint32_t e = ax >> 23;
  const std::uint32_t shift = 126u - e;  // >= 14 here
  if (e == 0 || shift >= 32) return static_cast<std::uint16_t>(sign);
  const std::uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
  std::uint32_t q = mant >> shift;
  const std::uint32_t rem = mant & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<std::uint16_t>(sign | q);
}

STRATA_HD float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

STRATA_HD float load_elem(const void* base, ElemType type, std::int64_t i) {
  switch (type) {
    case ElemType::kBF16:
      return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case ElemType::kF16:
      return f16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

STRATA_HD void store_elem(void* base, ElemType type, std::int64_t i, float v) {
  switch (type) {
    case ElemType::kBF16:
      static_cast<std::uint16_t*>(base)[i] = float_to_bf16(v);
      break;
    case ElemType::kF16:
      static_cast<std::uint16_t*>(base)[i] = float_to_f16(v);
      break;
    default:
      static_cast<float*>(base)[i] = v;
  }
}

STRATA_HD std::size_t elem_size(ElemType type) { return type == ElemType::kF32 ? 4 : 2; }

struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = true;  // AdamW; false: Adam with L2 (coupled) weight decay
  bool amsgrad = false;
  bool maximize = false;
};

// What one step of one group needs: the hyperparameters rounded to float32, as torch's kernel
// takes them.
struct AdamScalars {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  float step_size;              // lr / (1 - powf(beta1, t))
  float bias_correction2_sqrt;  // sqrtf(1 - powf(beta2, t))
  bool decoupled;
  bool amsgrad;
  bool maximize;
};

// The bias corrections of step t as torch's fused kernel takes them: its step counter is a float32.
STRATA_HD void bias_corrections(AdamScalars& s, std::int64_t t) {
  const float steps = static_cast<float>(t);
  const float bc1 = 1.0f - powf(s.beta1, steps);
  s.step_size = s.lr / bc1;
  s.bias_correction2_sqrt = sqrtf(1.0f - powf(s.beta2, steps));
}

inline AdamScalars adam_scalars(const AdamHyper& h, std::int64_t step) {
  AdamScalars s{static_cast<float>(h.lr),
                static_cast<float>(h.beta1),
                static_cast<float>(h.beta2),
                static_cast<float>(h.eps),
                static_cast<float>(h.weight_decay),
                0.0f,
                0.0f,
                h.decoupled,
                h.amsgrad,
                h.maximize};
  bias_corrections(s, step);
  return s;
}

STRATA_HD void adam_element(float& p, float grad, float& m, float& v, float* v_max,
                            const AdamScalars& s, float inv_grad_scale) {
  float g = grad * inv_grad_scale;
  if (s.maximize) g = -g;
  if (s.weight_decay != 0.0f) {
    if (s.decoupled) {
      p = fmaf(-(s.lr * s.weight_decay), p, p);
    } else {
      g = fmaf(p, s.weight_decay, g);
    }
  }
  m = fmaf(s.beta1, m, fmaf(-s.beta1, g, g));
  const float g2 = g * g;
  v = fmaf(s.beta2, v, fmaf(-s.beta2, g2, g2));
  float second = v;
  if (s.amsgrad) {
    *v_max = *v_max > v ? *v_max : v;
    second = *v_max;
  }
  const float denom = sqrtf(second) / s.bias_correction2_sqrt + s.eps;
  p -= s.step_size * m / denom;
}

}  // namespace strata::optim
