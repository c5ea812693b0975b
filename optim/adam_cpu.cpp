// The host Adam kernel (see optim/adam_kernels.h).
//
// Note [The host kernel's loops]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A hybrid step is bound by the host kernel's rate, so its loops must run at host memory speed. The
// update of adam_math.h has branches on the element types, the weight decay and maximize, which
// are the same for a whole tensor: the loop is instantiated per combination (template parameters),
// so each loop body is straight-line code the compiler vectorizes. Its fused multiply-adds must be
// the hardware's: without FMA in the target, fmaf is a call into the C library per operation and
// nothing vectorizes. The loops are compiled twice, for x86-64-v3 (AVX2 and FMA) and for the
// baseline, and the loader picks the one the machine runs (GCC's target_clones); the baseline
// clone gives the same bits through the library's fmaf, only slower. The arithmetic is
// adam_element's, operation for operation, so the results stay the CUDA kernel's (See Note [No
// contraction] in adam_math.h); amsgrad takes the generic element-by-element path.
#include <algorithm>

#include "optim/adam_kernels.h"

// ThreadSanitizer's runtime is not up when the loader resolves the clones (an ifunc), so a
// ThreadSanitizer build has the baseline only.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define STRATA_HOST_CLONES __attribute__((target_clones("arch=x86-64-v3", "default"), flatten))
#else
#define STRATA_HOST_CLONES
#endif

namespace strata::optim {
namespace {

enum class Decay { kNone, kDecoupled, kCoupled };

template <ElemType T>
inline float load(const void* base, std::int64_t i) {
  if constexpr (T == ElemType::kBF16) {
    return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
  } else if constexpr (T == ElemType::kF16) {
    return f16_to_float(static_cast<const std::uint16_t*>(base)[i]);
  } else {
    return static_cast<const float*>(base)[i];
  }
}

template <ElemType T>
inline void store(void* base, std::int64_t i, float v) {
  if constexpr (T == ElemType::kBF16) {
    static_cast<std::uint16_t*>(base)[i] = float_to_bf16(v);
  } else if constexpr (T == ElemType::kF16) {
    static_cast<std::uint16_t*>(base)[i] = float_to_f16(v);
  } else {
    static_cast<float*>(base)[i] = v;
  }
}

// adam_element with its branches resolved (See Note [The host kernel's loops]).
template <ElemType P, ElemType G, bool kMaster, Decay D, bool kMaximize>
void run_loop(const AdamTensor& x, std::int64_t lo, std::int64_t hi, const AdamScalars& s,
              float inv) {
  float* __restrict master = x.master;
  void* __restrict param = x.param;
  const void* __restrict grad = x.grad;
  float* __restrict m = x.exp_avg;
  float* __restrict v = x.exp_avg_sq;
  const float decay = -(s.lr * s.weight_decay);
  for (std::int64_t i = lo; i < hi; ++i) {
    float p = kMaster ? master[i] : load<P>(param, i);
    float g = load<G>(grad, i) * inv;
    if constexpr (kMaximize) g = -g;
    if constexpr (D == Decay::kDecoupled) p = fmaf(decay, p, p);
    if constexpr (D == Decay::kCoupled) g = fmaf(p, s.weight_decay, g);
    const float mi = fmaf(s.beta1, m[i], fmaf(-s.beta1, g, g));
    const float g2 = g * g;
    const float vi = fmaf(s.beta2, v[i], fmaf(-s.beta2, g2, g2));
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) / s.bias_correction2_sqrt + s.eps;
    p -= s.step_size * mi / denom;
    if constexpr (kMaster) master[i] = p;
    store<P>(param, i, p);
  }
}

template <ElemType P, ElemType G, bool kMaster>
void run_typed(const AdamTensor& x, std::int64_t lo, std::int64_t hi, const AdamScalars& s,
               float inv) {
  const Decay d = s.weight_decay == 0.0f ? Decay::kNone
                  : s.decoupled          ? Decay::kDecoupled
                                         : Decay::kCoupled;
  const bool max = s.maximize;
  if (d == Decay::kNone) {
    max ? run_loop<P, G, kMaster, Decay::kNone, true>(x, lo, hi, s, inv)
        : run_loop<P, G, kMaster, Decay::kNone, false>(x, lo, hi, s, inv);
  } else if (d == Decay::kDecoupled) {
    max ? run_loop<P, G, kMaster, Decay::kDecoupled, true>(x, lo, hi, s, inv)
        : run_loop<P, G, kMaster, Decay::kDecoupled, false>(x, lo, hi, s, inv);
  } else {
    max ? run_loop<P, G, kMaster, Decay::kCoupled, true>(x, lo, hi, s, inv)
        : run_loop<P, G, kMaster, Decay::kCoupled, false>(x, lo, hi, s, inv);
  }
}

// Elements [lo, hi) of one tensor: a typed loop where one exists, else element by element.
STRATA_HOST_CLONES void run_tensor(const AdamTensor& x, std::int64_t lo, std::int64_t hi,
                                   const AdamScalars& s, float inv) {
  const bool master = x.master != nullptr;
  if (!s.amsgrad) {
    const ElemType p = x.param_type, g = x.grad_type;
    using E = ElemType;
    if (!master && p == E::kF32 && g == E::kF32)
      return run_typed<E::kF32, E::kF32, false>(x, lo, hi, s, inv);
    if (master && p == E::kF32 && g == E::kF32)
      return run_typed<E::kF32, E::kF32, true>(x, lo, hi, s, inv);
    if (master && p == E::kBF16 && g == E::kBF16)
      return run_typed<E::kBF16, E::kBF16, true>(x, lo, hi, s, inv);
    if (master && p == E::kBF16 && g == E::kF32)
      return run_typed<E::kBF16, E::kF32, true>(x, lo, hi, s, inv);
    if (master && p == E::kF16 && g == E::kF16)
      return run_typed<E::kF16, E::kF16, true>(x, lo, hi, s, inv);
    if (master && p == E::kF16 && g == E::kF32)
      return run_typed<E::kF16, E::kF32, true>(x, lo, hi, s, inv);
  }
  for (std::int64_t i = lo; i < hi; ++i) adam_tensor_element(x, i, s, inv);
}

// Elements [begin, end) of the concatenation of all tensors.
void run_range(const AdamTensor* tensors, std::size_t count, const AdamScalars& s, float inv,
               std::int64_t begin, std::int64_t end) {
  std::int64_t base = 0;
  for (std::size_t t = 0; t < count && base < end; ++t) {
    const AdamTensor& x = tensors[t];
    const std::int64_t lo = std::max<std::int64_t>(begin - base, 0);
    const std::int64_t hi = std::min<std::int64_t>(end - base, x.numel);
    if (lo < hi) {
      AdamScalars own = s;
      if (x.bias != nullptr) {
        // See Note [Bias corrections from the device] in adam_kernels.h.
        own.step_size = x.bias[0];
        own.bias_correction2_sqrt = x.bias[1];
      } else {
        bias_corrections(own, settled_step(x));  // See Note [Skipped steps]
      }
      run_tensor(x, lo, hi, own, inv);
    }
    base += x.numel;
  }
}

}  // namespace

void adam_step_cpu(const AdamTensor* tensors, std::size_t count, const AdamScalars& scalars,
                   float inv_grad_scale, ThreadPool* pool) {
  const AdamScalars& s = scalars;
  std::int64_t total = 0;
  for (std::size_t t = 0; t < count; ++t) total += tensors[t].numel;
  // A part of fewer than 2^16 elements costs less than handing it to another thread.
  const std::int64_t kMinPerPart = std::int64_t{1} << 16;
  const int threads = pool != nullptr ? pool->size() : 1;
  const int n = static_cast<int>(std::clamp<std::int64_t>(total / kMinPerPart, 1, threads));
  if (n == 1) {
    run_range(tensors, count, s, inv_grad_scale, 0, total);
    return;
  }
  // Parts a multiple of 16 elements long, so that each starts on a cache line of float32 data.
  const std::int64_t per = ((total + n - 1) / n + 15) / 16 * 16;
  pool->parallel_for(n, [&](int part) {
    const std::int64_t begin = std::min(total, per * part);
    run_range(tensors, count, s, inv_grad_scale, begin, std::min(total, begin + per));
  });
}

void adam_count_skipped_cpu(const AdamTensor* tensors, std::size_t count) {
  for (std::size_t t = 0; t < count; ++t) {
    if (tensors[t].skipped != nullptr) ++*tensors[t].skipped;
  }
}

}  // namespace strata::optim
