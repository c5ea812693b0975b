// Migration tests on the simulated device: every tier pair bit for bit, a copy in flight until its
// event completes, a failed destination leaving the tensor at its source.
#include <cstdlib>

#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using testing::make_runtime;
using testing::read_all;
using testing::spec;
using testing::special_payload;

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

}  // namespace
}  // namespace strata::rt
