// optim/state_codec.h: how Adam's moments are stored when they are compressed (state_dtype
// bfloat16 or int8), shared by the host kernel and the CUDA kernel so both give the same bits.
// Plain C++ (no Abseil) so .cu files can include it.
//
// Note [Compressed moments]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Offloading is bound by the bytes that cross the link, and float32 moments are 8 of them a
// parameter each way. state_dtype stores exp_avg and exp_avg_sq smaller, on every tier and on the
// link; the kernel decodes them, steps in float32 exactly as for float32 moments (the parameter's
// update uses the moments before they are rounded), and encodes them again. Masters stay float32.
//   - bfloat16: 2 bytes a moment, the float32 value's top half.
//   - int8: 1 byte a moment plus one float32 scale per block of kStateBlock = 256 elements
//     (1.016 bytes a moment). A block's scale is its largest magnitude (absmax): its largest
//     element is stored as 1 and the others relative to it (multiplied by the absmax's reciprocal,
//     one division a block; the largest comes out within an ulp of 1 and rounds to it). 256 keeps
//     an outlier from crushing more than one row piece of a weight matrix, and costs 1.6% in
//     scales; it is also eight elements for each lane of a GPU warp, so a block's absmax is a
//     warp's reduction by shuffles, and a multiple of 16, so host threads split tensors on cache
//     lines.
//   - The int8 map is a small float of the value divided by its block's absmax (a number in
//     [0, 1]): exp_avg, which is signed, takes a sign bit and 4 exponent and 3 mantissa bits
//     (2^-17 to 1); exp_avg_sq, never negative, takes 5 exponent and 3 mantissa bits (2^-33 to 1,
//     twice the range, as it is a square). The relative gap between codes is 1/8 at every scale, as
//     the dynamic map of 8-bit Adam (Dettmers et al.) keeps small values from flushing to zero;
//     a float map needs no table and no search, only bit operations, so the host loop vectorizes.
//     A nonzero exp_avg_sq never rounds to zero: the update divides by its square root, and a
//     moment of zero beside a nonzero exp_avg would step by exp_avg / eps.
//   - Rounding is stochastic, not to nearest. A moment moves by (1 - beta) of itself a step:
//     1e-3 for exp_avg_sq at beta2 = 0.999, below half a bfloat16 gap (2^-9) and far below half an
//     int8 one (1/16). Rounded to nearest, a moment that should decay stays where it is forever
//     (the int8 block's scale follows a decay common to the block, but not one element's own).
//     Rounded up with probability equal to the distance covered, it moves by the right amount on
//     average.
//   - The random bits are a hash of (the parameter's name, the step, the element), not a
//     generator's state: the host kernel and the CUDA kernel draw the same bits for an element, so
//     a layer stepped on the host is bitwise the layer stepped on the GPU; a step redone after
//     speculation draws them again; and a run resumed from a checkpoint (which holds the step
//     counts) repeats the run that was not stopped.
//   - Encoding a value that decoding gave is exact (the block's absmax element decodes to the
//     scale itself, and every other value sits on a code, within the ulps of the multiplications
//     of a gap of 1/8), and is rounded to nearest rather than
//     stochastically: a state dict (float32 moments, torch's format) loads back into the same
//     bytes, and a float32 state from torch loads as the nearest codes.
//
// Example:
//   std::uint32_t r = state_random_bits(seed, step, i);
//   std::uint8_t code = encode_exp_avg(relative_to(m, inverse_scale(absmax)), r);
//   float back = decode_exp_avg(code) * absmax;
#pragma once

#include <cstdint>

#include "optim/adam_math.h"

namespace strata::optim {

// How the moments are stored (See Note [Compressed moments]).
enum class StateType : std::uint8_t { kF32, kBF16, kI8 };

inline constexpr std::int64_t kStateBlock = 256;

// Elements of an int8 moment padded to whole blocks, and the bytes of its tensor: the codes, then
// one float32 scale per block.
STRATA_HD std::int64_t state_blocks(std::int64_t numel) {
  return (numel + kStateBlock - 1) / kStateBlock;
}
STRATA_HD std::int64_t int8_state_bytes(std::int64_t numel) {
  return state_blocks(numel) * (kStateBlock + static_cast<std::int64_t>(sizeof(float)));
}

// 32 random bits for element i of a tensor keyed `seed`, at step `step`, from stream 0 or 1 (two
// independent draws: exp_avg's and exp_avg_sq's): murmur3's 32-bit finalizer over a combination of
// the four. 32-bit multiplies only, which the GPU issues at full rate and AVX2 vectorizes. The
// combination is an exclusive or of the index's low word's part and a key of everything else
// (state_key), so a kernel computes the key once for a run of elements that share their high word
// (a block of moments does: 2^32 is a multiple of kStateBlock) and mixes each element's low word
// into it (state_mix).
STRATA_HD std::uint32_t state_key(std::uint32_t seed, std::int64_t step, std::uint32_t high,
                                  std::uint32_t stream) {
  return (high * 0x27D4EB2Fu) ^
         (static_cast<std::uint32_t>(step) * 0x85EBCA77u + seed + stream * 0x68E31DA4u);
}
STRATA_HD std::uint32_t state_mix(std::uint32_t low, std::uint32_t key) {
  std::uint32_t h = (low * 0x9E3779B1u) ^ key;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}
STRATA_HD std::uint32_t state_random_bits(std::uint32_t seed, std::int64_t step, std::int64_t i,
                                          std::uint32_t stream = 0) {
  const auto u = static_cast<std::uint64_t>(i);
  return state_mix(static_cast<std::uint32_t>(u),
                   state_key(seed, step, static_cast<std::uint32_t>(u >> 32), stream));
}

// A tensor's key from its parameter's name (FNV-1a), the same in every run.
inline std::uint32_t state_seed(const char* name, std::uint64_t length) {
  std::uint32_t h = 2166136261u;
  for (std::uint64_t k = 0; k < length; ++k) {
    h = (h ^ static_cast<unsigned char>(name[k])) * 16777619u;
  }
  return h;
}

// The functions below compute every case and select among them, with no branch: the host loops
// then vectorize (See Note [The host kernel's loops] in adam_cpu.cpp).

// float32 to bfloat16, rounded up with probability equal to the part dropped (r: 16 random bits;
// 0x8000 rounds to nearest, ties away from zero). NaN becomes the quiet NaN; infinities stay.
STRATA_HD std::uint16_t float_to_bf16_stochastic(float f, std::uint32_t r) {
  const std::uint32_t u = float_bits(f);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  const bool inf = (u & 0x7fffffffu) == 0x7f800000u;
  const std::uint32_t rounded = (u + (r & 0xffffu)) >> 16;
  return static_cast<std::uint16_t>(nan ? 0x7fc0u : (inf ? u >> 16 : rounded));
}

// The magnitude code of x in [0, 1] in a float of E exponent and M mantissa bits whose largest
// exponent is 2^0 (so 1.0 is its largest value used), rounded up with probability equal to the
// distance covered (r: 32 random bits; kNearest rounds to nearest).
inline constexpr std::uint32_t kNearest = 0x80000000u;
template <int E, int M>
STRATA_HD std::uint32_t encode_magnitude(float x, std::uint32_t r) {
  constexpr int kBias = (1 << E) - 1;
  constexpr std::uint32_t kDrop = 23 - M;
  const std::uint32_t u = float_bits(x);
  const bool normal = static_cast<int>(u >> 23) >= 128 - kBias;
  // A normal code: M mantissa bits kept.
  const std::uint32_t kept = (u + (r >> (32 - kDrop))) & ~((1u << kDrop) - 1u);
  const std::uint32_t as_normal =
      (((kept >> 23) - 127u + kBias) << M) | ((kept >> kDrop) & ((1u << M) - 1u));
  // Below the smallest normal code: a multiple of 2^(1 - kBias - M), in fixed point with 20 bits
  // of fraction (x * 2^(kBias + M - 1 + 20) < 2^(M + 20), exact: a power of two; a normal x is
  // left out, so that nothing overflows).
  const float scaled =
      (normal ? 0.0f : x) * bits_float(static_cast<std::uint32_t>(127 + kBias + M + 19) << 23);
  const auto k = static_cast<std::uint32_t>(static_cast<std::int32_t>(scaled));
  const std::uint32_t as_small = (k + (r >> 12)) >> 20;
  return normal ? as_normal : as_small;
}

template <int E, int M>
STRATA_HD float decode_magnitude(std::uint32_t c) {
  constexpr int kBias = (1 << E) - 1;
  const std::uint32_t e = c >> M;
  const std::uint32_t f = c & ((1u << M) - 1u);
  const float as_small = static_cast<float>(static_cast<std::int32_t>(f)) *
                         bits_float(static_cast<std::uint32_t>(127 + 1 - kBias - M) << 23);
  const float as_normal = bits_float(((e + 127u - kBias) << 23) | (f << (23 - M)));
  return e == 0 ? as_small : as_normal;
}

// exp_avg divided by its block's absmax (in [-1, 1]): a sign bit and an E4M3 magnitude.
STRATA_HD std::uint8_t encode_exp_avg(float y, std::uint32_t r) {
  const std::uint32_t sign = float_bits(y) >> 31;
  const std::uint32_t mag = encode_magnitude<4, 3>(bits_float(float_bits(y) & 0x7fffffffu), r);
  return static_cast<std::uint8_t>(mag == 0 ? 0 : (sign << 7) | mag);
}
STRATA_HD float decode_exp_avg(std::uint8_t c) {
  const float mag = decode_magnitude<4, 3>(c & 0x7fu);
  return bits_float(float_bits(mag) | (static_cast<std::uint32_t>(c & 0x80u) << 24));
}

// exp_avg_sq divided by its block's absmax (in [0, 1]): an E5M3 magnitude, never zero for a
// nonzero value (See Note [Compressed moments]).
STRATA_HD std::uint8_t encode_exp_avg_sq(float y, std::uint32_t r) {
  const std::uint32_t mag = encode_magnitude<5, 3>(y, r);
  return static_cast<std::uint8_t>(mag == 0 && y > 0.0f ? 1u : mag);
}
STRATA_HD float decode_exp_avg_sq(std::uint8_t c) { return decode_magnitude<5, 3>(c); }

// The larger magnitude, NaN winning wherever it appears, so a block's absmax is the same in any
// order of reduction.
STRATA_HD float absmax_of(float a, float b) {
  const float x = fabsf(b);
  return (x > a || x != x) ? x : a;
}

// What a block's values are multiplied by to encode them: 1 / absmax (one division a block, not
// one a value), 0 for an all-zero block.
STRATA_HD float inverse_scale(float absmax) { return absmax == 0.0f ? 0.0f : 1.0f / absmax; }

// value * inverse, within [-1, 1]: the block's absmax element may come out an ulp above 1.
STRATA_HD float relative_to(float value, float inverse) {
  const float y = value * inverse;
  return y > 1.0f ? 1.0f : (y < -1.0f ? -1.0f : y);
}

// A whole moment of `numel` elements between its stored form (`type`; square: exp_avg_sq's map,
// else exp_avg's) and float32 values, on the host: decoding is exact, and encoding rounds to
// nearest (See Note [Compressed moments]). float32 is copied.
void decode_moment(StateType type, bool square, const void* stored, std::int64_t numel, float* out);
void encode_moment(StateType type, bool square, const float* values, std::int64_t numel,
                   void* stored);

}  // namespace strata::optim
