#include "optim/state_codec.h"

#include <algorithm>
#include <cstring>

namespace strata::optim {

void decode_moment(StateType type, bool square, const void* stored, std::int64_t numel,
                   float* out) {
  if (type == StateType::kF32) {
    std::memcpy(out, stored, static_cast<std::size_t>(numel) * sizeof(float));
    return;
  }
  if (type == StateType::kBF16) {
    const auto* in = static_cast<const std::uint16_t*>(stored);
    for (std::int64_t i = 0; i < numel; ++i) out[i] = bf16_to_float(in[i]);
    return;
  }
  const auto* codes = static_cast<const std::uint8_t*>(stored);
  const auto* scales = reinterpret_cast<const float*>(codes + state_blocks(numel) * kStateBlock);
  for (std::int64_t i = 0; i < numel; ++i) {
    const float scale = scales[i / kStateBlock];
    out[i] = (square ? decode_exp_avg_sq(codes[i]) : decode_exp_avg(codes[i])) * scale;
  }
}

void encode_moment(StateType type, bool square, const float* values, std::int64_t numel,
                   void* stored) {
  if (type == StateType::kF32) {
    std::memcpy(stored, values, static_cast<std::size_t>(numel) * sizeof(float));
    return;
  }
  if (type == StateType::kBF16) {
    auto* out = static_cast<std::uint16_t*>(stored);
    for (std::int64_t i = 0; i < numel; ++i) out[i] = float_to_bf16_stochastic(values[i], 0x8000u);
    return;
  }
  auto* codes = static_cast<std::uint8_t*>(stored);
  auto* scales = reinterpret_cast<float*>(codes + state_blocks(numel) * kStateBlock);
  for (std::int64_t block = 0; block < state_blocks(numel); ++block) {
    const std::int64_t b0 = block * kStateBlock;
    const std::int64_t n = std::min(kStateBlock, numel - b0);
    float absmax = 0.0f;
    for (std::int64_t k = 0; k < n; ++k) absmax = absmax_of(absmax, values[b0 + k]);
    const float inverse = inverse_scale(absmax);
    for (std::int64_t k = 0; k < kStateBlock; ++k) {
      const float y = k < n ? relative_to(values[b0 + k], inverse) : 0.0f;
      codes[b0 + k] = square ? encode_exp_avg_sq(y, kNearest) : encode_exp_avg(y, kNearest);
    }
    scales[block] = absmax;
  }
}

}  // namespace strata::optim
