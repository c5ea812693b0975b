#include "tests/runtime/kernels.h"

namespace strata::testing {
namespace {

__global__ void add_scalar_kernel(float* p, std::size_t n, float value) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    p[i] += value;
  }
}

}  // namespace

cudaError_t add_scalar(float* p, std::size_t n, float value, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const std::size_t blocks = (n + 255) / 256;
  add_scalar_kernel<<<static_cast<unsigned>(blocks < 2048 ? blocks : 2048), 256, 0, stream>>>(
      p, n, value);
  return cudaGetLastError();
}

}  // namespace strata::testing
