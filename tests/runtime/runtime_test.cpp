// Runtime unit tests on the simulated device: the registry, migrations and their failure modes,
// residency guards, staging, policy selection and the bad inputs of RELIABILITY.md that apply.
#include <cstdlib>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "tests/runtime/runtime_test_util.h"

ABSL_DECLARE_FLAG(strata::rt::PolicyFlag, strata_policy);

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

TEST(MigrationTest, MigratesBetweenEveryTierPairBitExactly) {
  auto [rt, dev] = make_runtime("bulk");
  auto payload = special_payload((std::size_t{37} << 20) + 3, 7);  // > 2 bounce chunks, odd size
  TensorHandle h = *rt->register_tensor(spec("t", 0, Role::kOther, payload.size(), DType::kUInt8),
                                        payload.data());
  const Tier path[] = {Tier::kPinnedHost,   Tier::kPageableHost, Tier::kGpu,
                       Tier::kPageableHost, Tier::kPinnedHost,   Tier::kGpu};
  for (Tier t : path) {
    ASSERT_TRUE(rt->migrate(h, t).ok()) << tier_name(t);
    ASSERT_TRUE(rt->wait_all().ok());
    EXPECT_EQ(rt->info(h)->tier, t);
    ASSERT_EQ(read_all(*rt, h), payload) << "after moving to " << tier_name(t);
  }
  RuntimeStats s = rt->stats();
  EXPECT_EQ(s.num_migrations, 6);
  EXPECT_EQ(s.migrated_bytes_h2d, static_cast<std::int64_t>(2 * payload.size()));
  EXPECT_EQ(s.migrated_bytes_d2h, static_cast<std::int64_t>(2 * payload.size()));
  EXPECT_EQ(s.migrated_bytes_h2h, static_cast<std::int64_t>(2 * payload.size()));
}

TEST(MigrationTest, InFlightUntilTheCopyEventCompletes) {
  auto [rt, dev] = make_runtime("bulk", {}, /*deferred=*/true);
  auto payload = special_payload(1 << 20, 3);
  TensorHandle h =
      *rt->register_tensor(spec("t", 0, Role::kOptimizerState, 1 << 18), payload.data());
  void* source = rt->info(h)->data;
  ASSERT_TRUE(rt->migrate(h, Tier::kPinnedHost).ok());
  ASSERT_TRUE(rt->poll().ok());
  TensorInfo info = *rt->info(h);
  EXPECT_TRUE(info.in_flight);
  EXPECT_EQ(info.tier, Tier::kGpu);  // still reads from the source
  EXPECT_EQ(info.data, source);
  EXPECT_EQ(rt->migrate(h, Tier::kGpu).code(), absl::StatusCode::kFailedPrecondition);
  dev->run_pending();
  ASSERT_TRUE(rt->poll().ok());
  info = *rt->info(h);
  EXPECT_FALSE(info.in_flight);
  EXPECT_EQ(info.tier, Tier::kPinnedHost);
  EXPECT_EQ(info.version, 1u);
  EXPECT_EQ(read_all(*rt, h), payload);
}

TEST(MigrationTest, FailedDestinationLeavesTheTensorAtItsSource) {
  // F2: the destination tier has no room; the tensor stays, bit for bit, and can move later.
  RuntimeOptions options;
  options.policy = "bulk";
  options.device = DeviceKind::kSimulated;
  options.allocator.budgets[alloc::tier_index(Tier::kPinnedHost)] = 4 << 20;
  auto rt = *Runtime::create(std::move(options), policy::builtin_policies());
  auto payload = special_payload(8 << 20, 5);
  TensorHandle h =
      *rt->register_tensor(spec("big", 0, Role::kOptimizerState, 2 << 20), payload.data());
  const TensorInfo before = *rt->info(h);
  absl::Status s = rt->migrate(h, Tier::kPinnedHost);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(s.message()).find("moving 'big' to pinned_host"), std::string::npos) << s;
  EXPECT_NE(std::string(s.message()).find("out of memory in tier pinned_host"), std::string::npos);
  const TensorInfo after = *rt->info(h);
  EXPECT_EQ(after.tier, before.tier);
  EXPECT_EQ(after.data, before.data);
  EXPECT_FALSE(after.in_flight);
  EXPECT_EQ(read_all(*rt, h), payload);
  EXPECT_EQ(rt->stats().failed_migrations, 1);
  ASSERT_TRUE(rt->allocator().set_budget(Tier::kPinnedHost, 64 << 20).ok());
  ASSERT_TRUE(rt->migrate(h, Tier::kPinnedHost).ok());
  ASSERT_TRUE(rt->wait_all().ok());
  EXPECT_EQ(read_all(*rt, h), payload);
}

TEST(GuardTest, AcquireWaitsOnTheGpuAndHoldsTheTensor) {
  auto [rt, dev] = make_runtime("bulk", {}, /*deferred=*/true);
  auto payload = special_payload(4096, 9);
  TensorHandle h = *rt->register_tensor(
      spec("t", 0, Role::kOptimizerState, 1024, DType::kFloat32, Tier::kPinnedHost),
      payload.data());
  StreamHandle compute = rt->compute_stream();
  const std::int64_t syncs = rt->stats().host_syncs;  // registration waits once, to copy in
  absl::StatusOr<void*> p = rt->acquire(h, Tier::kGpu, compute);  // demand fetch
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(rt->stats().prefetch_waits, 1);
  EXPECT_EQ(rt->stats().host_syncs, syncs) << "acquire must not wait on the host";
  // A "kernel" on the compute stream sees the data: it runs after the copy.
  std::vector<unsigned char> seen(4096);
  ASSERT_TRUE(dev->enqueue_host(compute, [&] { std::memcpy(seen.data(), *p, 4096); }).ok());
  EXPECT_EQ(rt->migrate(h, Tier::kPinnedHost).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(rt->unregister(h).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(rt->release(h, compute).ok());
  EXPECT_EQ(rt->release(h, compute).code(), absl::StatusCode::kFailedPrecondition);
  dev->run_pending();
  EXPECT_EQ(seen, payload);
  ASSERT_TRUE(rt->poll().ok());
  EXPECT_EQ(rt->info(h)->tier, Tier::kGpu);
}

TEST(GuardTest, MoveAfterReleaseWaitsForTheComputeStream) {
  auto [rt, dev] = make_runtime("bulk", {}, /*deferred=*/true);
  std::vector<float> values(256, 1.0f);
  TensorHandle h = *rt->register_tensor(spec("t", 0, Role::kOptimizerState, 256), values.data());
  StreamHandle compute = rt->compute_stream();
  void* p = *rt->acquire(h, Tier::kGpu, compute);
  // The compute stream writes 2.0 later than the host queues the move home.
  ASSERT_TRUE(dev->enqueue_host(compute,
                                [p] {
                                  auto* f = static_cast<float*>(p);
                                  for (int i = 0; i < 256; ++i) f[i] = 2.0f;
                                })
                  .ok());
  ASSERT_TRUE(rt->release(h, compute).ok());
  ASSERT_TRUE(rt->migrate(h, Tier::kPinnedHost).ok());
  dev->run_pending();
  ASSERT_TRUE(rt->wait_all().ok());
  std::vector<float> back(256);
  ASSERT_TRUE(rt->read(h, back.data()).ok());
  EXPECT_EQ(back, std::vector<float>(256, 2.0f)) << "the copy ran before the compute stream wrote";
}

TEST(GuardTest, HooksFenceTheComputeStreamBeforeMoving) {
  // Work the training loop queued before offload_all (here a host function on a stream the runtime
  // was told about, writing 3.0) finishes before the offload copies read (See Note [Compute fence]
  // in runtime/migration.cpp).
  auto [rt, dev] = make_runtime("bulk", {.roles = RoleSet::all()}, /*deferred=*/true);
  std::vector<float> values(512, 1.0f);
  TensorHandle h = *rt->register_tensor(spec("w", 0, Role::kParameter, 512), values.data());
  StreamHandle torch_like = *dev->create_stream();
  rt->set_compute_stream(torch_like);
  EXPECT_EQ(rt->compute_stream(), torch_like);
  void* gpu = rt->info(h)->data;
  ASSERT_TRUE(dev->enqueue_host(torch_like,
                                [gpu] {
                                  auto* f = static_cast<float*>(gpu);
                                  for (int i = 0; i < 512; ++i) f[i] = 3.0f;
                                })
                  .ok());
  ASSERT_TRUE(rt->offload_all().ok());
  std::vector<float> back(512);
  ASSERT_TRUE(rt->read(h, back.data()).ok());
  EXPECT_EQ(back, std::vector<float>(512, 3.0f));
}

TEST(GuardTest, ReleasesOnTwoStreamsAreBothWaitedFor) {
  // Two streams use the tensor; the later release must not drop the earlier stream's event.
  auto [rt, dev] = make_runtime("bulk", {}, /*deferred=*/true);
  std::vector<float> values(64, 1.0f);
  TensorHandle h = *rt->register_tensor(spec("t", 0, Role::kOptimizerState, 64), values.data());
  StreamHandle s1 = *dev->create_stream();
  StreamHandle s2 = *dev->create_stream();
  void* p = *rt->acquire(h, Tier::kGpu, s1);
  ASSERT_TRUE(rt->acquire(h, Tier::kGpu, s2).ok());
  ASSERT_TRUE(dev->enqueue_host(s1,
                                [p] {
                                  auto* f = static_cast<float*>(p);
                                  for (int i = 0; i < 64; ++i) f[i] = 5.0f;
                                })
                  .ok());
  ASSERT_TRUE(rt->release(h, s1).ok());
  ASSERT_TRUE(rt->release(h, s2).ok());
  ASSERT_TRUE(rt->migrate(h, Tier::kPinnedHost).ok());
  // Run the copy streams and s2 first; s1 (with the write) last.
  for (int i = 0; i < 50; ++i) {
    for (StreamHandle s :
         {reinterpret_cast<StreamHandle>(1), reinterpret_cast<StreamHandle>(2), s2}) {
      dev->run_one(s);
    }
  }
  dev->run_pending();
  ASSERT_TRUE(rt->wait_all().ok());
  std::vector<float> back(64);
  ASSERT_TRUE(rt->read(h, back.data()).ok());
  EXPECT_EQ(back, std::vector<float>(64, 5.0f)) << "the copy did not wait for stream s1";
}

TEST(PolicyChoiceTest, OptionThenFlagThenEnvironmentThenDefault) {
  absl::SetFlag(&FLAGS_strata_policy, PolicyFlag{});
  unsetenv("STRATA_POLICY");
  EXPECT_EQ(choose_policy_name(std::nullopt).name, "layer_prefetch");
  EXPECT_EQ(choose_policy_name(std::nullopt).source, "default");
  setenv("STRATA_POLICY", "bulk", 1);
  EXPECT_EQ(choose_policy_name(std::nullopt).name, "bulk");
  EXPECT_EQ(choose_policy_name(std::nullopt).source, "STRATA_POLICY");
  absl::SetFlag(&FLAGS_strata_policy, PolicyFlag{"keep_on_gpu"});
  EXPECT_EQ(choose_policy_name(std::nullopt).name, "keep_on_gpu");
  EXPECT_EQ(choose_policy_name(std::nullopt).source, "--strata_policy");
  EXPECT_EQ(choose_policy_name(std::string("bulk")).name, "bulk");
  EXPECT_EQ(choose_policy_name(std::string("bulk")).source, "RuntimeOptions::policy");
  // Given but empty (--strata_policy=) is an error, as an empty STRATA_POLICY is.
  absl::SetFlag(&FLAGS_strata_policy, PolicyFlag{""});
  EXPECT_EQ(choose_policy_name(std::nullopt).name, "");
  EXPECT_EQ(choose_policy_name(std::nullopt).source, "--strata_policy");
  RuntimeOptions options;
  options.device = DeviceKind::kSimulated;
  EXPECT_EQ(
      Runtime::create(std::move(options), policy::builtin_policies()).status().message(),
      "empty policy name; valid policies: bulk, hybrid, keep_on_gpu, layer_prefetch (policy chosen "
      "by --strata_policy)");
  absl::SetFlag(&FLAGS_strata_policy, PolicyFlag{});
  unsetenv("STRATA_POLICY");
}

TEST(PolicyChoiceTest, UnknownAndEmptyNamesListTheValidOnes) {
  RuntimeOptions options;
  options.policy = "lazy";
  options.device = DeviceKind::kSimulated;
  auto rt = Runtime::create(std::move(options), policy::builtin_policies());
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      rt.status().message(),
      "unknown policy 'lazy'; valid policies: bulk, hybrid, keep_on_gpu, layer_prefetch (policy "
      "chosen by RuntimeOptions::policy)");
  setenv("STRATA_POLICY", "", 1);
  RuntimeOptions from_env;
  from_env.device = DeviceKind::kSimulated;
  rt = Runtime::create(std::move(from_env), policy::builtin_policies());
  unsetenv("STRATA_POLICY");
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().message(),
            "empty policy name; valid policies: bulk, hybrid, keep_on_gpu, layer_prefetch (policy "
            "chosen by "
            "STRATA_POLICY)");
}

TEST(PolicyChoiceTest, InvalidParameters) {
  RuntimeOptions options;
  options.policy = "layer_prefetch";
  options.policy_config.prefetch_depth = -1;
  options.device = DeviceKind::kSimulated;
  auto rt = Runtime::create(std::move(options), policy::builtin_policies());
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().message(),
            "layer_prefetch: prefetch depth -1 is negative; use 0 (no prefetch) or more (policy "
            "chosen by RuntimeOptions::policy)");
  RuntimeOptions no_roles;
  no_roles.policy = "bulk";
  no_roles.policy_config.roles = RoleSet();
  no_roles.device = DeviceKind::kSimulated;
  EXPECT_EQ(Runtime::create(std::move(no_roles), policy::builtin_policies()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PolicyChoiceTest, GpuBudgetSmallerThanOneLayer) {
  auto [rt, dev] = make_runtime("layer_prefetch", {}, false, /*gpu_budget=*/8 << 20);
  ASSERT_TRUE(rt->register_tensor(spec("l0.m", 0, Role::kOptimizerState, 1 << 20)).ok());  // 4 MiB
  absl::StatusOr<TensorHandle> v =
      rt->register_tensor(spec("l0.v", 0, Role::kOptimizerState, 2 << 20));
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      v.status().message(),
      "layer_prefetch: the GPU budget (8.00 MiB) is smaller than one layer: layer 0 has 12.00 "
      "MiB of optimizer_state");
  EXPECT_EQ(rt->find("l0.v").status().code(), absl::StatusCode::kNotFound) << "registration undone";
  // Two slots of one 4 MiB layer fit 8 MiB exactly; a depth needing three does not.
  ASSERT_TRUE(rt->begin_optimizer_step().ok());
  ASSERT_TRUE(rt->end_optimizer_step().ok());
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
