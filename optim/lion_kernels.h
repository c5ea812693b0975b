// optim/lion_kernels.h: Lion (lion_math.h) over lists of tensors, on the host and on the GPU:
// float32 momentum, float32, bfloat16 or float16 parameters (a low-precision one through its
// float32 master copy) and gradients. A StepTensor's states[0] is the momentum.
//
// Example:
//   StepTensor t;
//   t.param = p; t.grad = g; t.states[0] = m; t.numel = n;
//   lion_step_cpu(&t, 1, lion_scalars(hyper), /*inv_grad_scale=*/1.0f, &pool);
//   cudaError_t err = lion_step_cuda(&t, 1, lion_scalars(hyper), grad_scale, found_inf, stream);
#pragma once

#include <cstddef>

#include "base/thread_pool.h"
#include "optim/lion_math.h"
#include "optim/step_tensor.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::optim {

// Splits the elements of all tensors over the pool's threads (nullptr: this thread);
// deterministic whatever the split.
void lion_step_cpu(const StepTensor* tensors, std::size_t count, const LionScalars& s,
                   float inv_grad_scale, ThreadPool* pool);
#ifdef STRATA_HAS_CUDA
// grad_scale and found_inf are device pointers or null: with found_inf != 0 nothing is updated and
// each tensor's skipped count goes up by 1 (See Note [Skipped steps] in adam_kernels.h).
cudaError_t lion_step_cuda(const StepTensor* tensors, std::size_t count, const LionScalars& s,
                           const float* grad_scale, const float* found_inf, cudaStream_t stream);
#endif

}  // namespace strata::optim
