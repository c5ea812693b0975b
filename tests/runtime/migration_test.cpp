// Migration tests on the simulated device: every tier pair bit for bit, a copy in flight until its
// event completes, polls that ask each copy stream only up to its first copy not done, a failed
// destination leaving the tensor at its source.
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "tests/runtime/fault_injection.h"
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

// A bulk runtime on a deferred simulated device, behind a FaultInjectingDevice that counts the
// device calls, with kTensors optimizer states of 64 KiB registered.
struct CountingRuntime {
  static constexpr int kTensors = 12;
  explicit CountingRuntime(int seed) {
    RuntimeOptions options;
    options.policy = "bulk";
    auto simulated = std::make_unique<SimulatedDevice>();
    sim = simulated.get();
    sim->set_deferred(true);
    auto counting = std::make_unique<FaultInjectingDevice>(std::move(simulated));
    dev = counting.get();
    options.device_override = std::move(counting);
    rt = *Runtime::create(std::move(options), policy::builtin_policies());
    for (int i = 0; i < kTensors; ++i) {
      payloads.push_back(special_payload(1 << 16, seed + i));
      hs.push_back(
          *rt->register_tensor(spec("t" + std::to_string(i), 0, Role::kOptimizerState, 1 << 14),
                               payloads.back().data()));
    }
  }
  SimulatedDevice* sim = nullptr;
  FaultInjectingDevice* dev = nullptr;
  std::unique_ptr<Runtime> rt;
  std::vector<std::vector<unsigned char>> payloads;
  std::vector<TensorHandle> hs;
};

TEST(MigrationTest, PollAsksEachCopyStreamOnlyUntilACopyIsNotDone) {
  // See Note [Polling in stream order]: a poll asks one copy of each copy stream still copying,
  // and each copy once when it is done, however many are in flight.
  CountingRuntime c(0);
  constexpr int kTensors = CountingRuntime::kTensors;
  auto queries = [&c] { return c.dev->calls(DeviceCall::kQuery); };
  // The first half go to pinned memory: six copies queued on the D2H stream, none run.
  for (int i = 0; i < kTensors / 2; ++i)
    ASSERT_TRUE(c.rt->migrate(c.hs[i], Tier::kPinnedHost).ok());
  std::int64_t before = queries();
  for (int k = 0; k < 5; ++k) ASSERT_TRUE(c.rt->poll().ok());
  EXPECT_EQ(queries() - before, 5);
  c.sim->run_pending();
  before = queries();
  ASSERT_TRUE(c.rt->poll().ok());
  EXPECT_EQ(queries() - before, kTensors / 2);
  // Both streams: the first half come back (H2D), the second half go (D2H).
  for (int i = 0; i < kTensors; ++i) {
    ASSERT_FALSE(c.rt->info(c.hs[i])->in_flight);
    ASSERT_TRUE(c.rt->migrate(c.hs[i], i < kTensors / 2 ? Tier::kGpu : Tier::kPinnedHost).ok());
  }
  before = queries();
  for (int k = 0; k < 3; ++k) ASSERT_TRUE(c.rt->poll().ok());
  EXPECT_EQ(queries() - before, 3 * 2);
  ASSERT_TRUE(c.rt->wait_all().ok());
  for (int i = 0; i < kTensors; ++i) {
    EXPECT_EQ(c.rt->info(c.hs[i])->tier, i < kTensors / 2 ? Tier::kGpu : Tier::kPinnedHost);
    EXPECT_EQ(read_all(*c.rt, c.hs[i]), c.payloads[i]) << i;
  }
}

TEST(MigrationTest, PollReadsTheComputeStreamsWaitsOnlyUntilOneIsNotDone) {
  // See Note [Polling in stream order]: each acquire that waits for a copy adds a timed wait on the
  // compute stream; a poll asks for the first one not done, however many are pending.
  CountingRuntime c(40);
  constexpr int kTensors = CountingRuntime::kTensors;
  for (int i = 0; i < kTensors; ++i) ASSERT_TRUE(c.rt->migrate(c.hs[i], Tier::kPinnedHost).ok());
  ASSERT_TRUE(c.rt->wait_all().ok());
  // Every tensor comes to the GPU, and the compute stream waits for each copy.
  for (int i = 0; i < kTensors; ++i) ASSERT_TRUE(c.rt->migrate(c.hs[i], Tier::kGpu).ok());
  const StreamHandle compute = c.rt->compute_stream();
  for (int i = 0; i < kTensors; ++i) ASSERT_TRUE(c.rt->acquire(c.hs[i], Tier::kGpu, compute).ok());
  EXPECT_EQ(c.rt->stats().prefetch_waits, kTensors);
  auto queries = [&c] { return c.dev->calls(DeviceCall::kQuery); };
  std::int64_t before = queries();
  for (int k = 0; k < 4; ++k) ASSERT_TRUE(c.rt->poll().ok());
  // One for the H2D stream's first copy, one for the compute stream's first wait.
  EXPECT_EQ(queries() - before, 4 * 2);
  c.sim->run_pending();
  ASSERT_TRUE(c.rt->release(c.hs, compute).ok());
  ASSERT_TRUE(c.rt->wait_all().ok());
  for (int i = 0; i < kTensors; ++i) {
    EXPECT_EQ(c.rt->info(c.hs[i])->tier, Tier::kGpu);
    EXPECT_EQ(read_all(*c.rt, c.hs[i]), c.payloads[i]) << i;
  }
  // Every wait was read: later polls ask for nothing more than the copy streams' work.
  before = queries();
  ASSERT_TRUE(c.rt->poll().ok());
  EXPECT_EQ(queries() - before, 0);
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
