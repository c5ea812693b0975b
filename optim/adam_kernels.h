// optim/adam_kernels.h: Adam / AdamW over lists of fp32 tensors, on the CPU and on the GPU.
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
//   AdamScalars s = adam_scalars(hyper, step);
//   adam_step_cpu(&t, 1, s, /*inv_grad_scale=*/1.0f, /*threads=*/8);
//   cudaError_t err = adam_step_cuda(&t, 1, s, grad_scale_dev, found_inf_dev, stream);
#pragma once

#include <cstddef>
#include <cstdint>

#include "optim/adam_math.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::optim {

struct AdamTensor {
  float* param = nullptr;
  const float* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* max_exp_avg_sq = nullptr;  // amsgrad only
  std::int64_t numel = 0;
};

// Splits the elements of all tensors over `threads` host threads (1: the calling thread only).
// Deterministic: every element is computed the same way whatever the split.
void adam_step_cpu(const AdamTensor* tensors, std::size_t count, const AdamScalars& s,
                   float inv_grad_scale, int threads);

#ifdef STRATA_HAS_CUDA
// grad_scale and found_inf are device pointers or null: with found_inf != 0 nothing is updated
// (a mixed-precision step that overflowed), and gradients are divided by *grad_scale.
cudaError_t adam_step_cuda(const AdamTensor* tensors, std::size_t count, const AdamScalars& s,
                           const float* grad_scale, const float* found_inf, cudaStream_t stream);
#endif

}  // namespace strata::optim
