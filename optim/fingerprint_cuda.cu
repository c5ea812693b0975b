// The CUDA fingerprint (see optim/fingerprint.h): each thread sums a stride of the elements, each
// warp adds its threads' sums, and one atomic add a warp puts them in the output.
#include <algorithm>

#include "optim/fingerprint.h"

namespace strata::optim {
namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 1024;

template <typename Int>
__global__ void fingerprint_kernel(const Int* data, std::int64_t numel, std::int64_t* out) {
  long long sum = 0;
  unsigned long long mixed = 0;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    const long long v = data[i];
    sum += v;
    mixed += static_cast<unsigned long long>(v) * fingerprint_weight(i);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    sum += __shfl_down_sync(0xffffffffu, sum, offset);
    mixed += __shfl_down_sync(0xffffffffu, mixed, offset);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(out), static_cast<unsigned long long>(sum));
    atomicAdd(reinterpret_cast<unsigned long long*>(out + 1), mixed);
  }
}

}  // namespace

cudaError_t fingerprint_cuda(const void* data, std::int64_t numel, int elem_bytes,
                             std::int64_t* out, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>(
      std::clamp<std::int64_t>((numel + kThreads - 1) / kThreads, 1, kMaxBlocks));
  if (elem_bytes == 2) {
    fingerprint_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const short*>(data), numel,
                                                        out);
  } else {
    fingerprint_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const int*>(data), numel, out);
  }
  return cudaGetLastError();
}

}  // namespace strata::optim
