#include "tests/allocator/pattern.h"

namespace strata::testing {
namespace {

__host__ __device__ inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Byte i of the pattern is byte (i % 8) of mix(seed ^ (i / 8)).
__host__ __device__ inline std::uint8_t byte_at(std::uint64_t seed, std::size_t i) {
  return static_cast<std::uint8_t>(mix(seed ^ (i / 8)) >> (8 * (i % 8)));
}

__global__ void fill_kernel(std::uint8_t* dst, std::size_t bytes, std::uint64_t seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < bytes;
       i += stride) {
    dst[i] = byte_at(seed, i);
  }
}

__global__ void count_kernel(const std::uint8_t* src, std::size_t bytes, std::uint64_t seed,
                             unsigned long long* count) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  unsigned long long local = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < bytes;
       i += stride) {
    local += src[i] != byte_at(seed, i);
  }
  if (local != 0) atomicAdd(count, local);
}

__global__ void write_byte_kernel(std::uint8_t* dst, std::size_t offset, std::uint8_t value) {
  dst[offset] = value;
}

unsigned grid_for(std::size_t bytes) {
  const std::size_t blocks = (bytes + 255) / 256;
  return static_cast<unsigned>(blocks < 4096 ? (blocks == 0 ? 1 : blocks) : 4096);
}

}  // namespace

std::uint8_t pattern_byte(std::uint64_t seed, std::size_t offset) { return byte_at(seed, offset); }

cudaError_t fill_pattern(void* dst, std::size_t bytes, std::uint64_t seed, cudaStream_t stream) {
  fill_kernel<<<grid_for(bytes), 256, 0, stream>>>(static_cast<std::uint8_t*>(dst), bytes, seed);
  return cudaGetLastError();
}

cudaError_t count_mismatches(const void* src, std::size_t bytes, std::uint64_t seed,
                             unsigned long long* device_count, cudaStream_t stream) {
  count_kernel<<<grid_for(bytes), 256, 0, stream>>>(static_cast<const std::uint8_t*>(src), bytes,
                                                    seed, device_count);
  return cudaGetLastError();
}

cudaError_t write_byte(void* dst, std::size_t offset, std::uint8_t value, cudaStream_t stream) {
  write_byte_kernel<<<1, 1, 0, stream>>>(static_cast<std::uint8_t*>(dst), offset, value);
  return cudaGetLastError();
}

}  // namespace strata::testing
