// The hybrid policy's cost model (See Note [Hybrid cost model] in policies/step_cost_model.h):
// each component of a prediction against the formula worked out here, the link when the two
// directions carry different bytes and while the host kernel runs, the split chosen for fast, slow
// and balanced hosts, forced fractions, the order in which layers go to the host, and the inputs
// refused.
#include "policies/step_cost_model.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace strata::policy {
namespace {

constexpr std::int64_t kM = 1'000'000;

// Rates with distinct figures for each direction, so that a formula using the wrong one fails.
StepRates rates() {
  StepRates r;
  r.link_h2d_gbps = 50;
  r.link_d2h_gbps = 40;
  r.link_both_gbps = 30;
  r.host_params_per_s = 2e9;
  r.link_h2d_loaded_gbps = 20;
  r.link_d2h_loaded_gbps = 25;
  r.gpu_params_per_s = 1e12;
  return r;
}

LayerCost layer(int index, std::int64_t params, double state_bytes = 8, double grad_bytes = 2,
                double param_bytes = 2) {
  LayerCost l;
  l.layer = index;
  l.params = params;
  l.state_bytes = state_bytes;
  l.grad_bytes = grad_bytes;
  l.param_bytes = param_bytes;
  return l;
}

void expect_close(double actual, double expected) {
  EXPECT_NEAR(actual, expected, 1e-9 * std::abs(expected) + 1e-15);
}

TEST(StepCostModelTest, PredictAllGpu) {
  std::vector<LayerCost> layers = {layer(0, 1 * kM), layer(1, 3 * kM)};
  StepPrediction p = predict(rates(), layers, {false, false});
  // 4M parameters, 8 bytes each way, both directions overlapped throughout.
  const double each_way = 4e6 * 8;
  expect_close(p.link_s, each_way / 30e9);
  EXPECT_EQ(p.host_s, 0.0);
  expect_close(p.gpu_s, 4e6 / 1e12);
  expect_close(p.seconds, each_way / 30e9);
  EXPECT_EQ(p.bound, "link");
  EXPECT_EQ(p.host_params, 0);
  EXPECT_EQ(p.gpu_params, 4 * kM);
}

TEST(StepCostModelTest, PredictNamesTheBound) {
  std::vector<LayerCost> layers = {layer(0, 1 * kM), layer(1, 3 * kM)};
  StepRates r = rates();
  r.gpu_params_per_s = 1e9;  // 4 ms
  StepPrediction p = predict(r, layers, {false, false});
  EXPECT_EQ(p.bound, "gpu");
  expect_close(p.seconds, 4e6 / 1e9);

  r.gpu_params_per_s = 0;  // not counted
  p = predict(r, layers, {false, false});
  EXPECT_EQ(p.gpu_s, 0.0);
  EXPECT_EQ(p.bound, "link");

  r = rates();
  r.host_params_per_s = 1e6;  // 1M parameters on the host: 1 s
  p = predict(r, layers, {true, false});
  EXPECT_EQ(p.bound, "host");
  expect_close(p.seconds, 1.0);
  EXPECT_EQ(p.host_params, 1 * kM);
  EXPECT_EQ(p.gpu_params, 3 * kM);
}

TEST(StepCostModelTest, PredictUnbalancedDirections) {
  // Layer 0 on the host with float32 gradients out and bfloat16 parameters back: D2H is busier.
  std::vector<LayerCost> layers = {layer(0, 1 * kM, 8, /*grad_bytes=*/4, /*param_bytes=*/2),
                                   layer(1, 3 * kM)};
  // 26e6 B host to GPU, 28e6 back.
  StepRates r = rates();
  StepPrediction p = predict(r, layers, {true, false});
  // The host's 0.5 ms at the loaded rates: 10e6 B in, 12.5e6 out; then 16e6 in, 15.5e6 out
  // overlapped for 15.5e6 and the rest of the busier direction (host to GPU) alone.
  expect_close(p.host_s, 1e6 / 2e9);
  expect_close(p.link_s, 0.5e-3 + 15.5e6 / 30e9 + 0.5e6 / 50e9);
  expect_close(p.gpu_s, 3e6 / 1e12);

  // The other way round: 28e6 in, 26e6 out, so after the host's 0.5 ms 18e6 in and 13.5e6 out.
  layers[0] = layer(0, 1 * kM, 8, /*grad_bytes=*/2, /*param_bytes=*/4);
  p = predict(r, layers, {true, false});
  expect_close(p.link_s, 0.5e-3 + 13.5e6 / 30e9 + 4.5e6 / 50e9);

  // GPU to host busier after the host is done: out at the alone rate (40).
  r.link_d2h_loaded_gbps = 2;  // 1e6 B out while the host runs
  layers[0] = layer(0, 1 * kM, 8, /*grad_bytes=*/4, /*param_bytes=*/2);
  p = predict(r, layers, {true, false});
  expect_close(p.link_s, 0.5e-3 + 16e6 / 30e9 + (27e6 - 16e6) / 40e9);
}

TEST(StepCostModelTest, PredictLinkDoneWhileTheHostRuns) {
  // One direction only, done inside the host's 0.5 ms at its loaded rate: the host bounds.
  std::vector<LayerCost> layers = {layer(0, 1 * kM, 8, /*grad_bytes=*/4, /*param_bytes=*/0)};
  StepPrediction p = predict(rates(), layers, {true});
  expect_close(p.link_s, 4e6 / 25e9);
  expect_close(p.seconds, 0.5e-3);
  EXPECT_EQ(p.bound, "host");

  // Both directions done inside a slow host's 10 ms: the slower of the two at its loaded rate.
  StepRates r = rates();
  r.host_params_per_s = 1e8;
  layers = {layer(0, 1 * kM), layer(1, 3 * kM)};
  p = predict(r, layers, {true, false});
  expect_close(p.link_s, 26e6 / 20e9);
  expect_close(p.seconds, 10e-3);
  EXPECT_EQ(p.bound, "host");

  // The loaded rates matter only while the host runs: with no host layer they are not used.
  r.link_h2d_loaded_gbps = r.link_d2h_loaded_gbps = 1e-3;
  p = predict(r, layers, {false, false});
  expect_close(p.link_s, 32e6 / 30e9);
}

TEST(StepCostModelTest, FastHostMovesEveryLayerThatSaves) {
  StepRates r = rates();
  r.host_params_per_s = 1e15;
  // Layer 2 moves more over the link on the host (2+2 bytes) than streamed (1+1).
  std::vector<LayerCost> layers = {layer(0, 1 * kM), layer(1, 2 * kM), layer(2, 1 * kM, 1)};
  absl::StatusOr<HybridSplit> split = choose_split(r, layers, std::nullopt);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->on_host, (std::vector<bool>{true, true, false}));
  EXPECT_LT(split->predicted.seconds, split->all_gpu.seconds);
  EXPECT_DOUBLE_EQ(split->gpu_fraction, 0.25);
  // Each way: 3M * 2 B on the host path, 1M * 1 B streamed (the host's 3 ns hardly count).
  EXPECT_NEAR(split->predicted.link_s, (3e6 * 2 + 1e6 * 1) / 30e9, 1e-8);
  expect_close(split->all_gpu.link_s, (3e6 * 8 + 1e6 * 1) / 30e9);
}

TEST(StepCostModelTest, SlowHostMovesNothing) {
  StepRates r = rates();
  r.host_params_per_s = 1;
  std::vector<LayerCost> layers = {layer(0, 1 * kM), layer(1, 2 * kM), layer(2, 1 * kM, 12)};
  absl::StatusOr<HybridSplit> split = choose_split(r, layers, std::nullopt);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->on_host, (std::vector<bool>{false, false, false}));
  EXPECT_EQ(split->predicted.seconds, split->all_gpu.seconds);
  EXPECT_EQ(split->predicted.host_params, 0);
  EXPECT_EQ(split->gpu_fraction, 1.0);
}

TEST(StepCostModelTest, BalancedRatesGiveInteriorSplit) {
  StepRates r;
  r.link_h2d_gbps = 50;
  r.link_d2h_gbps = 50;
  r.link_both_gbps = 40;
  r.host_params_per_s = 4e9;
  r.link_h2d_loaded_gbps = r.link_d2h_loaded_gbps = 40;  // the host takes nothing from the link
  std::vector<LayerCost> layers;
  for (int l = 0; l < 8; ++l) layers.push_back(layer(l, 1 * kM));
  // With k layers on the host: link = (64 - 6k) MB / 40 GB/s = 1.6 - 0.15k ms, host Adam =
  // k * 1M / 4e9 = 0.25k ms; the largest is least at k = 4 (1.0 ms), against 1.6 ms streamed.
  absl::StatusOr<HybridSplit> split = choose_split(r, layers, std::nullopt);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->on_host,
            (std::vector<bool>{false, false, false, false, true, true, true, true}));
  expect_close(split->predicted.seconds, 1.0e-3);
  expect_close(split->all_gpu.seconds, 1.6e-3);
  EXPECT_LT(split->predicted.seconds, split->all_gpu.seconds);
  EXPECT_DOUBLE_EQ(split->gpu_fraction, 0.5);

  // No prefix of the order (equal savings: the highest layer first) predicts faster.
  std::vector<bool> prefix(layers.size(), false);
  for (int k = 0; k <= 8; ++k) {
    if (k > 0) prefix[8 - k] = true;
    EXPECT_LE(split->predicted.seconds, predict(r, layers, prefix).seconds) << "prefix " << k;
  }
}

TEST(StepCostModelTest, ForcedFraction) {
  std::vector<LayerCost> layers;
  for (int l = 0; l < 4; ++l) layers.push_back(layer(l, 1 * kM));

  absl::StatusOr<HybridSplit> split = choose_split(rates(), layers, 1.0);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->on_host, (std::vector<bool>{false, false, false, false}));
  EXPECT_EQ(split->gpu_fraction, 1.0);

  split = choose_split(rates(), layers, 0.0);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->on_host, (std::vector<bool>{true, true, true, true}));
  EXPECT_EQ(split->gpu_fraction, 0.0);
  EXPECT_EQ(split->predicted.host_params, 4 * kM);

  split = choose_split(rates(), layers, 0.5);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->on_host, (std::vector<bool>{false, false, true, true}));
  EXPECT_EQ(split->gpu_fraction, 0.5);
  // The prediction is that of the split taken, whatever it costs: 20e6 B each way, all of it
  // inside the host's 1 ms, host to GPU the slower at its loaded rate; the link's 1 ms ties the
  // host's, and a tie names the link.
  expect_close(split->predicted.link_s, 20e6 / 20e9);
  EXPECT_EQ(split->predicted.bound, "link");
}

TEST(StepCostModelTest, ForcedFractionTakesTheNearestPrefix) {
  // Equal savings, so the order is layer 2 (10), layer 1 (30), layer 0 (60): prefixes put 0, 10,
  // 40 or 100 parameters on the host.
  std::vector<LayerCost> layers = {layer(0, 60), layer(1, 30), layer(2, 10)};
  // (1 - 0.7) * 100 = 30: 40 is 10 away, 10 is 20 away.
  absl::StatusOr<HybridSplit> split = choose_split(rates(), layers, 0.7);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->on_host, (std::vector<bool>{false, true, true}));
  // (1 - 0.75) * 100 = 25: 10 and 40 are both 15 away; the fewer host layers win.
  split = choose_split(rates(), layers, 0.75);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->on_host, (std::vector<bool>{false, false, true}));
}

TEST(StepCostModelTest, GreedyOrder) {
  // Layer 0 keeps float32 masters (12 bytes each way): it saves the most and goes first, then the
  // higher of the two equal layers.
  std::vector<LayerCost> layers = {layer(0, 1 * kM, 12), layer(1, 1 * kM, 8), layer(2, 1 * kM, 8)};
  absl::StatusOr<HybridSplit> split = choose_split(rates(), layers, 2.0 / 3.0);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->on_host, (std::vector<bool>{true, false, false}));
  split = choose_split(rates(), layers, 1.0 / 3.0);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->on_host, (std::vector<bool>{true, false, true}));

  // The order follows the `layer` field, not the position in the input.
  layers = {layer(5, 1 * kM), layer(9, 1 * kM), layer(7, 1 * kM)};
  split = choose_split(rates(), layers, 2.0 / 3.0);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->on_host, (std::vector<bool>{false, true, false}));
}

TEST(StepCostModelTest, EmptyLayerList) {
  absl::StatusOr<HybridSplit> split = choose_split(rates(), {}, std::nullopt);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_TRUE(split->on_host.empty());
  EXPECT_EQ(split->predicted.seconds, 0.0);
  EXPECT_EQ(split->all_gpu.seconds, 0.0);
  EXPECT_EQ(split->gpu_fraction, 1.0);
}

TEST(StepCostModelTest, InvalidFraction) {
  std::vector<LayerCost> layers = {layer(0, 1 * kM)};
  for (double f : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    absl::StatusOr<HybridSplit> split = choose_split(rates(), layers, f);
    ASSERT_FALSE(split.ok()) << f;
    EXPECT_EQ(split.status().code(), absl::StatusCode::kInvalidArgument) << f;
    EXPECT_NE(std::string(split.status().message()).find("[0, 1]"), std::string::npos)
        << split.status();
  }
}

TEST(StepCostModelTest, InvalidInputs) {
  std::vector<LayerCost> layers = {layer(0, 1 * kM)};
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<StepRates> bad(8, rates());
  bad[0].link_h2d_gbps = 0;
  bad[1].link_d2h_gbps = -1;
  bad[2].link_both_gbps = inf;
  bad[3].host_params_per_s = nan;
  bad[4].link_h2d_loaded_gbps = 0;
  bad[5].gpu_params_per_s = -1;
  bad[6].gpu_params_per_s = inf;
  bad[7].link_d2h_loaded_gbps = nan;
  for (std::size_t i = 0; i < bad.size(); ++i) {
    absl::StatusOr<HybridSplit> split = choose_split(bad[i], layers, std::nullopt);
    ASSERT_FALSE(split.ok()) << i;
    EXPECT_EQ(split.status().code(), absl::StatusCode::kInvalidArgument) << i;
  }
  StepRates no_gpu = rates();
  no_gpu.gpu_params_per_s = 0;
  EXPECT_TRUE(choose_split(no_gpu, layers, std::nullopt).ok());

  std::vector<std::vector<LayerCost>> bad_layers = {
      {layer(0, -1)},
      {layer(0, kM, -8)},
      {layer(0, kM, 8, -2)},
      {layer(0, kM, 8, 2, nan)},
  };
  for (std::size_t i = 0; i < bad_layers.size(); ++i) {
    absl::StatusOr<HybridSplit> split = choose_split(rates(), bad_layers[i], std::nullopt);
    ASSERT_FALSE(split.ok()) << i;
    EXPECT_EQ(split.status().code(), absl::StatusCode::kInvalidArgument) << i;
  }
}

TEST(StepCostModelTest, Describe) {
  std::vector<LayerCost> layers;
  for (int l = 0; l < 4; ++l) layers.push_back(layer(l, 1 * kM));
  absl::StatusOr<HybridSplit> split = choose_split(rates(), layers, 0.5);
  ASSERT_TRUE(split.ok()) << split.status();
  std::string line = describe(*split);
  EXPECT_NE(line.find("2 of 4 layers"), std::string::npos) << line;
  EXPECT_NE(line.find("50.0% of parameters"), std::string::npos) << line;
  EXPECT_NE(line.find("(bound: " + split->predicted.bound + ")"), std::string::npos) << line;
  EXPECT_NE(line.find("streamed"), std::string::npos) << line;
}

}  // namespace
}  // namespace strata::policy
