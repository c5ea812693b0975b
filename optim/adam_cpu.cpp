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
// contraction] in adam_math.h); amsgrad takes the generic element-by-element path. Compressed
// moments' codec (state_codec.h) is branch-free, and the file is compiled without floating-point
// traps (optim/CMakeLists.txt), so that its selects need no branches either.
//
// Note [A float32 parameter as its own master]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A float32 parameter stepped on the host is its own master there: the step's parameter and master
// are one buffer (See Note [Host-stepped layers] in adam_host_step.cpp). The kernels step it in
// place, by the loop for a float32 parameter without a master, whose arithmetic is the same
// (the master's value is the parameter's, read once and written once). The loop with a master
// would write the same element twice through two pointers, and GCC does not vectorize it (five
// float arrays it cannot tell apart), so the host step of a float32 layer ran element by element.
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

// adam_element with its branches resolved (See Note [The host kernel's loops]): p, m and v in
// float32, g as loaded.
template <Decay D, bool kMaximize>
inline void update(float& p, float g, float& m, float& v, const AdamScalars& s, float inv,
                   float decay) {
  g = g * inv;
  if constexpr (kMaximize) g = -g;
  if constexpr (D == Decay::kDecoupled) p = fmaf(decay, p, p);
  if constexpr (D == Decay::kCoupled) g = fmaf(p, s.weight_decay, g);
  m = fmaf(s.beta1, m, fmaf(-s.beta1, g, g));
  const float g2 = g * g;
  v = fmaf(s.beta2, v, fmaf(-s.beta2, g2, g2));
  const float denom = sqrtf(v) / s.bias_correction2_sqrt + s.eps;
  p -= s.step_size * m / denom;
}

// Float32 or bfloat16 moments (See Note [Compressed moments] in state_codec.h).
template <ElemType P, ElemType G, bool kMaster, Decay D, bool kMaximize, StateType S>
void run_loop(const AdamTensor& x, std::int64_t lo, std::int64_t hi, const AdamScalars& s,
              float inv) {
  float* __restrict master = x.master;
  void* __restrict param = x.param;
  const void* __restrict grad = x.grad;
  const float decay = -(s.lr * s.weight_decay);
  if constexpr (S == StateType::kF32) {
    float* __restrict m = static_cast<float*>(x.exp_avg);
    float* __restrict v = static_cast<float*>(x.exp_avg_sq);
    for (std::int64_t i = lo; i < hi; ++i) {
      float p = kMaster ? master[i] : load<P>(param, i);
      float mi = m[i], vi = v[i];
      update<D, kMaximize>(p, load<G>(grad, i), mi, vi, s, inv, decay);
      m[i] = mi;
      v[i] = vi;
      if constexpr (kMaster) master[i] = p;
      store<P>(param, i, p);
    }
  } else {
    std::uint16_t* __restrict m = static_cast<std::uint16_t*>(x.exp_avg);
    std::uint16_t* __restrict v = static_cast<std::uint16_t*>(x.exp_avg_sq);
    const std::uint32_t seed = x.seed;
    const std::int64_t step = x.step;
    for (std::int64_t i = lo; i < hi; ++i) {
      float p = kMaster ? master[i] : load<P>(param, i);
      float mi = bf16_to_float(m[i]), vi = bf16_to_float(v[i]);
      update<D, kMaximize>(p, load<G>(grad, i), mi, vi, s, inv, decay);
      const std::uint32_t r = state_random_bits(seed, step, i);
      m[i] = float_to_bf16_stochastic(mi, r);
      v[i] = float_to_bf16_stochastic(vi, r >> 16);
      if constexpr (kMaster) master[i] = p;
      store<P>(param, i, p);
    }
  }
}

// Int8 moments, block by block: [lo, hi) starts on a block and ends on one or at numel (See
// split_range). Each block's moments are decoded, stepped, their new absmax taken, and encoded;
// the padding past numel is zeros, as the CUDA kernel writes it.
template <ElemType P, ElemType G, bool kMaster, Decay D, bool kMaximize>
void run_loop_int8(const AdamTensor& x, std::int64_t lo, std::int64_t hi, const AdamScalars& s,
                   float inv) {
  float* __restrict master = x.master;
  void* __restrict param = x.param;
  const void* __restrict grad = x.grad;
  std::uint8_t* __restrict cm = static_cast<std::uint8_t*>(x.exp_avg);
  std::uint8_t* __restrict cv = static_cast<std::uint8_t*>(x.exp_avg_sq);
  float* __restrict sm = int8_scales(x.exp_avg, x.numel);
  float* __restrict sv = int8_scales(x.exp_avg_sq, x.numel);
  const float decay = -(s.lr * s.weight_decay);
  float mb[kStateBlock], vb[kStateBlock];
  for (std::int64_t b0 = lo; b0 < hi; b0 += kStateBlock) {
    const std::int64_t block = b0 / kStateBlock;
    const std::int64_t n = std::min<std::int64_t>(kStateBlock, x.numel - b0);
    const float scale_m = sm[block], scale_v = sv[block];
    for (std::int64_t k = 0; k < n; ++k) {
      const std::int64_t i = b0 + k;
      float p = kMaster ? master[i] : load<P>(param, i);
      float mi = decode_exp_avg(cm[i]) * scale_m, vi = decode_exp_avg_sq(cv[i]) * scale_v;
      update<D, kMaximize>(p, load<G>(grad, i), mi, vi, s, inv, decay);
      mb[k] = mi;
      vb[k] = vi;
      if constexpr (kMaster) master[i] = p;
      store<P>(param, i, p);
    }
    float am = 0.0f, av = 0.0f;
    for (std::int64_t k = 0; k < n; ++k) {
      am = absmax_of(am, mb[k]);
      av = absmax_of(av, vb[k]);
    }
    const float im = inverse_scale(am), iv = inverse_scale(av);
    for (std::int64_t k = 0; k < n; ++k) {
      cm[b0 + k] =
          encode_exp_avg(relative_to(mb[k], im), state_random_bits(x.seed, x.step, b0 + k, 0));
      cv[b0 + k] =
          encode_exp_avg_sq(relative_to(vb[k], iv), state_random_bits(x.seed, x.step, b0 + k, 1));
    }
    for (std::int64_t k = n; k < kStateBlock; ++k) cm[b0 + k] = cv[b0 + k] = 0;
    sm[block] = am;
    sv[block] = av;
  }
}

template <ElemType P, ElemType G, bool kMaster, Decay D, bool kMaximize>
void run_state(const AdamTensor& x, std::int64_t lo, std::int64_t hi, const AdamScalars& s,
               float inv) {
  switch (x.state_type) {
    case StateType::kBF16:
      return run_loop<P, G, kMaster, D, kMaximize, StateType::kBF16>(x, lo, hi, s, inv);
    case StateType::kI8:
      return run_loop_int8<P, G, kMaster, D, kMaximize>(x, lo, hi, s, inv);
    default:
      return run_loop<P, G, kMaster, D, kMaximize, StateType::kF32>(x, lo, hi, s, inv);
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
    max ? run_state<P, G, kMaster, Decay::kNone, true>(x, lo, hi, s, inv)
        : run_state<P, G, kMaster, Decay::kNone, false>(x, lo, hi, s, inv);
  } else if (d == Decay::kDecoupled) {
    max ? run_state<P, G, kMaster, Decay::kDecoupled, true>(x, lo, hi, s, inv)
        : run_state<P, G, kMaster, Decay::kDecoupled, false>(x, lo, hi, s, inv);
  } else {
    max ? run_state<P, G, kMaster, Decay::kCoupled, true>(x, lo, hi, s, inv)
        : run_state<P, G, kMaster, Decay::kCoupled, false>(x, lo, hi, s, inv);
  }
}

// Elements [lo, hi) of one tensor: a typed loop where one exists, else element by element.
STRATA_HOST_CLONES void run_tensor(const AdamTensor& x, std::int64_t lo, std::int64_t hi,
                                   const AdamScalars& s, float inv) {
  const bool master = x.master != nullptr;
  if (!s.amsgrad || x.state_type != StateType::kF32) {  // amsgrad needs float32 moments
    const ElemType p = x.param_type, g = x.grad_type;
    using E = ElemType;
    // See Note [A float32 parameter as its own master].
    if ((!master || x.param == x.master) && p == E::kF32 && g == E::kF32)
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
    // Int8 moments have no element-by-element path: the pairs above are every pair Adam accepts.
  }
  if (x.state_type == StateType::kBF16) {
    for (std::int64_t i = lo; i < hi; ++i) adam_bf16_state_element(x, i, s, inv);
    return;
  }
  for (std::int64_t i = lo; i < hi; ++i) adam_tensor_element(x, i, s, inv);
}

// Elements [begin, end) of the concatenation of all tensors.
void run_range(const AdamTensor* tensors, std::size_t count, const AdamScalars& s, float inv,
               std::int64_t begin, std::int64_t end) {
  std::int64_t base = 0;
  for (std::size_t t = 0; t < count && base < end; ++t) {
    const AdamTensor& x = tensors[t];
    std::int64_t lo = std::max<std::int64_t>(begin - base, 0);
    std::int64_t hi = std::min<std::int64_t>(end - base, x.numel);
    if (x.state_type == StateType::kI8) {
      // A block belongs to the part its first element falls in.
      lo = std::min(x.numel, (lo + kStateBlock - 1) / kStateBlock * kStateBlock);
      if (hi < x.numel) hi = (hi + kStateBlock - 1) / kStateBlock * kStateBlock;
      hi = std::min(hi, x.numel);
    }
    if (lo < hi) {
      AdamScalars own = s;
      // The settled step (See Note [Skipped steps]): the bias corrections' and the rounding's.
      AdamTensor settled = x;
      settled.step = settled_step(x);
      settled.skipped = nullptr;
      if (x.bias != nullptr) {
        // See Note [Bias corrections from the device] in adam_kernels.h.
        own.step_size = x.bias[0];
        own.bias_correction2_sqrt = x.bias[1];
      } else {
        bias_corrections(own, settled.step);
      }
      // See Note [Undo in the host kernel] in kept_states.h.
      keep_then_step(x.keep, x.numel, lo, hi, [&](std::int64_t from, std::int64_t to) {
        run_tensor(settled, from, to, own, inv);
      });
    }
    base += x.numel;
  }
}

}  // namespace

void adam_step_cpu(const AdamTensor* tensors, std::size_t count, const AdamScalars& scalars,
                   float inv_grad_scale, ThreadPool* pool) {
  std::int64_t total = 0;
  for (std::size_t t = 0; t < count; ++t) total += tensors[t].numel;
  // A part of fewer than 2^16 elements costs less than handing it to another thread; parts a
  // multiple of 16 elements long start on a cache line of float32 data.
  parallel_ranges(pool, total, std::int64_t{1} << 16, 16,
                  [&](std::int64_t begin, std::int64_t end) {
                    run_range(tensors, count, scalars, inv_grad_scale, begin, end);
                  });
}

}  // namespace strata::optim
