// Setup tests: choosing the policy by name (given, STRATA_POLICY, default), parsing a device name,
// building a program's options (runtime/setup.h), bad policy parameters, and every RuntimeStats
// figure by name.
#include <cstdlib>
#include <map>
#include <string>
#include <variant>

#include "allocator/upstream.h"
#include "base/strings.h"
#include "runtime/setup.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using testing::make_runtime;
using testing::spec;

TEST(PolicyChoiceTest, GivenThenEnvironmentThenDefault) {
  unsetenv("STRATA_POLICY");
  EXPECT_EQ(choose_policy_name(std::nullopt).name, "layer_prefetch");
  EXPECT_EQ(choose_policy_name(std::nullopt).source, "default");
  setenv("STRATA_POLICY", "bulk", 1);
  EXPECT_EQ(choose_policy_name(std::nullopt).name, "bulk");
  EXPECT_EQ(choose_policy_name(std::nullopt).source, "STRATA_POLICY");
  EXPECT_EQ(choose_policy_name(std::string("keep_on_gpu")).name, "keep_on_gpu");
  EXPECT_EQ(choose_policy_name(std::string("keep_on_gpu")).source, "RuntimeOptions::policy");
  // A program names the flag or argument it read the name from.
  EXPECT_EQ(choose_policy_name(std::string("hybrid"), "--strata_policy").source, "--strata_policy");
  // Given but empty (--strata_policy=) stays empty, so that creating the runtime refuses it.
  EXPECT_EQ(choose_policy_name(std::string(""), "--strata_policy").name, "");
  RuntimeOptions options;
  options.policy = "";
  options.device = DeviceKind::kSimulated;
  EXPECT_EQ(
      Runtime::create(std::move(options), policy::builtin_policies()).status().message(),
      "empty policy name; valid policies: bulk, hybrid, keep_on_gpu, layer_prefetch (policy chosen "
      "by RuntimeOptions::policy)");
  unsetenv("STRATA_POLICY");
}

// See Note [One CUDA device a runtime] in runtime/runtime.h.
TEST(DeviceTest, ParsedByNameWithTheCudaDeviceOptional) {
  auto kind_of = [](std::string_view name) { return parse_device(name)->kind; };
  auto index_of = [](std::string_view name) { return parse_device(name)->cuda_device; };
  EXPECT_EQ(kind_of("auto"), DeviceKind::kAuto);
  EXPECT_EQ(kind_of("cuda"), DeviceKind::kCuda);
  EXPECT_EQ(index_of("cuda"), kCurrentCudaDevice);
  EXPECT_EQ(kind_of("cuda:0"), DeviceKind::kCuda);
  EXPECT_EQ(index_of("cuda:0"), 0);
  EXPECT_EQ(index_of("cuda:7"), 7);
  EXPECT_EQ(kind_of("simulated"), DeviceKind::kSimulated);
  for (std::string_view bad : {"gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1x", "cuda 1", "CUDA"}) {
    absl::StatusOr<DeviceChoice> got = parse_device(bad);
    ASSERT_FALSE(got.ok()) << bad;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(got.status().message(),
              str_cat("unknown device '", bad,
                      "'; use auto (the GPU if there is one), cuda (the current CUDA device), "
                      "cuda:N (CUDA device N) or simulated"));
  }
}

// A CUDA device asked for on a machine without one is refused at creation, naming why.
TEST(DeviceTest, ACudaDeviceWhereThereIsNoneIsRefused) {
  if (alloc::cuda_device_count() > 0) GTEST_SKIP() << "this machine has a GPU";
  RuntimeOptions options;
  options.device = DeviceKind::kCuda;
  options.cuda_device = 1;
  absl::StatusOr<std::unique_ptr<Runtime>> made =
      Runtime::create(std::move(options), policy::builtin_policies());
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().code(), absl::StatusCode::kUnavailable) << made.status();
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

TEST(ProgramSetupTest, AProgramsOptionsRestTheMovedRolesOnTheHostAndTrackAllocations) {
  ProgramSetup setup;
  setup.policy = "bulk";
  setup.policy_source = "--strata_policy";
  setup.device = DeviceKind::kSimulated;
  setup.prefetch_depth = 3;
  setup.roles = RoleSet::all();
  setup.overlap = Overlap::kBackward;
  setup.undo_on_gpu = true;
  setup.gpu_budget = std::size_t{64} << 20;
  const RuntimeOptions o = runtime_options(setup);
  EXPECT_EQ(o.policy, "bulk");
  EXPECT_EQ(o.policy_source, "--strata_policy");
  EXPECT_EQ(o.device, DeviceKind::kSimulated);
  EXPECT_EQ(o.policy_config.prefetch_depth, 3);
  EXPECT_TRUE(o.policy_config.roles.contains(Role::kParameter));
  EXPECT_EQ(o.policy_config.overlap, Overlap::kBackward);
  EXPECT_TRUE(o.policy_config.undo_on_gpu);
  EXPECT_FALSE(o.policy_config.hybrid_fraction.has_value());
  EXPECT_TRUE(o.policy_config.offload_after_step);
  EXPECT_TRUE(o.allocator.track_allocations);
  EXPECT_EQ(o.allocator.budgets[alloc::tier_index(Tier::kGpu)], std::size_t{64} << 20);
  // No pinned budget given: the allocator's default stays.
  EXPECT_EQ(o.allocator.budgets[alloc::tier_index(Tier::kPinnedHost)],
            alloc::AllocatorOptions{}.budgets[alloc::tier_index(Tier::kPinnedHost)]);

  // The runtime's errors name where the policy came from.
  ProgramSetup bad;
  bad.policy = "lazy";
  bad.policy_source = "--strata_policy";
  bad.device = DeviceKind::kSimulated;
  EXPECT_EQ(Runtime::create(runtime_options(bad), policy::builtin_policies()).status().message(),
            "unknown policy 'lazy'; valid policies: bulk, hybrid, keep_on_gpu, layer_prefetch "
            "(policy chosen by --strata_policy)");
}

TEST(NamedStatsTest, EveryFigureOnceWithTheRuntimesValue) {
  auto [rt, dev] = make_runtime("bulk");
  TensorHandle h = *rt->register_tensor(spec("w", 0, Role::kParameter, 1 << 18));
  ASSERT_TRUE(rt->migrate(h, Tier::kPinnedHost).ok());
  ASSERT_TRUE(rt->wait_all().ok());
  const RuntimeStats s = rt->stats();
  ASSERT_GT(s.migrated_bytes_d2h, 0);
  std::map<std::string, StatValue> by_name;
  for (const auto& [name, value] : named_stats(s)) {
    EXPECT_TRUE(by_name.emplace(std::string(name), value).second) << name << " twice";
  }
  EXPECT_EQ(std::get<std::int64_t>(by_name.at("migrated_bytes_d2h")), s.migrated_bytes_d2h);
  EXPECT_EQ(std::get<std::int64_t>(by_name.at("num_migrations")), s.num_migrations);
  EXPECT_EQ(std::get<std::int64_t>(by_name.at("host_syncs")), s.host_syncs);
  EXPECT_EQ(std::get<double>(by_name.at("prefetch_stall_ms")), s.prefetch_stall_ns / 1e6);
  EXPECT_EQ(std::get<double>(by_name.at("d2h_gbps")), s.d2h_gbps());
  EXPECT_TRUE(by_name.contains("undo_copied_bytes"));
  EXPECT_TRUE(by_name.contains("gpu_upstream_free_ms"));
}

}  // namespace
}  // namespace strata::rt
