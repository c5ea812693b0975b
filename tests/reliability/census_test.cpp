// The bad-input census of RELIABILITY.md above the allocator: the runtime's registry and guards,
// staging, policy choice and configuration, and Adam. Each case has its exact error and a check
// that nothing changed (the registry, every tensor's bytes, the bytes live per tier) and that the
// runtime still works. Linked with the allocator's census (tests/allocator/bad_input_test.cpp),
// this binary prints the total: "bad inputs tried: N".
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "tests/allocator/test_util.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using testing::make_runtime;
using testing::read_all;
using testing::spec;

int runtime_cases = 0;

struct State {
  std::map<std::string, std::vector<unsigned char>> tensors;
  std::array<std::int64_t, alloc::kNumTiers> live{};
  bool operator==(const State&) const = default;
};

State state_of(Runtime& rt) {
  State s;
  EXPECT_TRUE(rt.wait_all().ok());
  for (TensorHandle h : rt.tensors()) s.tensors[rt.info(h)->spec.name] = read_all(rt, h);
  for (Tier t : alloc::kAllTiers) {
    s.live[alloc::tier_index(t)] = rt.allocator().stats(t).allocated_bytes.current;
  }
  return s;
}

// A runtime (keep_on_gpu, GPU budget 16 MiB) holding one layer: a parameter and its gradient.
class CensusTest : public ::testing::Test {
 protected:
  void SetUp() override {
    made_ = make_runtime("keep_on_gpu", {}, false, 16 * kMiB);
    ASSERT_NE(rt(), nullptr);
    std::vector<float> values(1000);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.5f * i;
    w_ = *rt()->register_tensor(spec("w", 0, Role::kParameter, 1000), values.data());
    g_ = *rt()->register_tensor(spec("w.grad", 0, Role::kGradient, 1000));
    before_ = state_of(*rt());
  }
  void TearDown() override {
    EXPECT_TRUE(state_of(*rt()) == before_) << "a refused call changed something";
    // Still works: a tensor comes and goes.
    absl::StatusOr<TensorHandle> h = rt()->register_tensor(spec("after", 1, Role::kOther, 10));
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE(rt()->unregister(*h).ok());
    ++runtime_cases;
  }
  Runtime* rt() { return made_.rt.get(); }

  static void expect_error(const absl::Status& s, absl::StatusCode code,
                           const std::string& message) {
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_EQ(std::string(s.message()), message);
  }

  testing::Made made_;
  TensorHandle w_, g_;
  State before_;
};

// --- registry ---

TEST_F(CensusTest, RegisterANameTwice) {
  expect_error(rt()->register_tensor(spec("w", 2, Role::kParameter, 8)).status(),
               absl::StatusCode::kAlreadyExists,
               "register_tensor: a tensor named 'w' is registered already");
}

TEST_F(CensusTest, RegisterAnEmptyName) {
  expect_error(rt()->register_tensor(spec("", 0, Role::kOther, 8)).status(),
               absl::StatusCode::kInvalidArgument, "register_tensor: empty name");
}

TEST_F(CensusTest, RegisterANegativeDimension) {
  TensorSpec s = spec("neg", 0, Role::kOther, 8);
  s.shape = {4, -2};
  expect_error(rt()->register_tensor(s).status(), absl::StatusCode::kInvalidArgument,
               "tensor 'neg': negative dimension -2 in its shape");
}

TEST_F(CensusTest, RegisterASizeThatOverflows) {
  TensorSpec s = spec("huge", 0, Role::kOther, 8);
  s.shape = {std::int64_t{1} << 40, std::int64_t{1} << 40};
  expect_error(rt()->register_tensor(s).status(), absl::StatusCode::kInvalidArgument,
               "tensor 'huge': numel overflows");
}

TEST_F(CensusTest, RegisterAboveTheGpuBudget) {
  expect_error(
      rt()->register_tensor(spec("big", 0, Role::kOther, 8 * 1024 * 1024)).status(),
      absl::StatusCode::kResourceExhausted,
      "register_tensor 'big': out of memory in tier gpu: tried to allocate 32.00 MiB (33554432 "
      "bytes asked); reserved 2.00 MiB, allocated 8.00 KiB, budget 16.00 MiB, largest free block "
      "1.99 MiB; a new segment of 32.00 MiB would pass the budget");
}

TEST_F(CensusTest, UnregisterAnUnknownHandle) {
  expect_error(rt()->unregister(TensorHandle{999}), absl::StatusCode::kNotFound,
               "tensor handle 999 is not registered");
}

TEST_F(CensusTest, UnregisterTwice) {
  TensorHandle t = *rt()->register_tensor(spec("t", 1, Role::kOther, 10));
  ASSERT_TRUE(rt()->unregister(t).ok());
  expect_error(rt()->unregister(t), absl::StatusCode::kNotFound,
               str_cat("tensor handle ", t.id, " is not registered"));
}

TEST_F(CensusTest, UseAfterUnregister) {
  TensorHandle t = *rt()->register_tensor(spec("t", 1, Role::kOther, 10));
  ASSERT_TRUE(rt()->unregister(t).ok());
  const std::string gone = str_cat("tensor handle ", t.id, " is not registered");
  std::vector<unsigned char> buf(40);
  expect_error(rt()->read(t, buf.data()), absl::StatusCode::kNotFound, gone);
  expect_error(rt()->write(t, buf.data()), absl::StatusCode::kNotFound, gone);
  expect_error(rt()->migrate(t, Tier::kPinnedHost), absl::StatusCode::kNotFound, gone);
  expect_error(rt()->acquire(t, Tier::kGpu, rt()->compute_stream()).status(),
               absl::StatusCode::kNotFound, gone);
  runtime_cases += 3;  // four calls, one case each
}

TEST_F(CensusTest, FindAnUnknownName) {
  expect_error(rt()->find("nope").status(), absl::StatusCode::kNotFound,
               "no tensor named 'nope' is registered");
}

// --- guards ---

TEST_F(CensusTest, ReleaseWhatIsNotAcquired) {
  expect_error(rt()->release(w_, rt()->compute_stream()), absl::StatusCode::kFailedPrecondition,
               "release 'w': it is not acquired");
}

TEST_F(CensusTest, UnregisterWhileHeld) {
  ASSERT_TRUE(rt()->acquire(w_, Tier::kGpu, rt()->compute_stream()).ok());
  expect_error(rt()->unregister(w_), absl::StatusCode::kFailedPrecondition,
               "unregister 'w': held by 1 acquire(s); release it first");
  ASSERT_TRUE(rt()->release(w_, rt()->compute_stream()).ok());
}

TEST_F(CensusTest, MigrateWhileHeld) {
  ASSERT_TRUE(rt()->acquire(w_, Tier::kGpu, rt()->compute_stream()).ok());
  expect_error(rt()->migrate(w_, Tier::kPinnedHost), absl::StatusCode::kFailedPrecondition,
               "tensor 'w' is held by 1 acquire(s); release it before moving it");
  ASSERT_TRUE(rt()->release(w_, rt()->compute_stream()).ok());
}

// --- staging ---

TEST_F(CensusTest, ConfigureStagingWithNoSlots) {
  expect_error(rt()->configure_staging(0, RoleSet::optimizer_states()),
               absl::StatusCode::kInvalidArgument, "configure_staging: 0 slots; need >= 1");
}

TEST_F(CensusTest, StageALayerBeforeConfiguringStaging) {
  TensorSpec at_home = spec("x", 3, Role::kParameter, 100);
  at_home.home = Tier::kPinnedHost;
  TensorHandle x = *rt()->register_tensor(at_home);
  before_ = state_of(*rt());
  expect_error(rt()->stage_layer(3, RoleSet{Role::kParameter}),
               absl::StatusCode::kFailedPrecondition,
               "stage_layer 3: no staging ring; call configure_staging first");
  ASSERT_TRUE(rt()->unregister(x).ok());
  before_ = state_of(*rt());
}

// --- policy choice and configuration ---

absl::Status create_status(std::optional<std::string> policy, PolicyConfig config) {
  RuntimeOptions options;
  options.policy = std::move(policy);
  options.policy_config = config;
  options.device = DeviceKind::kSimulated;
  return Runtime::create(std::move(options), policy::builtin_policies()).status();
}

TEST_F(CensusTest, UnknownPolicy) {
  expect_error(create_status("fastest", {}), absl::StatusCode::kInvalidArgument,
               "unknown policy 'fastest'; valid policies: bulk, keep_on_gpu, layer_prefetch "
               "(policy chosen by RuntimeOptions::policy)");
}

TEST_F(CensusTest, EmptyPolicyName) {
  expect_error(create_status("", {}), absl::StatusCode::kInvalidArgument,
               "empty policy name; valid policies: bulk, keep_on_gpu, layer_prefetch (policy "
               "chosen by RuntimeOptions::policy)");
}

TEST_F(CensusTest, NegativePrefetchDepth) {
  expect_error(create_status("layer_prefetch", {.prefetch_depth = -1}),
               absl::StatusCode::kInvalidArgument,
               "layer_prefetch: prefetch depth -1 is negative; use 0 (no prefetch) or more (policy "
               "chosen by RuntimeOptions::policy)");
}

TEST_F(CensusTest, NoRolesToMove) {
  expect_error(create_status("bulk", {.roles = RoleSet()}), absl::StatusCode::kInvalidArgument,
               "bulk: roles to move must not be empty (policy chosen by RuntimeOptions::policy)");
  expect_error(create_status("layer_prefetch", {.roles = RoleSet()}),
               absl::StatusCode::kInvalidArgument,
               "layer_prefetch: roles to stream must not be empty (policy chosen by "
               "RuntimeOptions::policy)");
  ++runtime_cases;
}

TEST(PolicyBudgetCensusTest, LayerPrefetchBudgetSmallerThanOneLayer) {
  auto [rt, dev] = make_runtime("layer_prefetch", {}, false, 4 * kMiB);
  const std::size_t tensors = rt->tensors().size();
  absl::Status s =
      rt->register_tensor(spec("big.exp_avg", 0, Role::kExpAvg, 2 * 1024 * 1024)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(),
            "layer_prefetch: the GPU budget (4.00 MiB) is smaller than one layer: layer 0 has "
            "8.00 MiB of exp_avg,exp_avg_sq");
  EXPECT_EQ(rt->tensors().size(), tensors);
  for (Tier t : alloc::kAllTiers) EXPECT_EQ(rt->allocator().stats(t).allocated_bytes.current, 0);
  ++runtime_cases;
}

// --- Adam ---

absl::Status adam_with(Runtime& rt, std::vector<std::pair<TensorHandle, TensorHandle>> params,
                       optim::AdamHyper hyper = {}) {
  optim::AdamOptions o;
  o.groups.push_back({.params = std::move(params), .hyper = hyper});
  return optim::Adam::create(rt, o).status();
}

TEST_F(CensusTest, AdamShapeMismatch) {
  TensorHandle short_grad = *rt()->register_tensor(spec("s.grad", 0, Role::kGradient, 999));
  before_ = state_of(*rt());
  expect_error(adam_with(*rt(), {{w_, short_grad}}), absl::StatusCode::kInvalidArgument,
               "Adam: gradient 's.grad' does not match parameter 'w' in shape or layer");
}

TEST_F(CensusTest, AdamDtypeMismatch) {
  TensorHandle half = *rt()->register_tensor(spec("h", 0, Role::kParameter, 1000, DType::kFloat16));
  before_ = state_of(*rt());
  expect_error(adam_with(*rt(), {{half, g_}}), absl::StatusCode::kInvalidArgument,
               "Adam: parameter 'h' is float16; Adam steps float32 tensors");
}

TEST_F(CensusTest, AdamGradientOfTheWrongRole) {
  expect_error(adam_with(*rt(), {{w_, w_}}), absl::StatusCode::kInvalidArgument,
               "Adam: gradient 'w' has role parameter, not gradient");
}

TEST_F(CensusTest, AdamParameterListedTwice) {
  expect_error(adam_with(*rt(), {{w_, g_}, {w_, g_}}), absl::StatusCode::kInvalidArgument,
               "Adam: parameter 'w' is listed twice");
}

TEST_F(CensusTest, AdamMissingGradient) {
  expect_error(adam_with(*rt(), {{w_, TensorHandle{}}}), absl::StatusCode::kInvalidArgument,
               "Adam: parameter 'w' has no gradient");
}

TEST_F(CensusTest, AdamHyperparametersTorchWouldRefuse) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::pair<optim::AdamHyper, std::string>> cases = {
      {{.lr = -0.1f}, "Adam: group 0: lr -0.1 is invalid; use a finite lr >= 0"},
      {{.lr = nan}, "Adam: group 0: lr nan is invalid; use a finite lr >= 0"},
      {{.lr = inf}, "Adam: group 0: lr inf is invalid; use a finite lr >= 0"},
      {{.beta1 = 1.0f}, "Adam: group 0: beta1 1 is invalid; use 0 <= beta1 < 1"},
      {{.beta2 = -0.5f}, "Adam: group 0: beta2 -0.5 is invalid; use 0 <= beta2 < 1"},
      {{.beta2 = nan}, "Adam: group 0: beta2 nan is invalid; use 0 <= beta2 < 1"},
      {{.eps = 0.0f}, "Adam: group 0: eps 0 is invalid; use a finite eps > 0"},
      {{.weight_decay = -1.0f},
       "Adam: group 0: weight_decay -1 is invalid; use a finite weight_decay >= 0"},
  };
  for (const auto& [hyper, message] : cases) {
    expect_error(adam_with(*rt(), {{w_, g_}}, hyper), absl::StatusCode::kInvalidArgument, message);
  }
  runtime_cases += static_cast<int>(cases.size()) - 1;
}

TEST_F(CensusTest, AdamLayerLargerThanTheGpuBudget) {
  ASSERT_TRUE(rt()->allocator().set_budget(Tier::kGpu, 2 * kMiB).ok());
  TensorHandle p = *rt()->register_tensor(spec("p", 5, Role::kParameter, 160 * 1024));
  TensorHandle g = *rt()->register_tensor(spec("p.grad", 5, Role::kGradient, 160 * 1024));
  before_ = state_of(*rt());
  expect_error(adam_with(*rt(), {{p, g}}), absl::StatusCode::kResourceExhausted,
               "Adam: layer 5 needs 2.50 MiB on the GPU for its step (parameters, gradients and "
               "moments; the kernel reads GPU memory only), more than the GPU budget of 2.00 MiB");
  ASSERT_TRUE(rt()->allocator().set_budget(Tier::kGpu, 16 * kMiB).ok());
  ASSERT_TRUE(rt()->unregister(p).ok());
  ASSERT_TRUE(rt()->unregister(g).ok());
  before_ = state_of(*rt());
}

TEST_F(CensusTest, AdamSetLrOfAGroupThatDoesNotExist) {
  optim::AdamOptions o;
  o.groups.push_back({.params = {{w_, g_}}, .hyper = {}});
  std::unique_ptr<optim::Adam> adam = *optim::Adam::create(*rt(), o);
  before_ = state_of(*rt());
  expect_error(adam->set_lr(3, 0.1f), absl::StatusCode::kInvalidArgument,
               "Adam: no parameter group 3");
  expect_error(adam->set_lr(0, std::nanf("")), absl::StatusCode::kInvalidArgument,
               "Adam: group 0: lr nan is invalid; use a finite lr >= 0");
  ++runtime_cases;
  const std::vector<TensorHandle> states = *adam->state(w_);
  for (TensorHandle h : states) ASSERT_TRUE(rt()->unregister(h).ok());
  before_ = state_of(*rt());
}

TEST_F(CensusTest, AdamCheckpointThatIsTruncatedOrForeign) {
  optim::AdamOptions o;
  o.groups.push_back({.params = {{w_, g_}}, .hyper = {}});
  std::unique_ptr<optim::Adam> adam = *optim::Adam::create(*rt(), o);
  std::stringstream good;
  ASSERT_TRUE(adam->save(good).ok());
  before_ = state_of(*rt());
  std::stringstream truncated(good.str().substr(0, good.str().size() / 2));
  expect_error(adam->load(truncated), absl::StatusCode::kDataLoss,
               "Adam checkpoint is truncated or not a strata Adam checkpoint");
  std::stringstream foreign("not a checkpoint at all");
  expect_error(adam->load(foreign), absl::StatusCode::kDataLoss,
               "Adam checkpoint is truncated or not a strata Adam checkpoint");
  ++runtime_cases;
  const std::vector<TensorHandle> states = *adam->state(w_);
  for (TensorHandle h : states) ASSERT_TRUE(rt()->unregister(h).ok());
  before_ = state_of(*rt());
}

TEST_F(CensusTest, AdamStepAfterATensorWasUnregistered) {
  optim::AdamOptions o;
  TensorHandle p = *rt()->register_tensor(spec("p", 1, Role::kParameter, 10));
  TensorHandle g = *rt()->register_tensor(spec("p.grad", 1, Role::kGradient, 10));
  o.groups.push_back({.params = {{p, g}}, .hyper = {}});
  std::unique_ptr<optim::Adam> adam = *optim::Adam::create(*rt(), o);
  ASSERT_TRUE(rt()->unregister(g).ok());
  before_ = state_of(*rt());
  expect_error(adam->step(), absl::StatusCode::kFailedPrecondition,
               str_cat("Adam: tensor handle ", g.id,
                       " of layer 1 was unregistered after the optimizer was made"));
  EXPECT_EQ(adam->step_count(0), 0);
  const std::vector<TensorHandle> states = *adam->state(p);
  for (TensorHandle h : states) ASSERT_TRUE(rt()->unregister(h).ok());
  ASSERT_TRUE(rt()->unregister(p).ok());
  before_ = state_of(*rt());
}

class CountPrinter : public ::testing::Environment {
 public:
  void TearDown() override {
    const int allocator = alloc::testing::allocator_bad_inputs_tried();
    std::printf(
        "bad inputs tried: %d (allocator %d, per tier where it applies; runtime, "
        "policies and Adam %d)\n",
        allocator + runtime_cases, allocator, runtime_cases);
  }
};
const auto* const kPrinter = ::testing::AddGlobalTestEnvironment(new CountPrinter);

}  // namespace
}  // namespace strata::rt
