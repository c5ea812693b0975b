// Registry tests on the simulated device: registering, finding, unregistering, the bad inputs of
// RELIABILITY.md that apply (each refused with nothing changed), and the leak report.
#include <cstdlib>

#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using testing::make_runtime;
using testing::read_all;
using testing::spec;
using testing::special_payload;

TEST(RegistryTest, RegisterFindInfoUnregister) {
  auto [rt, dev] = make_runtime("bulk");
  auto payload = special_payload(4000, 1);
  absl::StatusOr<TensorHandle> h =
      rt->register_tensor(spec("l0.w", 0, Role::kParameter, 1000), payload.data());
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(*rt->find("l0.w"), *h);
  TensorInfo info = *rt->info(*h);
  EXPECT_EQ(info.bytes, 4000u);
  EXPECT_EQ(info.tier, Tier::kGpu);
  EXPECT_FALSE(info.in_flight);
  EXPECT_EQ(read_all(*rt, *h), payload);
  ASSERT_TRUE(rt->unregister(*h).ok());
  EXPECT_EQ(rt->find("l0.w").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(rt->info(*h).status().code(), absl::StatusCode::kNotFound);
}

TEST(RegistryTest, LayersRolesAndOrder) {
  auto [rt, dev] = make_runtime("bulk");
  for (int layer : {2, 0, 1}) {
    for (auto [name, role] :
         {std::pair{"parameter", Role::kParameter}, std::pair{"exp_avg", Role::kOptimizerState},
          std::pair{"exp_avg_sq", Role::kOptimizerState}}) {
      ASSERT_TRUE(
          rt->register_tensor(spec(str_cat("l", layer, ".", name), layer, role, 10 + layer)).ok());
    }
  }
  EXPECT_EQ(rt->layers(), (std::vector<int>{0, 1, 2}));
  std::vector<TensorHandle> states = rt->layer_tensors(1, RoleSet::optimizer_states());
  ASSERT_EQ(states.size(), 2u);
  EXPECT_EQ(rt->info(states[0])->spec.name, "l1.exp_avg");
  EXPECT_EQ(rt->info(states[1])->spec.name, "l1.exp_avg_sq");
  EXPECT_EQ(rt->layer_bytes(2, RoleSet::optimizer_states()), 2u * 12 * 4);
  EXPECT_EQ(rt->tensors().size(), 9u);
}

TEST(RegistryTest, ZeroSizeTensorNeedsNoStorage) {
  auto [rt, dev] = make_runtime("bulk", {.roles = RoleSet::all()});
  absl::StatusOr<TensorHandle> h = rt->register_tensor(spec("empty", 0, Role::kParameter, 0));
  ASSERT_TRUE(h.ok()) << h.status();
  // With no bytes there is nothing to move: a phase switch leaves it where it is.
  ASSERT_TRUE(rt->offload_all().ok());
  EXPECT_EQ(rt->info(*h)->tier, Tier::kGpu);
  ASSERT_TRUE(rt->reload_all().ok());
  EXPECT_EQ(rt->info(*h)->tier, Tier::kGpu);
  EXPECT_TRUE(read_all(*rt, *h).empty());
}

class BadRuntimeInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    made_ = make_runtime("bulk");
    rt_ = made_.rt.get();
    payload_ = special_payload(1024, 11);
    h_ = *rt_->register_tensor(spec("w", 0, Role::kParameter, 256), payload_.data());
  }
  void TearDown() override {
    // Nothing changed.
    EXPECT_EQ(rt_->tensors().size(), 1u);
    EXPECT_EQ(read_all(*rt_, h_), payload_);
    EXPECT_EQ(rt_->info(h_)->tier, Tier::kGpu);
  }
  void expect(const absl::Status& s, absl::StatusCode code, const std::string& message) {
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_EQ(s.message(), message);
  }
  testing::Made made_;
  Runtime* rt_ = nullptr;
  std::vector<unsigned char> payload_;
  TensorHandle h_;
};

TEST_F(BadRuntimeInputTest, RegisterTwice) {
  expect(rt_->register_tensor(spec("w", 0, Role::kParameter, 256)).status(),
         absl::StatusCode::kAlreadyExists,
         "register_tensor: a tensor named 'w' is registered already");
}
TEST_F(BadRuntimeInputTest, SameNameForADifferentTensor) {
  expect(rt_->register_tensor(spec("w", 3, Role::kGradient, 10, DType::kFloat16)).status(),
         absl::StatusCode::kAlreadyExists,
         "register_tensor: a tensor named 'w' is registered already");
}
TEST_F(BadRuntimeInputTest, UnregisterTwice) {
  TensorHandle other = *rt_->register_tensor(spec("x", 0, Role::kOther, 4));
  ASSERT_TRUE(rt_->unregister(other).ok());
  expect(rt_->unregister(other), absl::StatusCode::kNotFound,
         str_cat("tensor handle ", other.id, " is not registered"));
}
TEST_F(BadRuntimeInputTest, UseAfterUnregister) {
  TensorHandle other = *rt_->register_tensor(spec("x", 0, Role::kOther, 4));
  ASSERT_TRUE(rt_->unregister(other).ok());
  expect(rt_->migrate(other, Tier::kPinnedHost), absl::StatusCode::kNotFound,
         str_cat("tensor handle ", other.id, " is not registered"));
  expect(rt_->acquire(other, Tier::kGpu, nullptr).status(), absl::StatusCode::kNotFound,
         str_cat("tensor handle ", other.id, " is not registered"));
}
TEST_F(BadRuntimeInputTest, NegativeLayer) {
  expect(rt_->register_tensor(spec("y", -1, Role::kOther, 4)).status(),
         absl::StatusCode::kInvalidArgument, "register_tensor 'y': layer -1 is negative");
}
TEST_F(BadRuntimeInputTest, NegativeDimension) {
  TensorSpec s = spec("y", 0, Role::kOther, 4);
  s.shape = {3, -2};
  expect(rt_->register_tensor(s).status(), absl::StatusCode::kInvalidArgument,
         "tensor 'y': negative dimension -2 in its shape");
}
TEST_F(BadRuntimeInputTest, SizeOverflow) {
  TensorSpec s = spec("y", 0, Role::kOther, 4);
  s.shape = {std::int64_t{1} << 40, std::int64_t{1} << 40};
  expect(rt_->register_tensor(s).status(), absl::StatusCode::kInvalidArgument,
         "tensor 'y': numel overflows");
}
TEST_F(BadRuntimeInputTest, EmptyName) {
  expect(rt_->register_tensor(spec("", 0, Role::kOther, 4)).status(),
         absl::StatusCode::kInvalidArgument, "register_tensor: empty name");
}
TEST_F(BadRuntimeInputTest, ReleaseWithoutAcquire) {
  expect(rt_->release(h_, nullptr), absl::StatusCode::kFailedPrecondition,
         "release 'w': it is not acquired");
}
TEST_F(BadRuntimeInputTest, UnstagedLayerIsANoOpAndUnknownRoleFails) {
  EXPECT_TRUE(rt_->unstage_layer(42).ok());
  EXPECT_EQ(parse_role("momentum").status().message(),
            "unknown role 'momentum'; valid roles: parameter, gradient, optimizer_state, other (an "
            "optimizer's states move together as optimizer_state; See Note [Roles] in "
            "runtime/tensor.h)");
}

TEST(LeakTest, UnregisteringEverythingLeavesNoLiveBytes) {
  auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1});
  std::vector<TensorHandle> all;
  for (int layer = 0; layer < 4; ++layer) {
    all.push_back(
        *rt->register_tensor(spec(str_cat("l", layer, ".w"), layer, Role::kParameter, 999)));
    all.push_back(
        *rt->register_tensor(spec(str_cat("l", layer, ".m"), layer, Role::kOptimizerState, 5000)));
    all.push_back(
        *rt->register_tensor(spec(str_cat("l", layer, ".v"), layer, Role::kOptimizerState, 5000)));
  }
  testing::empty_optimizer_step(*rt);
  ASSERT_TRUE(rt->migrate(all[0], Tier::kPageableHost).ok());  // uses the bounce buffers
  for (TensorHandle h : all) ASSERT_TRUE(rt->unregister(h).ok());
  for (Tier tier : alloc::kAllTiers) {
    EXPECT_EQ(rt->allocator().stats(tier).allocated_bytes.current, 0) << tier_name(tier);
  }
  EXPECT_TRUE(rt->allocator().leak_report().empty()) << rt->allocator().format_leak_report();
  EXPECT_EQ(rt->stats().staging_bytes, 0);
}

}  // namespace
}  // namespace strata::rt
