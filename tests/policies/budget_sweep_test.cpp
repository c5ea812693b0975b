// The GPU budget is a promise (issue "The GPU budget is a promise"): for every policy, role set
// (optimizer states, or every role), prefetch depth (0, 1, 2, 5) and budget from below one layer
// to everything resident in steps of 512 KiB (2 MiB under the sanitizers), a model of five layers
// of uneven sizes is set up (parameters and gradients registered on the GPU, as the bridge does,
// then Adam) and trained two steps through every hook, on the simulated device:
//   - strata's GPU memory (the GPU tier's segments and the staging ring, one Budget) never passes
//     the budget: its peak statistic, kept at every reservation, is checked;
//   - a budget too small fails at setup, with kResourceExhausted or kInvalidArgument and a message
//     that names the budget; never half way through a step;
//   - once a budget trains, every larger one trains.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/units.h"
#include "gtest/gtest.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using testing::spec;

constexpr int kLayers = 5;
// Floats per tensor of each layer: 256 KiB to 1 MiB tensors, 1 to 4 MiB a layer of four roles.
constexpr std::size_t kNumel[kLayers] = {64 * 1024, 256 * 1024, 128 * 1024, 192 * 1024, 96 * 1024};

// Budgets go up in steps of 512 KiB; STRATA_BUDGET_SWEEP_STEP_KIB sets a coarser step (the
// sanitizer builds, where each run costs 10-20 times more, take 2 MiB steps).
std::size_t budget_step() {
  if (const char* env = std::getenv("STRATA_BUDGET_SWEEP_STEP_KIB")) {
    return static_cast<std::size_t>(std::stoull(env)) * 1024;
  }
  return kMiB / 2;
}

struct Outcome {
  bool trained = false;
  bool failed_at_setup = false;
  std::string error;
  std::int64_t peak = 0;
};

Outcome run(const std::string& policy, RoleSet roles, int depth, std::size_t budget) {
  Outcome out;
  RuntimeOptions options;
  options.policy = policy;
  options.policy_config = {.prefetch_depth = depth, .roles = roles, .offload_after_step = true};
  options.device = DeviceKind::kSimulated;
  options.allocator.budgets[alloc::tier_index(Tier::kGpu)] = budget;
  absl::StatusOr<std::unique_ptr<Runtime>> made =
      Runtime::create(std::move(options), policy::builtin_policies());
  EXPECT_TRUE(made.ok()) << made.status();
  Runtime& rt = **made;
  std::unique_ptr<optim::Adam> adam;
  auto setup = [&]() -> absl::Status {
    optim::AdamOptions o;
    o.groups.resize(1);
    o.groups[0].hyper = {.lr = 1e-2f, .weight_decay = 0.01f};
    std::vector<float> init;
    for (int l = 0; l < kLayers; ++l) {
      init.assign(kNumel[l], 0.01f * static_cast<float>(l + 1));
      STRATA_ASSIGN_OR_RETURN(TensorHandle p, rt.register_tensor(spec(str_cat("l", l, ".w"), l,
                                                                      Role::kParameter, kNumel[l]),
                                                                 init.data()));
      STRATA_ASSIGN_OR_RETURN(TensorHandle g, rt.register_tensor(spec(str_cat("l", l, ".w.grad"), l,
                                                                      Role::kGradient, kNumel[l]),
                                                                 init.data()));
      o.groups[0].params.push_back({p, g});
    }
    STRATA_ASSIGN_OR_RETURN(adam, optim::Adam::create(rt, o));
    return absl::OkStatus();
  };
  if (absl::Status s = setup(); !s.ok()) {
    out.failed_at_setup = true;
    out.error = s.ToString();
    EXPECT_TRUE(s.code() == absl::StatusCode::kResourceExhausted ||
                s.code() == absl::StatusCode::kInvalidArgument)
        << s;
    EXPECT_NE(out.error.find("budget"), std::string::npos)
        << "the error does not name the budget: " << s;
  } else {
    auto step = [&]() -> absl::Status {
      STRATA_RETURN_IF_ERROR(rt.begin_step());
      for (int l = 0; l < kLayers; ++l) STRATA_RETURN_IF_ERROR(rt.before_forward(l));
      for (int l = kLayers - 1; l >= 0; --l) STRATA_RETURN_IF_ERROR(rt.after_backward(l));
      STRATA_RETURN_IF_ERROR(adam->step());
      return rt.end_step();
    };
    absl::Status trained = step();
    if (trained.ok()) trained = step();
    out.trained = trained.ok();
    if (!trained.ok()) out.error = trained.ToString();
  }
  out.peak = rt.stats().gpu_reserved_peak_bytes;
  adam.reset();
  return out;
}

TEST(BudgetSweepTest, NeverPassedAnErrorOnlyAtSetupAndMonotone) {
  std::size_t everything = 0;
  for (std::size_t n : kNumel) everything += 4 * n * 4;
  struct Config {
    std::string policy;
    RoleSet roles;
    int depth;
  };
  std::vector<Config> configs = {{"keep_on_gpu", RoleSet::all(), 0}};
  for (const char* policy : {"bulk", "layer_prefetch"}) {
    for (RoleSet roles : {RoleSet::optimizer_states(), RoleSet::all()}) {
      for (int depth : {0, 1, 2, 5}) configs.push_back({policy, roles, depth});
    }
  }
  int runs = 0;
  for (const Config& c : configs) {
    const std::string name = str_cat(c.policy, " ", c.roles.to_string(), " K=", c.depth);
    std::size_t first_trained = 0;
    std::string line;
    const std::size_t step = budget_step();
    for (std::size_t budget = step; budget <= everything + 4 * kMiB; budget += step) {
      const Outcome o = run(c.policy, c.roles, c.depth, budget);
      ++runs;
      EXPECT_LE(o.peak, static_cast<std::int64_t>(budget))
          << name << ": strata's GPU memory passed a budget of " << format_bytes(budget);
      EXPECT_TRUE(o.trained || o.failed_at_setup)
          << name << ", budget " << format_bytes(budget)
          << ": failed half way through a step: " << o.error;
      if (o.trained && first_trained == 0) first_trained = budget;
      EXPECT_FALSE(first_trained != 0 && !o.trained)
          << name << ": trained at " << format_bytes(first_trained) << " but not at "
          << format_bytes(budget) << ": " << o.error;
    }
    EXPECT_NE(first_trained, 0u) << name << " never trained";
    std::printf("%-52s trains from %s\n", name.c_str(), format_bytes(first_trained).c_str());
  }
  std::printf("budget sweep: %zu configurations, %d runs, model of %s\n", configs.size(), runs,
              format_bytes(everything).c_str());
}

}  // namespace
}  // namespace strata::rt
