// tests/optim/compressed_states_util.h: what the compressed-moment tests share (See Note
// [Compressed moments] in optim/state_codec.h): a moment's stored bytes, a block's absmax, and the
// most an encoding may be off.
//
//   EXPECT_LE(std::abs(got - x), bound(StateType::kI8, false, x, block_absmax(v, i), false));
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "optim/state_codec.h"

namespace strata::optim::test_util {

inline std::size_t stored_bytes(StateType type, std::int64_t numel) {
  return static_cast<std::size_t>(type == StateType::kI8
                                      ? int8_state_bytes(numel)
                                      : numel * (type == StateType::kBF16 ? 2 : 4));
}

inline float block_absmax(const std::vector<float>& v, std::size_t i) {
  const std::size_t b0 = i / kStateBlock * kStateBlock;
  float a = 0.0f;
  for (std::size_t k = b0; k < std::min(v.size(), b0 + kStateBlock); ++k) a = absmax_of(a, v[k]);
  return a;
}

// The most an encoding to nearest may be off: half a gap (1/16 of the value for int8, 2^-8 for
// bfloat16), or half the smallest step below the small-float range (relative to the block's
// absmax: 2^-18 for exp_avg, 2^-34 for exp_avg_sq); stochastic rounding doubles both. The slack
// covers the division by the absmax and the multiplication back, rounded once each.
inline double bound(StateType type, bool square, float x, float absmax, bool stochastic) {
  const double k = (stochastic ? 2.0 : 1.0) * (1.0 + 1e-6);
  if (type == StateType::kBF16) return k * std::abs(x) * std::exp2(-8.0);
  return k * (std::abs(x) / 16.0 + absmax * std::exp2(square ? -34.0 : -18.0));
}

}  // namespace strata::optim::test_util
