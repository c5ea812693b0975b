// tests/runtime/kernels.h: a stand-in optimizer kernel for the runtime's GPU tests.
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

namespace strata::testing {

// p[i] += value for i < n, on `stream`.
cudaError_t add_scalar(float* p, std::size_t n, float value, cudaStream_t stream);

}  // namespace strata::testing
