// Residency guard tests on the simulated device: acquire makes the GPU wait and holds, a move after
// release waits for the compute stream, hooks fence it, releases on two streams are both waited
// for.
#include <cstdlib>

#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using testing::make_runtime;
using testing::read_all;
using testing::spec;
using testing::special_payload;

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

}  // namespace
}  // namespace strata::rt
