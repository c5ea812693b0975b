// The host Lion kernel (see optim/lion_kernels.h). As the host Adam kernel's loops (See Note [The
// host kernel's loops] in adam_cpu.cpp): one loop per element-type pair, straight-line bodies the
// compiler vectorizes, compiled for x86-64-v3 and the baseline, and never contracted (See Note [No
// contraction] in adam_math.h), so the bits are the CUDA kernel's.
#include <algorithm>

#include "optim/lion_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define STRATA_LION_CLONES __attribute__((target_clones("arch=x86-64-v3", "default"), flatten))
#else
#define STRATA_LION_CLONES
#endif

namespace strata::optim {
namespace {

template <ElemType P, ElemType G, bool kMaster>
void run_loop(const StepTensor& x, std::int64_t lo, std::int64_t hi, const LionScalars& s,
              float inv) {
  float* __restrict master = x.master;
  void* __restrict param = x.param;
  const void* __restrict grad = x.grad;
  float* __restrict m = static_cast<float*>(x.states[0]);
  for (std::int64_t i = lo; i < hi; ++i) {
    float p = kMaster ? master[i] : load_elem(param, P, i);
    float mi = m[i];
    lion_element(p, load_elem(grad, G, i), mi, s, inv);
    m[i] = mi;
    if constexpr (kMaster) master[i] = p;
    store_elem(param, P, i, p);
  }
}

STRATA_LION_CLONES void run_tensor(const StepTensor& x, std::int64_t lo, std::int64_t hi,
                                   const LionScalars& s, float inv) {
  using E = ElemType;
  const bool master = x.master != nullptr;
  const E p = x.param_type, g = x.grad_type;
  // See Note [A float32 parameter as its own master] in adam_cpu.cpp.
  if ((!master || x.param == x.master) && p == E::kF32 && g == E::kF32)
    return run_loop<E::kF32, E::kF32, false>(x, lo, hi, s, inv);
  if (master && p == E::kF32 && g == E::kF32)
    return run_loop<E::kF32, E::kF32, true>(x, lo, hi, s, inv);
  if (master && p == E::kBF16 && g == E::kBF16)
    return run_loop<E::kBF16, E::kBF16, true>(x, lo, hi, s, inv);
  if (master && p == E::kBF16 && g == E::kF32)
    return run_loop<E::kBF16, E::kF32, true>(x, lo, hi, s, inv);
  if (master && p == E::kF16 && g == E::kF16)
    return run_loop<E::kF16, E::kF16, true>(x, lo, hi, s, inv);
  if (master && p == E::kF16 && g == E::kF32)
    return run_loop<E::kF16, E::kF32, true>(x, lo, hi, s, inv);
  // Any other pair, element by element (the same function).
  for (std::int64_t i = lo; i < hi; ++i) {
    float pv = master ? x.master[i] : load_elem(x.param, p, i);
    float mi = static_cast<float*>(x.states[0])[i];
    lion_element(pv, load_elem(x.grad, g, i), mi, s, inv);
    static_cast<float*>(x.states[0])[i] = mi;
    if (master) x.master[i] = pv;
    store_elem(x.param, p, i, pv);
  }
}

// Elements [begin, end) of the concatenation of all tensors.
void run_range(const StepTensor* tensors, std::size_t count, const LionScalars& s, float inv,
               std::int64_t begin, std::int64_t end) {
  std::int64_t base = 0;
  for (std::size_t t = 0; t < count && base < end; ++t) {
    const StepTensor& x = tensors[t];
    const std::int64_t lo = std::max<std::int64_t>(begin - base, 0);
    const std::int64_t hi = std::min<std::int64_t>(end - base, x.numel);
    if (lo < hi) {
      // See Note [Undo in the host kernel] in kept_states.h.
      keep_then_step(x.keep, x.numel, lo, hi,
                     [&](std::int64_t from, std::int64_t to) { run_tensor(x, from, to, s, inv); });
    }
    base += x.numel;
  }
}

}  // namespace

void lion_step_cpu(const StepTensor* tensors, std::size_t count, const LionScalars& s,
                   float inv_grad_scale, ThreadPool* pool) {
  std::int64_t total = 0;
  for (std::size_t t = 0; t < count; ++t) total += tensors[t].numel;
  parallel_ranges(pool, total, std::int64_t{1} << 16, 16,
                  [&](std::int64_t begin, std::int64_t end) {
                    run_range(tensors, count, s, inv_grad_scale, begin, end);
                  });
}

}  // namespace strata::optim
