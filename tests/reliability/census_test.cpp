// The bad-input census of RELIABILITY.md above the allocator: the runtime's registry, guards,
// staging and hooks, policy choice and configuration, and Adam (its checkpoints among them). Each
// check expects its whole message (tests/census.h) and that nothing changed: the registry, every
// tensor's bytes, the bytes live per tier; then the runtime still works. Linked with the
// allocator's checks (tests/allocator/bad_input_test.cpp) and, with LibTorch, the bridge's
// (census_bridge.cpp), this binary prints how many distinct checks it tried:
// "bad inputs tried: N distinct".
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "tests/allocator/test_util.h"
#include "tests/census.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using strata::testing::census_checks;
using strata::testing::expect_refused;
using testing::make_runtime;
using testing::read_all;
using testing::spec;
constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
constexpr auto kPrecondition = absl::StatusCode::kFailedPrecondition;
constexpr auto kNotFound = absl::StatusCode::kNotFound;
constexpr auto kDataLoss = absl::StatusCode::kDataLoss;

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
  void SetUp() override { set_up("keep_on_gpu", {}); }
  void set_up(const std::string& policy, PolicyConfig config) {
    made_ = make_runtime(policy, config, false, 16 * kMiB);
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
  }
  Runtime* rt() { return made_.rt.get(); }
  // What the checks below compare with: the state once the test's own set-up is done.
  void settled() { before_ = state_of(*rt()); }

  testing::Made made_;
  TensorHandle w_, g_;
  State before_;
};

// --- registry ---

TEST_F(CensusTest, Registry) {
  expect_refused("register a name twice",
                 rt()->register_tensor(spec("w", 2, Role::kParameter, 8)).status(),
                 absl::StatusCode::kAlreadyExists,
                 "register_tensor: a tensor named 'w' is registered already");
  expect_refused("register an empty name",
                 rt()->register_tensor(spec("", 0, Role::kOther, 8)).status(), kInvalid,
                 "register_tensor: empty name");
  expect_refused("register a negative layer",
                 rt()->register_tensor(spec("neg", -1, Role::kOther, 8)).status(), kInvalid,
                 "register_tensor 'neg': layer -1 is negative");
  TensorSpec negative = spec("neg", 0, Role::kOther, 8);
  negative.shape = {4, -2};
  expect_refused("register a negative dimension", rt()->register_tensor(negative).status(),
                 kInvalid, "tensor 'neg': negative dimension -2 in its shape");
  TensorSpec huge = spec("huge", 0, Role::kOther, 8);
  huge.shape = {std::int64_t{1} << 40, std::int64_t{1} << 40};
  expect_refused("register a size that overflows", rt()->register_tensor(huge).status(), kInvalid,
                 "tensor 'huge': numel overflows");
  expect_refused(
      "register above the GPU budget",
      rt()->register_tensor(spec("big", 0, Role::kOther, 8 * 1024 * 1024)).status(),
      absl::StatusCode::kResourceExhausted,
      str_cat("register_tensor 'big': out of memory in tier gpu: tried to allocate 32.00 MiB "
              "(33554432 bytes asked); reserved 2.00 MiB, allocated 8.00 KiB, budget 16.00 MiB, "
              "largest free block 1.99 MiB; ",
              rt()->allocator().pool(alloc::Tier::kGpu).expandable()
                  ? "mapping 32.00 MiB more would pass the budget"
                  : "a new segment of 32.00 MiB would pass the budget"));
  expect_refused("unregister an unknown handle", rt()->unregister(TensorHandle{999}), kNotFound,
                 "tensor handle 999 is not registered");
  expect_refused("find an unknown name", rt()->find("nope").status(), kNotFound,
                 "no tensor named 'nope' is registered");
}

TEST_F(CensusTest, UseAfterUnregister) {
  TensorHandle t = *rt()->register_tensor(spec("t", 1, Role::kOther, 10));
  ASSERT_TRUE(rt()->unregister(t).ok());
  const std::string gone = str_cat("tensor handle ", t.id, " is not registered");
  std::vector<unsigned char> buf(40);
  expect_refused("unregister twice", rt()->unregister(t), kNotFound, gone);
  expect_refused("read after unregister", rt()->read(t, buf.data()), kNotFound, gone);
  expect_refused("write after unregister", rt()->write(t, buf.data()), kNotFound, gone);
  expect_refused("migrate after unregister", rt()->migrate(t, Tier::kPinnedHost), kNotFound, gone);
  expect_refused("acquire after unregister",
                 rt()->acquire(t, Tier::kGpu, rt()->compute_stream()).status(), kNotFound, gone);
}

// --- guards ---

TEST_F(CensusTest, Guards) {
  const StreamHandle s = rt()->compute_stream();
  expect_refused("release what is not acquired", rt()->release(w_, s), kPrecondition,
                 "release 'w': it is not acquired");
  expect_refused("read into a null destination", rt()->read(w_, nullptr), kInvalid,
                 "read 'w': the destination is null");
  expect_refused("write from a null source", rt()->write(w_, nullptr), kInvalid,
                 "write 'w': the source is null");
  ASSERT_TRUE(rt()->acquire(w_, Tier::kGpu, s).ok());
  std::vector<float> values(1000);
  expect_refused("unregister while held", rt()->unregister(w_), kPrecondition,
                 "unregister 'w': held by 1 acquire(s); release it first");
  expect_refused("migrate while held", rt()->migrate(w_, Tier::kPinnedHost), kPrecondition,
                 "tensor 'w' is held by 1 acquire(s); release it before moving it");
  expect_refused("write while held", rt()->write(w_, values.data()), kPrecondition,
                 "write 'w': held by 1 acquire(s)");
  expect_refused("acquire a held tensor on another tier",
                 rt()->acquire(w_, Tier::kPinnedHost, s).status(), kPrecondition,
                 "acquire 'w' on pinned_host: it is held on gpu");
  ASSERT_TRUE(rt()->release(w_, s).ok());
}

// --- staging, on its own runtime (bulk places tensors at their home tier) ---

TEST(StagingCensusTest, Staging) {
  auto [rt, dev] = make_runtime("bulk");
  const StreamHandle s = rt->compute_stream();
  std::vector<TensorHandle> h;
  for (int l = 0; l < 3; ++l) {
    TensorSpec t = spec(str_cat("m", l), l, Role::kOptimizerState, 100 * (l + 1));
    t.home = Tier::kPinnedHost;
    h.push_back(*rt->register_tensor(t));
  }
  expect_refused("stage a layer before configuring staging", rt->stage_layer(0), kPrecondition,
                 "stage_layer 0: no staging ring; call configure_staging first");
  expect_refused("configure staging with no slots",
                 rt->configure_staging(0, RoleSet::optimizer_states()), kInvalid,
                 "configure_staging: 0 slots; need >= 1");
  ASSERT_TRUE(rt->configure_staging(1, RoleSet::optimizer_states()).ok());
  ASSERT_TRUE(rt->stage_layer(0).ok());
  expect_refused("stage a layer when every slot is taken", rt->stage_layer(1),
                 absl::StatusCode::kResourceExhausted,
                 "stage_layer 1: all 1 staging slots hold layers (0); unstage one first");
  expect_refused("configure staging while layers are staged",
                 rt->configure_staging(2, RoleSet::optimizer_states()), kPrecondition,
                 "configure_staging while layers are staged");
  expect_refused("migrate a staged tensor", rt->migrate(h[0], Tier::kPageableHost), kPrecondition,
                 "tensor 'm0' is staged (layer 0); unstage_layer first");
  expect_refused("acquire a staged tensor on another tier",
                 rt->acquire(h[0], Tier::kPinnedHost, s).status(), kPrecondition,
                 "acquire 'm0' on pinned_host: it is staged on the GPU");
  ASSERT_TRUE(rt->acquire(h[0], Tier::kGpu, s).ok());
  expect_refused("unstage a layer whose tensor is held", rt->unstage_layer(0), kPrecondition,
                 "unstage_layer 0: tensor 'm0' is still held");
  ASSERT_TRUE(rt->release(h[0], s).ok());
  ASSERT_TRUE(rt->unstage_layer(0).ok());
  // A tensor registered after the ring was sized: its layer no longer fits a slot.
  TensorSpec big = spec("m0.big", 0, Role::kOptimizerState, 1000);
  big.home = Tier::kPinnedHost;
  TensorHandle b = *rt->register_tensor(big);
  expect_refused("stage a layer larger than a slot", rt->stage_layer(0), kPrecondition,
                 "stage_layer 0: needs 4.50 KiB but staging slots hold 1.50 KiB; call "
                 "configure_staging after registering");
  ASSERT_TRUE(rt->unregister(b).ok());
}

// --- the order of a step's hooks (See Note [Step states] in runtime/hooks.cpp) ---

TEST_F(CensusTest, HooksOutOfOrder) {
  expect_refused("before_forward without begin_step", rt()->before_forward(0), kPrecondition,
                 "before_forward: no step has begun; call begin_step first");
  expect_refused("after_backward without begin_step", rt()->after_backward(0), kPrecondition,
                 "after_backward: no step has begun; call begin_step first");
  expect_refused("end_step without begin_step", rt()->end_step(), kPrecondition,
                 "end_step: no step has begun; call begin_step first");
  expect_refused(
      "end_optimizer_step without begin_optimizer_step", rt()->end_optimizer_step(), kPrecondition,
      "end_optimizer_step: no optimizer step has begun; call begin_optimizer_step first");
  ASSERT_TRUE(rt()->begin_step().ok());
  expect_refused("begin_step twice", rt()->begin_step(), kPrecondition,
                 "begin_step: the step begun last has not ended; call end_step first");
  expect_refused("before_forward of a layer that does not exist", rt()->before_forward(99),
                 kInvalid, "before_forward(99): no such layer; the registered layers are 0");
  expect_refused(
      "acquire_layer of a layer that does not exist",
      rt()->acquire_layer(99, RoleSet::all(), Tier::kGpu, rt()->compute_stream()).status(),
      kInvalid, "acquire_layer(99): no such layer; the registered layers are 0");
  ASSERT_TRUE(rt()->begin_optimizer_step().ok());
  expect_refused("begin_optimizer_step twice", rt()->begin_optimizer_step(), kPrecondition,
                 "begin_optimizer_step: the optimizer step begun last has not ended; call "
                 "end_optimizer_step first");
  expect_refused("before_forward during the optimizer step", rt()->before_forward(0), kPrecondition,
                 "before_forward: the optimizer step has not ended; call end_optimizer_step first");
  expect_refused("end_step during the optimizer step", rt()->end_step(), kPrecondition,
                 "end_step: the optimizer step has not ended; call end_optimizer_step first");
  expect_refused("offload_all during the optimizer step", rt()->offload_all(), kPrecondition,
                 "offload_all: the optimizer step has not ended; call end_optimizer_step first");
  ASSERT_TRUE(rt()->end_optimizer_step().ok());
  ASSERT_TRUE(rt()->acquire(w_, Tier::kGpu, rt()->compute_stream()).ok());
  expect_refused("end_step with a tensor still held", rt()->end_step(), kPrecondition,
                 "end_step: tensors are still held (acquire without release): 'w' (1); release "
                 "them, then call end_step again");
  ASSERT_TRUE(rt()->release(w_, rt()->compute_stream()).ok());
  ASSERT_TRUE(rt()->end_step().ok());
}

// --- policy choice and configuration ---

absl::Status create_status(std::optional<std::string> policy, PolicyConfig config) {
  RuntimeOptions options;
  options.policy = std::move(policy);
  options.policy_config = config;
  options.device = DeviceKind::kSimulated;
  return Runtime::create(std::move(options), policy::builtin_policies()).status();
}

TEST(PolicyCensusTest, ChoiceAndConfiguration) {
  expect_refused(
      "an unknown policy", create_status("fastest", {}), kInvalid,
      "unknown policy 'fastest'; valid policies: bulk, hybrid, keep_on_gpu, layer_prefetch "
      "(policy chosen by RuntimeOptions::policy)");
  expect_refused(
      "an empty policy name", create_status("", {}), kInvalid,
      "empty policy name; valid policies: bulk, hybrid, keep_on_gpu, layer_prefetch (policy "
      "chosen by RuntimeOptions::policy)");
  expect_refused("a negative prefetch depth",
                 create_status("layer_prefetch", {.prefetch_depth = -1}), kInvalid,
                 "layer_prefetch: prefetch depth -1 is negative; use 0 (no prefetch) or more "
                 "(policy chosen by RuntimeOptions::policy)");
  expect_refused("bulk with no roles", create_status("bulk", {.roles = RoleSet()}), kInvalid,
                 "bulk: roles to move must not be empty (policy chosen by RuntimeOptions::policy)");
  expect_refused("layer_prefetch with no roles",
                 create_status("layer_prefetch", {.roles = RoleSet()}), kInvalid,
                 "layer_prefetch: roles to stream must not be empty (policy chosen by "
                 "RuntimeOptions::policy)");
  PolicyRegistry registry;
  auto factory = [](const PolicyConfig& c) { return policy::make_keep_on_gpu(c); };
  expect_refused("a policy with no name", registry.add("", factory), kInvalid,
                 "a policy needs a name");
  ASSERT_TRUE(registry.add("mine", factory).ok());
  expect_refused("a policy added twice", registry.add("mine", factory),
                 absl::StatusCode::kAlreadyExists, "policy 'mine' is registered already");
}

TEST(PolicyCensusTest, LayerPrefetchBudgetSmallerThanOneLayer) {
  auto [rt, dev] = make_runtime("layer_prefetch", {}, false, 4 * kMiB);
  expect_refused(
      "a layer larger than layer_prefetch's GPU budget",
      rt->register_tensor(spec("big.exp_avg", 0, Role::kOptimizerState, 2 * 1024 * 1024)).status(),
      kInvalid,
      "layer_prefetch: the GPU budget (4.00 MiB) is smaller than one layer: layer 0 has "
      "8.00 MiB of optimizer_state");
  EXPECT_TRUE(rt->tensors().empty());
  for (Tier t : alloc::kAllTiers) EXPECT_EQ(rt->allocator().stats(t).allocated_bytes.current, 0);
}

class CountPrinter : public ::testing::Environment {
 public:
  void TearDown() override {
    std::printf("bad inputs tried: %zu distinct\n", census_checks().size());
  }
};
const auto* const kPrinter = ::testing::AddGlobalTestEnvironment(new CountPrinter);

}  // namespace
}  // namespace strata::rt
