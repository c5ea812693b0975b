// Compressed moments' encodings (See Note [Compressed moments] in optim/state_codec.h): the int8
// and bfloat16 encodings' round-trip error within their bounds, decoded moments encoding back to
// the same bytes, the random bits the same in every version, and stochastic rounding unbiased and
// picking a neighbour only.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <vector>

#include "gtest/gtest.h"
#include "optim/state_codec.h"
#include "tests/optim/compressed_states_util.h"

namespace strata::optim {
namespace {

using test_util::block_absmax;
using test_util::bound;
using test_util::stored_bytes;

// Values over 20 binades, both signs (square: non-negative), with exact zeros here and there.
std::vector<float> spread(std::size_t n, std::uint64_t seed, bool square) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> e(-20.0f, 0.0f);
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float x = std::exp2(e(rng));
    out[i] = rng() % 37 == 0 ? 0.0f : (square || rng() % 2 ? x : -x);
  }
  return out;
}

TEST(CompressedStatesTest, EncodingToNearestIsWithinHalfAGap) {
  for (StateType type : {StateType::kBF16, StateType::kI8}) {
    for (bool square : {false, true}) {
      for (std::int64_t n : {1, 255, 256, 257, 5000}) {
        const std::vector<float> x = spread(static_cast<std::size_t>(n), n, square);
        std::vector<unsigned char> stored(stored_bytes(type, n));
        std::vector<float> back(x.size());
        encode_moment(type, square, x.data(), n, stored.data());
        decode_moment(type, square, stored.data(), n, back.data());
        for (std::size_t i = 0; i < x.size(); ++i) {
          const float absmax = block_absmax(x, i);
          ASSERT_LE(std::abs(back[i] - x[i]), bound(type, square, x[i], absmax, false))
              << "type " << static_cast<int>(type) << " square " << square << " n " << n << " i "
              << i << " x " << x[i];
          if (square && x[i] > 0.0f) {
            ASSERT_GT(back[i], 0.0f) << "a nonzero exp_avg_sq never decodes to zero";
          }
          if (x[i] == 0.0f) {
            ASSERT_EQ(back[i], 0.0f);
          }
        }
        // Decoded values encode back to the same bytes.
        std::vector<unsigned char> again(stored.size());
        encode_moment(type, square, back.data(), n, again.data());
        ASSERT_EQ(again, stored) << "type " << static_cast<int>(type) << " square " << square;
      }
    }
  }
}

// The random bits are part of what a checkpoint resumes (See Note [Compressed moments]): these
// values were drawn before the hash was split into a key a block and a mix an element, and every
// later version must draw them again; state_key and state_mix compose to the same function.
TEST(CompressedStatesTest, TheRandomBitsAreTheSameInEveryVersion) {
  struct Draw {
    std::uint32_t seed;
    std::int64_t step, i;
    std::uint32_t stream, bits;
  };
  constexpr Draw kDraws[] = {{0u, 1, 0, 0, 0x9BB31115u},
                             {305441741u, 7, 255, 1, 0x60430815u},
                             {42u, 1000, 70001, 0, 0x287E3A00u},
                             {42u, 1000, 70001, 1, 0x595CB7A7u},
                             {3735928559u, 3, (std::int64_t{1} << 32) + 5, 0, 0x3EE9AB99u},
                             {3735928559u, 3, (std::int64_t{1} << 33) + 511, 1, 0xC619430Fu}};
  for (const Draw& d : kDraws) {
    EXPECT_EQ(state_random_bits(d.seed, d.step, d.i, d.stream), d.bits) << d.i;
    const auto u = static_cast<std::uint64_t>(d.i);
    EXPECT_EQ(state_mix(static_cast<std::uint32_t>(u),
                        state_key(d.seed, d.step, static_cast<std::uint32_t>(u >> 32), d.stream)),
              d.bits);
  }
}

TEST(CompressedStatesTest, StochasticRoundingPicksANeighbourAndIsUnbiased) {
  constexpr int kDraws = 40000;
  std::mt19937_64 rng(5);
  // int8: values between codes, across the normal and the small range, both maps.
  for (float y : {0.7f, 0.3141f, 0.01f, 3.0e-5f, 2.0e-6f}) {
    for (bool square : {false, true}) {
      const std::uint32_t down = square ? encode_exp_avg_sq(y, 0) : encode_exp_avg(y, 0);
      const float lo = square ? decode_exp_avg_sq(down) : decode_exp_avg(down);
      const float hi = square ? decode_exp_avg_sq(down + 1) : decode_exp_avg(down + 1);
      ASSERT_LE(lo, y);
      ASSERT_GT(hi, y);
      double sum = 0;
      for (int d = 0; d < kDraws; ++d) {
        const auto r = static_cast<std::uint32_t>(rng());
        const float got = square ? decode_exp_avg_sq(encode_exp_avg_sq(y, r))
                                 : decode_exp_avg(encode_exp_avg(y, r));
        ASSERT_TRUE(got == lo || got == hi) << y;
        sum += got;
      }
      // The mean's standard error is at most half a gap over sqrt(kDraws).
      EXPECT_NEAR(sum / kDraws, y, 4 * (hi - lo) / (2 * std::sqrt(kDraws))) << y << " " << square;
    }
  }
  // bfloat16.
  for (float y : {0.2497f, -1.0e-3f, 3.3e-9f}) {
    const float lo = bf16_to_float(float_to_bf16_stochastic(y, 0));
    const float hi = bf16_to_float(float_to_bf16_stochastic(y, 0xffff));
    double sum = 0;
    for (int d = 0; d < kDraws; ++d) {
      const float got =
          bf16_to_float(float_to_bf16_stochastic(y, static_cast<std::uint32_t>(rng())));
      ASSERT_TRUE(got == lo || got == hi) << y;
      sum += got;
    }
    EXPECT_NEAR(sum / kDraws, y, 4 * std::abs(hi - lo) / (2 * std::sqrt(kDraws))) << y;
  }
}

}  // namespace
}  // namespace strata::optim
