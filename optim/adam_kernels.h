// optim/adam_kernels.h: Adam / AdamW over lists of tensors, on the CPU and on the GPU: float32,
// bfloat16 or int8 moments (See Note [Compressed moments] in state_codec.h), and float32, bfloat16
// or float16 parameters (through a float32 master copy) and gradients (See Note [Mixed precision]
// in adam_math.h).
//
// The tensor-list launcher is kept apart from the per-element math (optim/adam_math.h). The CUDA
// kernel walks many tensors in one launch (apex's multi_tensor_apply idea: each block takes a chunk
// of one tensor, the metadata fits the kernel-argument limit, a list longer than one launch holds
// is split over several), loads four floats at a time with a scalar tail, and indexes with 64 bits
// so tensors and lists of more than 2^31 elements work. Nothing waits on the host: the gradient
// scale and the found-inf flag are read on the device.
//
// Example:
//   AdamTensor t{p, g, m, v, nullptr, numel};
//   t.step = step;  // the parameter's own step count (See Note [Per-parameter steps] in adam.h)
//   AdamScalars s = adam_scalars(hyper, step);
//   adam_step_cpu(&t, 1, s, /*inv_grad_scale=*/1.0f, &pool);   // a strata::ThreadPool
//   cudaError_t err = adam_step_cuda(&t, 1, s, grad_scale_dev, found_inf_dev, stream);
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "base/thread_pool.h"
#include "optim/adam_math.h"
#include "optim/kept_states.h"
#include "optim/state_codec.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::optim {

struct AdamTensor {
  void* param = nullptr;       // of param_type
  const void* grad = nullptr;  // of grad_type
  // The moments, stored as state_type says: float32 or bfloat16 elements, or an int8 tensor's
  // codes and scales (int8_state_bytes).
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  float* max_exp_avg_sq = nullptr;  // amsgrad only (float32 moments only)
  std::int64_t numel = 0;
  // A bfloat16 or float16 parameter's float32 master copy, which the step updates and the parameter
  // is rounded from (See Note [Mixed precision] in adam_math.h); null for float32, or the parameter
  // itself for a float32 parameter stepped on the host (See Note [A float32 parameter as its own
  // master] in adam_cpu.cpp).
  float* master = nullptr;
  ElemType param_type = ElemType::kF32;
  ElemType grad_type = ElemType::kF32;
  StateType state_type = StateType::kF32;
  // The key of the moments' stochastic rounding (state_seed of the parameter's name).
  std::uint32_t seed = 0;
  // The parameter's own step count (See Note [Per-parameter steps] in adam.h), this step included.
  //
  // Note [Skipped steps]
  // ~~~~~~~~~~~~~~~~~~~~
  // A step that found_inf skipped does not count (torch's fused AdamW takes it back), but only the
  // device knows which steps were skipped: when `skipped` is set (once a step was given a found_inf
  // flag), the kernel adds 1 to it on a skipped step and takes its bias corrections from
  // t = step - *skipped, read where it runs; the host's count is not the truth.
  std::int64_t step = 1;
  std::int64_t* skipped = nullptr;
  // The host kernel only: {step_size, bias_correction2_sqrt} computed on the device for this
  // tensor's step, used instead of the host's own (See Note [Bias corrections from the device]).
  const float* bias = nullptr;
  // The host kernel only: states it keeps before overwriting them (See Note [Undo in the host
  // kernel] in kept_states.h); null keeps none.
  const KeptStates* keep = nullptr;
};

// The step t whose bias corrections a tensor's update takes (See Note [Skipped steps]).
STRATA_HD std::int64_t settled_step(const AdamTensor& x) {
  return x.skipped != nullptr ? x.step - *x.skipped : x.step;
}

// One element of a tensor with float32 moments, the same on the CPU and the GPU.
STRATA_HD void adam_tensor_element(const AdamTensor& x, std::int64_t i, const AdamScalars& s,
                                   float inv_grad_scale) {
  float p = x.master != nullptr ? x.master[i] : load_elem(x.param, x.param_type, i);
  adam_element(p, load_elem(x.grad, x.grad_type, i), static_cast<float*>(x.exp_avg)[i],
               static_cast<float*>(x.exp_avg_sq)[i],
               x.max_exp_avg_sq != nullptr ? x.max_exp_avg_sq + i : nullptr, s, inv_grad_scale);
  if (x.master != nullptr) x.master[i] = p;
  store_elem(x.param, x.param_type, i, p);
}

// One element of a tensor with bfloat16 moments (See Note [Compressed moments] in state_codec.h),
// element by element on the host. Its rounding is drawn for step x.step, which must be the settled
// step (See Note [Skipped steps]; the host kernel steps a copy with it settled, the CUDA kernel
// reads it once a block): a step found_inf skipped draws nothing, and a run resumed from a
// checkpoint (which saves settled counts) draws what the run that was not stopped drew.
STRATA_HD void adam_bf16_state_element(const AdamTensor& x, std::int64_t i, const AdamScalars& s,
                                       float inv_grad_scale) {
  auto* m16 = static_cast<std::uint16_t*>(x.exp_avg);
  auto* v16 = static_cast<std::uint16_t*>(x.exp_avg_sq);
  float p = x.master != nullptr ? x.master[i] : load_elem(x.param, x.param_type, i);
  float m = bf16_to_float(m16[i]), v = bf16_to_float(v16[i]);
  adam_element(p, load_elem(x.grad, x.grad_type, i), m, v, nullptr, s, inv_grad_scale);
  const std::uint32_t r = state_random_bits(x.seed, x.step, i);
  m16[i] = float_to_bf16_stochastic(m, r);
  v16[i] = float_to_bf16_stochastic(v, r >> 16);
  if (x.master != nullptr) x.master[i] = p;
  store_elem(x.param, x.param_type, i, p);
}

// An int8 moment's scales, after its codes.
STRATA_HD float* int8_scales(void* state, std::int64_t numel) {
  return reinterpret_cast<float*>(static_cast<std::uint8_t*>(state) +
                                  state_blocks(numel) * kStateBlock);
}

// Encodes element i's new moments against its block's new absmaxes (their inverse_scale), rounding
// for settled step t.
STRATA_HD void encode_int8_moments(const AdamTensor& x, std::int64_t i, std::int64_t t, float m,
                                   float v, float inverse_m, float inverse_v) {
  static_cast<std::uint8_t*>(x.exp_avg)[i] =
      encode_exp_avg(relative_to(m, inverse_m), state_random_bits(x.seed, t, i, 0));
  static_cast<std::uint8_t*>(x.exp_avg_sq)[i] =
      encode_exp_avg_sq(relative_to(v, inverse_v), state_random_bits(x.seed, t, i, 1));
}

// Splits the elements of all tensors over the pool's threads (nullptr: the calling thread only;
// See Note [Persistent host threads] in base/thread_pool.h). Deterministic: every element is
// computed the same way whatever the split. `s` gives the hyperparameters; each tensor's bias
// corrections come from its own step (settled_step).
void adam_step_cpu(const AdamTensor* tensors, std::size_t count, const AdamScalars& s,
                   float inv_grad_scale, ThreadPool* pool);

// Note [Bias corrections from the device]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The CUDA kernel takes its bias corrections from the device's powf, as torch's fused kernel does,
// so that its results are torch's bit for bit; the host's powf may round differently in the last
// place. Every other operation of the update is IEEE arithmetic written out the same way on both
// sides (explicit fused multiply-adds, and nothing the compiler may contract: See Note [No
// contraction] in adam_math.h), so a layer stepped on the host is bitwise the same layer stepped on
// the GPU once its bias corrections come from the device. adam_bias_corrections_cuda computes
// them there, with the same function the kernel calls, for the host kernel to read.
struct BiasRequest {
  AdamScalars scalars;  // lr, beta1 and beta2 as adam_scalars rounds them
  std::int64_t step;    // the settled step t
};
inline constexpr int kMaxBiasRequests = 64;
#ifdef STRATA_HAS_CUDA
// grad_scale and found_inf are device pointers or null: with found_inf != 0 nothing is updated (a
// mixed-precision step that overflowed) and each tensor's skipped count goes up by 1
// (See Note [Skipped steps]); gradients are divided by *grad_scale.
cudaError_t adam_step_cuda(const AdamTensor* tensors, std::size_t count, const AdamScalars& s,
                           const float* grad_scale, const float* found_inf, cudaStream_t stream);
// out[2i], out[2i + 1] = step_size and bias_correction2_sqrt of requests[i], by a kernel queued on
// `stream`, for count <= kMaxBiasRequests; `out` is device-accessible memory (pinned host memory).
cudaError_t adam_bias_corrections_cuda(const BiasRequest* requests, int count, float* out,
                                       cudaStream_t stream);
// dst[i] = *src[i] for each src[i] that is not null, by a kernel queued on `stream`: no copy engine
// takes part, so the read does not queue behind write-backs on the link
// (See Note [Reading the step's scalars] in adam_overlap.cpp). `dst` is device-accessible memory
// (pinned host memory).
cudaError_t adam_read_floats_cuda(const std::array<const float*, 3>& src, float* dst,
                                  cudaStream_t stream);
#endif

}  // namespace strata::optim
