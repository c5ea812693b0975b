// Kernels of overlap_gpu_test.cpp's small training loop (tests/optim/overlap_gpu_kernels.h): kept
// apart so that nvcc compiles no runtime headers.
#include "tests/optim/overlap_gpu_kernels.h"

#include <cuda_fp16.h>

namespace strata::optim::gpu_loop {
namespace {

// 0 float32, 1 bfloat16, 2 float16.
__device__ float load(const void* p, int type, std::size_t i) {
  if (type == 1) {
    const unsigned bits = static_cast<const unsigned short*>(p)[i];
    return __uint_as_float(bits << 16);
  }
  if (type == 2) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

__global__ void reset_act_kernel(float* act) { *act = 0.0f; }

__global__ void reset_norm_kernel(double* slots, int* non_finite) {
  for (int i = 0; i < kSlots; ++i) slots[i] = 0.0;
  *non_finite = 0;
}

// One thread, a fixed order: forward reads a sample of the layer's parameters.
__global__ void forward_kernel(const void* p, int type, std::size_t numel, float* act) {
  for (std::size_t i = 0; i < numel; i += 7 * (numel / 1024)) *act += load(p, type, i) * 1e-3f;
}

__global__ void backward_kernel(const void* p, int type, float* g, std::size_t numel, float boost,
                                int l, int micro, float ls, const float* act, bool inf) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < numel;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const float w = load(p, type, i);
    const float v =
        boost * (0.01f * static_cast<float>((i * 5 + l + micro) % 11) - 0.05f + 0.1f * w + *act);
    g[i] = (micro == 0 ? 0.0f : g[i]) + v * ls;
    if (inf && i == 3) g[i] = INFINITY;
  }
}

// One block of 256 threads: the tensor's part of the squared norm, reduced in a fixed order.
__global__ void norm_part_kernel(const float* g, std::size_t numel, float ls, double* slot,
                                 int* non_finite) {
  __shared__ double part[256];
  double sq = 0;
  bool bad = false;
  for (std::size_t i = threadIdx.x; i < numel; i += blockDim.x) {
    const double x = g[i] / ls;
    sq += x * x;
    bad |= !isfinite(g[i]);
  }
  part[threadIdx.x] = sq;
  if (bad) *non_finite = 1;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) *slot = part[0];
}

// grad_scale as bridge::GradientStats takes it: the loss scale over the clip coefficient.
__global__ void scales_kernel(const double* slots, float max_norm, float ls, const int* non_finite,
                              float* grad_scale, float* found_inf) {
  double sum = 0;
  for (int i = 0; i < kSlots; ++i) sum += slots[i];
  const float norm = static_cast<float>(sqrt(sum));
  const float coef = fminf(1.0f, max_norm / (norm + 1e-6f));
  *grad_scale = ls / coef;
  *found_inf = *non_finite ? 1.0f : 0.0f;
}

}  // namespace

void reset_act(cudaStream_t s, float* act) { reset_act_kernel<<<1, 1, 0, s>>>(act); }

void reset_norm(cudaStream_t s, double* slots, int* non_finite) {
  reset_norm_kernel<<<1, 1, 0, s>>>(slots, non_finite);
}

void forward(cudaStream_t s, const void* p, int type, std::size_t numel, float* act) {
  forward_kernel<<<1, 1, 0, s>>>(p, type, numel, act);
}

void backward(cudaStream_t s, const void* p, int type, float* g, std::size_t numel, float boost,
              int l, int micro, float ls, const float* act, bool inf) {
  backward_kernel<<<64, 256, 0, s>>>(p, type, g, numel, boost, l, micro, ls, act, inf);
}

void norm_part(cudaStream_t s, const float* g, std::size_t numel, float ls, double* slot,
               int* non_finite) {
  norm_part_kernel<<<1, 256, 0, s>>>(g, numel, ls, slot, non_finite);
}

void scales(cudaStream_t s, const double* slots, float max_norm, float ls, const int* non_finite,
            float* grad_scale, float* found_inf) {
  scales_kernel<<<1, 1, 0, s>>>(slots, max_norm, ls, non_finite, grad_scale, found_inf);
}

}  // namespace strata::optim::gpu_loop
