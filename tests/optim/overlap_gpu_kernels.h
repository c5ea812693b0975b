// tests/optim/overlap_gpu_kernels.h: forward and backward of overlap_gpu_test.cpp's small training
// loop as CUDA kernels on a stream: each layer's gradients from its parameters, their part of the
// squared norm reduced in a fixed order (both runs of a comparison must see the same bits), and the
// grad_scale / found_inf scalars the optimizer reads.
//
// Example:
//   gpu_loop::backward(stream, param, /*type=*/1, grad, n, 1.0f, layer, 0, 1.0f, act, false);
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace strata::optim::gpu_loop {

inline constexpr int kSlots = 8;  // tensors whose norm parts are summed: layers x tensors

// Parameter types: 0 float32, 1 bfloat16, 2 float16.
void reset_act(cudaStream_t s, float* act);
void reset_norm(cudaStream_t s, double* slots, int* non_finite);
// act += a sample of the parameters, one thread, a fixed order.
void forward(cudaStream_t s, const void* p, int type, std::size_t numel, float* act);
// g = (micro == 0 ? 0 : g) + ls * boost * f(i, l, micro, p[i], act); g[3] = inf when asked.
void backward(cudaStream_t s, const void* p, int type, float* g, std::size_t numel, float boost,
              int l, int micro, float ls, const float* act, bool inf);
// *slot = sum of (g / ls)^2; *non_finite = 1 if any g is not finite.
void norm_part(cudaStream_t s, const float* g, std::size_t numel, float ls, double* slot,
               int* non_finite);
// grad_scale = ls / min(1, max_norm / (norm + 1e-6)); found_inf = non_finite.
void scales(cudaStream_t s, const double* slots, float max_norm, float ls, const int* non_finite,
            float* grad_scale, float* found_inf);

}  // namespace strata::optim::gpu_loop
