// optim/fingerprint.h: a gradient's fingerprint, two integers that change when any of its elements
// does; a step taken in backward keeps the fingerprints of the gradients it read, so that step()
// can tell a loop that rewrote a gradient with its own values (clip_grad_norm_ that did not clip)
// from one that changed it (See Note [Gradient fingerprints]).
//
// Note [Gradient fingerprints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each element's bits are read as a signed integer of its width (2 or 4 bytes). For a finite float,
// that integer grows with the magnitude on either sign (a negative float's is its magnitude minus
// 2^(bits-1)), and rounding is monotone, so scaling finite values by any c in [0, 1] (or in
// [1, inf)) moves every element's integer the same way or not at all: their sum, taken exactly in
// 64 bits (no overflow below 2^32 elements), differs unless no element changed. That is what
// torch.nn.utils.clip_grad_norm_ does in place (by exactly 1.0 when the norm is below max_norm),
// and GradScaler's unscale_. For any other change (and for NaN, whose bits a multiplication may
// change without changing the value, which costs a redo, never a wrong step), a second sum weights
// each integer by an odd constant of its index, modulo 2^64: a change escapes both only if it
// happens to leave both sums as they were. Integer sums do not depend on the order they are added
// in, so any split over threads gives the same fingerprint.
//
// Example (a gradient of n float32 elements):
//   std::int64_t before[2] = {0, 0};
//   fingerprint_cpu(grad, n, 4, before);
//   ...the loop's clip_grad_norm_...
//   std::int64_t after[2] = {0, 0};
//   fingerprint_cpu(grad, n, 4, after);
//   bool changed = before[0] != after[0] || before[1] != after[1];
#pragma once

#include <cstdint>

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::optim {

// The most elements a fingerprint's exact sum takes (See Note [Gradient fingerprints]).
inline constexpr std::int64_t kMaxFingerprintElements = std::int64_t{1} << 32;

// Adds the fingerprint of `numel` elements of `elem_bytes` (2 or 4) bytes at `data` to out[0] and
// out[1].
void fingerprint_cpu(const void* data, std::int64_t numel, int elem_bytes, std::int64_t out[2]);

#ifdef STRATA_HAS_CUDA
// The same on `stream`, added to out[0] and out[1] in device memory.
cudaError_t fingerprint_cuda(const void* data, std::int64_t numel, int elem_bytes,
                             std::int64_t* out, cudaStream_t stream);
#endif

// The weight of element i in the second sum (odd, so that no element's change is lost modulo 2^64).
#if defined(__CUDACC__)
#define STRATA_FINGERPRINT_HD __host__ __device__
#else
#define STRATA_FINGERPRINT_HD
#endif
inline STRATA_FINGERPRINT_HD std::uint64_t fingerprint_weight(std::int64_t i) {
  return (static_cast<std::uint64_t>(i) * 0x9E3779B97F4A7C15ull) | 1ull;
}

}  // namespace strata::optim
