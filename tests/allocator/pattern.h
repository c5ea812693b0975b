// tests/allocator/pattern.h: device kernels that fill memory with a seeded pseudo-random pattern
// and count bytes that differ from it, so GPU tests can check every byte of large blocks quickly.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace strata::testing {

// The byte at `offset` of the pattern for `seed` (host side, for spot checks).
std::uint8_t pattern_byte(std::uint64_t seed, std::size_t offset);

// dst: device-accessible memory of `bytes`.
cudaError_t fill_pattern(void* dst, std::size_t bytes, std::uint64_t seed, cudaStream_t stream);

// Adds the number of bytes of src that differ from the pattern to *device_count.
cudaError_t count_mismatches(const void* src, std::size_t bytes, std::uint64_t seed,
                             unsigned long long* device_count, cudaStream_t stream);

// Writes one byte at dst + offset from the device.
cudaError_t write_byte(void* dst, std::size_t offset, std::uint8_t value, cudaStream_t stream);

}  // namespace strata::testing
