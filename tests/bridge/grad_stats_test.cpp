// GradientStats' inf/NaN check (See Note [Opt-in inf check] in bridge/grad_stats.h): taken only
// when asked for, it flags inf and NaN elements, in float32 and half-precision gradients, and not a
// finite gradient whose float32 norm overflows. On the CPU.
#include <cmath>
#include <limits>

#include "bridge/grad_stats.h"
#include "gtest/gtest.h"
#include "torch/torch.h"

namespace strata::bridge {
namespace {

// found_inf over one layer holding `bad` among ordinary values, in `dtype`.
float found_inf_of(float bad, torch::ScalarType dtype) {
  GradientStats stats;
  stats.set_check_non_finite(true);
  const torch::Tensor g = torch::tensor({1.0f, bad, -2.0f}).to(dtype);
  stats.add_layer(0, {torch::ones({4}, dtype), g});
  return stats.found_inf().item<float>();
}

TEST(GradientStatsTest, FoundInfFlagsInfAndNanButNotAnOverflowingNorm) {
  for (torch::ScalarType dtype : {torch::kFloat, torch::kBFloat16}) {
    EXPECT_EQ(found_inf_of(std::numeric_limits<float>::infinity(), dtype), 1.0f) << dtype;
    EXPECT_EQ(found_inf_of(-std::numeric_limits<float>::infinity(), dtype), 1.0f) << dtype;
    EXPECT_EQ(found_inf_of(std::numeric_limits<float>::quiet_NaN(), dtype), 1.0f) << dtype;
    EXPECT_EQ(found_inf_of(3.0f, dtype), 0.0f) << dtype;
    // Finite, but its square passes float32's range: the norm is inf, the gradient is not.
    EXPECT_EQ(found_inf_of(1e20f, dtype), 0.0f) << dtype;
  }
  GradientStats stats;
  stats.add_layer(0, {torch::tensor({1.0f, 1e20f})});
  EXPECT_TRUE(std::isinf(stats.total_norm().item<float>()));
}

TEST(GradientStatsTest, TheCheckIsTakenForEveryLayerOnceAskedFor) {
  GradientStats stats;
  stats.set_check_non_finite(true);
  stats.add_layer(1, {torch::ones({2})});
  stats.add_layer(0, {torch::tensor({std::numeric_limits<float>::infinity()})});
  EXPECT_EQ(stats.found_inf().item<float>(), 1.0f);
  stats.reset();  // the setting outlives the step
  stats.add_layer(0, {torch::ones({2})});
  EXPECT_EQ(stats.found_inf().item<float>(), 0.0f);
}

}  // namespace
}  // namespace strata::bridge
