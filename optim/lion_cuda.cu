// The CUDA Lion kernel (see optim/lion_kernels.h): one launch per tensor, each thread a stride of
// its elements. Compiled with -fmad=false (See Note [No contraction] in adam_math.h), so its bits
// are the host kernel's.
#include <algorithm>

#include "optim/lion_kernels.h"

namespace strata::optim {
namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 4096;

__global__ void lion_kernel(StepTensor x, LionScalars s, const float* grad_scale,
                            const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) {
    // One count per tensor and skipped step (See Note [Skipped steps] in adam_kernels.h).
    if (blockIdx.x == 0 && threadIdx.x == 0 && x.skipped != nullptr) ++*x.skipped;
    return;
  }
  const float inv = grad_scale != nullptr ? 1.0f / *grad_scale : 1.0f;
  float* m = static_cast<float*>(x.states[0]);
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < x.numel; i += stride) {
    float p = x.master != nullptr ? x.master[i] : load_elem(x.param, x.param_type, i);
    float mi = m[i];
    lion_element(p, load_elem(x.grad, x.grad_type, i), mi, s, inv);
    m[i] = mi;
    if (x.master != nullptr) x.master[i] = p;
    store_elem(x.param, x.param_type, i, p);
  }
}

}  // namespace

cudaError_t lion_step_cuda(const StepTensor* tensors, std::size_t count, const LionScalars& s,
                           const float* grad_scale, const float* found_inf, cudaStream_t stream) {
  for (std::size_t t = 0; t < count; ++t) {
    const StepTensor& x = tensors[t];
    // An empty tensor still counts a skipped step.
    if (x.numel == 0 && x.skipped == nullptr) continue;
    const std::int64_t blocks =
        std::clamp<std::int64_t>((x.numel + kThreads - 1) / kThreads, 1, kMaxBlocks);
    lion_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, s, grad_scale,
                                                                        found_inf);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace strata::optim
