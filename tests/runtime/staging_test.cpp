// Staging ring tests on the simulated device (See Note [Staging ring] in runtime/runtime.h): the
// ring's peak, states that survive random interleavings of copies and compute, slots freed out of
// order, the order of a staged layer's copies, and write-backs that wait for compute.
#include <random>
#include <string>
#include <utility>

#include "tests/runtime/fault_injection.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using testing::make_runtime;
using testing::read_all;
using testing::spec;
using testing::special_payload;

TEST(StagingTest, PeakIsAtMostDepthPlusOneLayers) {
  for (int depth : {0, 1, 2, 4}) {
    auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = depth});
    // Layers of different sizes; the largest is layer 3.
    const std::size_t numel[] = {1000, 3000, 2000, 5000, 1500, 2500};
    for (int l = 0; l < 6; ++l) {
      ASSERT_TRUE(
          rt->register_tensor(spec(str_cat("m", l), l, Role::kOptimizerState, numel[l])).ok());
      ASSERT_TRUE(
          rt->register_tensor(spec(str_cat("v", l), l, Role::kOptimizerState, numel[l])).ok());
    }
    const std::size_t largest = 2 * ((5000 * 4 + 511) / 512 * 512);
    const std::int64_t syncs = rt->stats().host_syncs;
    for (int step = 0; step < 2; ++step) testing::empty_optimizer_step(*rt);
    RuntimeStats s = rt->stats();
    EXPECT_EQ(s.staging_bytes, static_cast<std::int64_t>((depth + 1) * largest)) << depth;
    EXPECT_LE(s.staged_peak_bytes, static_cast<std::int64_t>((depth + 1) * largest)) << depth;
    // The main GPU pool never held a state: streaming does not touch it.
    EXPECT_EQ(rt->allocator().stats(Tier::kGpu).allocated_bytes.peak, 0) << depth;
    EXPECT_EQ(s.host_syncs, syncs) << depth;
  }
}

// C1-like on the CPU: the optimizer adds 1 to every state element each step, as a host function on
// the compute stream, while the deferred device runs copies and compute in a random interleaving.
// After the steps every element must equal the step count: a slot refilled before its write-back
// finished, or a write-back that ran before the compute, would show.
TEST(StagingTest, StatesSurviveRandomInterleavingsOfCopiesAndCompute) {
  for (int depth : {0, 1, 2}) {
    auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = depth}, /*deferred=*/true);
    constexpr int kN = 777;
    for (int l = 0; l < 5; ++l) {
      ASSERT_TRUE(
          rt->register_tensor(spec(str_cat("m", l), l, Role::kOptimizerState, kN + l)).ok());
      ASSERT_TRUE(
          rt->register_tensor(spec(str_cat("v", l), l, Role::kOptimizerState, kN - l)).ok());
    }
    std::mt19937 rng(1234 + depth);
    auto jiggle = [&] {
      for (int i = rng() % 6; i > 0; --i) dev->run_one(reinterpret_cast<StreamHandle>(rng() % 4));
    };
    StreamHandle compute = rt->compute_stream();
    constexpr int kSteps = 12;
    for (int step = 0; step < kSteps; ++step) {
      ASSERT_TRUE(rt->begin_optimizer_step().ok());
      jiggle();
      for (int l : rt->optimizer_layer_order()) {
        absl::StatusOr<std::vector<void*>> ptrs =
            rt->acquire_layer(l, RoleSet::optimizer_states(), Tier::kGpu, compute);
        ASSERT_TRUE(ptrs.ok()) << ptrs.status();
        std::vector<TensorHandle> hs = rt->layer_tensors(l, RoleSet::optimizer_states());
        for (std::size_t i = 0; i < hs.size(); ++i) {
          const std::size_t n = rt->info(hs[i])->bytes / 4;
          float* f = static_cast<float*>((*ptrs)[i]);
          ASSERT_TRUE(dev->enqueue_host(compute,
                                        [f, n] {
                                          for (std::size_t k = 0; k < n; ++k) f[k] += 1.0f;
                                        })
                          .ok());
        }
        jiggle();
        ASSERT_TRUE(rt->release_layer(l, RoleSet::optimizer_states(), compute).ok());
        jiggle();
      }
      ASSERT_TRUE(rt->end_optimizer_step().ok());
      jiggle();
    }
    for (TensorHandle h : rt->tensors()) {
      std::vector<unsigned char> raw = read_all(*rt, h);
      const float* f = reinterpret_cast<const float*>(raw.data());
      for (std::size_t k = 0; k < raw.size() / 4; ++k) {
        ASSERT_EQ(f[k], static_cast<float>(kSteps))
            << rt->info(h)->spec.name << "[" << k << "] depth " << depth;
      }
    }
  }
}

// Layers 0 to n - 1, each one moment "m<layer>" of 100 floats in pinned memory, and a ring of
// `slots` for them.
void register_moments_and_ring(Runtime& rt, int n, int slots) {
  for (int l = 0; l < n; ++l) {
    ASSERT_TRUE(rt.register_tensor(spec(str_cat("m", l), l, Role::kOptimizerState, 100,
                                        DType::kFloat32, Tier::kPinnedHost))
                    .ok());
  }
  ASSERT_TRUE(rt.configure_staging(slots, RoleSet::optimizer_states()).ok());
}

TEST(StagingTest, SlotsFreedOutOfOrderAreReusedAndAFullRingSaysSo) {
  auto [rt, dev] = make_runtime("bulk", {.roles = RoleSet::optimizer_states()});
  register_moments_and_ring(*rt, 4, 2);
  ASSERT_TRUE(rt->stage_layer(0).ok());
  ASSERT_TRUE(rt->stage_layer(1).ok());
  absl::Status full = rt->stage_layer(2);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(full.message(),
            "stage_layer 2: all 2 staging slots hold layers (0, 1); unstage one first");
  ASSERT_TRUE(rt->unstage_layer(1).ok());  // not the ring's next slot
  ASSERT_TRUE(rt->stage_layer(2).ok());
  ASSERT_TRUE(rt->wait_all().ok());
  EXPECT_TRUE(rt->info(*rt->find("m2"))->staged);
  EXPECT_FALSE(rt->info(*rt->find("m1"))->staged);
  ASSERT_TRUE(rt->unstage_layer(0).ok());
  ASSERT_TRUE(rt->unstage_layer(2).ok());
  ASSERT_TRUE(rt->wait_all().ok());
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ(rt->info(*rt->find(str_cat("m", l)))->tier, Tier::kPinnedHost);
  }
}

// See Note [Draining slot] in policies/ring_plan.cpp: a fetch takes the free slot freed longest
// ago, whose write-back was queued first, whatever order layers leave in (backward releases the
// layers whose parameters stream in the reverse of their staging).
TEST(StagingTest, AFetchTakesTheFreeSlotFreedLongestAgo) {
  auto [rt, dev] = make_runtime("bulk", {.roles = RoleSet::optimizer_states()});
  register_moments_and_ring(*rt, 5, 3);
  auto address = [&](int layer) {  // where its fetch went, once done
    EXPECT_TRUE(rt->wait_all().ok());
    return rt->info(*rt->find(str_cat("m", layer)))->data;
  };
  std::vector<void*> slot;
  for (int l = 0; l < 3; ++l) {
    ASSERT_TRUE(rt->stage_layer(l).ok());
    slot.push_back(address(l));
  }
  ASSERT_TRUE(rt->unstage_layer(2).ok());  // freed first
  ASSERT_TRUE(rt->unstage_layer(1).ok());  // then this one, the ring's next position after 0
  ASSERT_TRUE(rt->stage_layer(3).ok());
  EXPECT_EQ(address(3), slot[2]);
  ASSERT_TRUE(rt->stage_layer(4).ok());
  EXPECT_EQ(address(4), slot[1]);
  for (int l : {0, 3, 4}) ASSERT_TRUE(rt->unstage_layer(l).ok());
  ASSERT_TRUE(rt->wait_all().ok());
}

// stage_layer queues a layer's copies in the order asked for, equal sizes in registration order,
// and staged_tensors() reports it; layer_prefetch asks for the step's first layer smallest first,
// its last largest first and the rest as registered (See Note [Staging order] in
// runtime/runtime.h).
std::vector<std::string> staged_names(const Runtime& rt, int layer) {
  std::vector<TensorHandle> handles;
  rt.staged_tensors(layer, handles);
  std::vector<std::string> out;
  for (TensorHandle h : handles) out.push_back(rt.info(h)->spec.name);
  return out;
}

// Three layers of moments of 300, 5000 and 1000 floats, registered in that order.
void register_mixed_moments(Runtime& rt) {
  for (int l = 0; l < 3; ++l) {
    for (auto [name, numel] : {std::pair{"a", 300}, std::pair{"b", 5000}, std::pair{"c", 1000}}) {
      for (const char* state : {"exp_avg", "exp_avg_sq"}) {
        ASSERT_TRUE(rt.register_tensor(spec(str_cat("l", l, ".", name, ".", state), l,
                                            Role::kOptimizerState, numel, DType::kFloat32,
                                            Tier::kPinnedHost))
                        .ok());
      }
    }
  }
}

TEST(StagingTest, CopiesAreQueuedInTheOrderAskedFor) {
  auto [rt, dev] = make_runtime("bulk", {.roles = RoleSet::optimizer_states()});
  register_mixed_moments(*rt);
  ASSERT_TRUE(rt->configure_staging(3, RoleSet::optimizer_states()).ok());
  EXPECT_TRUE(staged_names(*rt, 0).empty());  // not staged
  ASSERT_TRUE(rt->stage_layer(0).ok());
  ASSERT_TRUE(rt->stage_layer(1, std::nullopt, StageOrder::kSmallestFirst).ok());
  ASSERT_TRUE(rt->stage_layer(2, std::nullopt, StageOrder::kLargestFirst).ok());
  const std::vector<std::string> registered = {"l0.a.exp_avg", "l0.a.exp_avg_sq",
                                               "l0.b.exp_avg", "l0.b.exp_avg_sq",
                                               "l0.c.exp_avg", "l0.c.exp_avg_sq"};
  EXPECT_EQ(staged_names(*rt, 0), registered);
  const std::vector<std::string> smallest = {"l1.a.exp_avg", "l1.a.exp_avg_sq",
                                             "l1.c.exp_avg", "l1.c.exp_avg_sq",
                                             "l1.b.exp_avg", "l1.b.exp_avg_sq"};
  EXPECT_EQ(staged_names(*rt, 1), smallest);
  const std::vector<std::string> largest = {"l2.b.exp_avg", "l2.b.exp_avg_sq",
                                            "l2.c.exp_avg", "l2.c.exp_avg_sq",
                                            "l2.a.exp_avg", "l2.a.exp_avg_sq"};
  EXPECT_EQ(staged_names(*rt, 2), largest);
  for (int l = 0; l < 3; ++l) ASSERT_TRUE(rt->unstage_layer(l).ok());
  ASSERT_TRUE(rt->wait_all().ok());
  EXPECT_TRUE(staged_names(*rt, 1).empty());
}

TEST(StagingTest, LayerPrefetchStagesTheFirstLayerSmallestFirstAndTheLastSmallestLast) {
  auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1});
  register_mixed_moments(*rt);
  StreamHandle s = rt->compute_stream();
  ASSERT_TRUE(rt->begin_optimizer_step().ok());
  std::vector<std::string> first = staged_names(*rt, 0);
  ASSERT_EQ(first.size(), 6u);
  EXPECT_EQ(first[0], "l0.a.exp_avg");
  EXPECT_EQ(first[5], "l0.b.exp_avg_sq");
  EXPECT_EQ(staged_names(*rt, 1)[0], "l1.a.exp_avg");  // as registered
  EXPECT_EQ(staged_names(*rt, 1)[2], "l1.b.exp_avg");
  for (int l = 0; l < 3; ++l) {
    ASSERT_TRUE(rt->acquire_layer(l, RoleSet::optimizer_states(), Tier::kGpu, s).ok());
    ASSERT_TRUE(rt->release_layer(l, RoleSet::optimizer_states(), s).ok());
    if (l == 0) {
      std::vector<std::string> last = staged_names(*rt, 2);
      ASSERT_EQ(last.size(), 6u);
      EXPECT_EQ(last[0], "l2.b.exp_avg");
      EXPECT_EQ(last[5], "l2.a.exp_avg_sq");
    }
  }
  ASSERT_TRUE(rt->end_optimizer_step().ok());
}

// A bulk runtime streaming optimizer states over a deferred simulated device (copies run only when
// the test or a host wait says so), behind a FaultInjectingDevice that counts and can fail calls.
struct DeferredRuntime {
  std::unique_ptr<Runtime> runtime;
  SimulatedDevice* sim = nullptr;
  FaultInjectingDevice* dev = nullptr;
};

DeferredRuntime deferred_bulk_runtime() {
  RuntimeOptions options;
  options.policy = "bulk";
  options.policy_config = {.roles = RoleSet::optimizer_states()};
  auto simulated = std::make_unique<SimulatedDevice>();
  DeferredRuntime out;
  out.sim = simulated.get();
  out.sim->set_deferred(true);
  auto faulty = std::make_unique<FaultInjectingDevice>(std::move(simulated));
  out.dev = faulty.get();
  options.device_override = std::move(faulty);
  absl::StatusOr<std::unique_ptr<Runtime>> made =
      Runtime::create(std::move(options), policy::builtin_policies());
  EXPECT_TRUE(made.ok()) << made.status();
  if (made.ok()) out.runtime = std::move(*made);
  return out;
}

// The write-back of a staged tensor that compute acquired while it was still arriving waits once,
// for compute's release, not for the fetch as well (See Note [Covered arrival] in
// runtime/migration.cpp); the release already follows the fetch on the GPU, so the write-back
// cannot run before the fetch and the compute have.
TEST(StagingTest, AWriteBackWaitsForComputeWhichCoversTheFetch) {
  constexpr std::size_t kN = 1000;
  const std::vector<unsigned char> payload = special_payload(kN * 4, 3);
  auto [runtime, sim, dev] = deferred_bulk_runtime();
  ASSERT_NE(runtime, nullptr);
  Runtime& r = *runtime;
  TensorHandle m = *r.register_tensor(
      spec("m", 0, Role::kOptimizerState, kN, DType::kFloat32, Tier::kPinnedHost), payload.data());
  ASSERT_TRUE(r.configure_staging(1, RoleSet::optimizer_states()).ok());
  ASSERT_TRUE(r.stage_layer(0).ok());  // the fetch stays queued: the device is deferred
  StreamHandle compute = r.compute_stream();
  absl::StatusOr<void*> p = r.acquire(m, Tier::kGpu, compute);
  ASSERT_TRUE(p.ok()) << p.status();
  // "Compute" flips every bit it finds; it runs once the fetch has landed.
  void* staged = *p;
  ASSERT_TRUE(r.device()
                  .enqueue_host(compute,
                                [staged] {
                                  auto* b = static_cast<unsigned char*>(staged);
                                  for (std::size_t i = 0; i < kN * 4; ++i) b[i] ^= 0xff;
                                })
                  .ok());
  ASSERT_TRUE(r.release(m, compute).ok());
  dev->fail_call(DeviceCall::kStreamWait, 1000000);  // counts the waits from here, fails none
  ASSERT_TRUE(r.unstage_layer(0).ok());
  EXPECT_EQ(dev->calls(DeviceCall::kStreamWait), 1) << "the write-back waits for compute only";
  dev->disarm();
  // The write-back cannot run ahead: nothing on the D2H stream moves before the fetch and compute.
  EXPECT_FALSE(sim->run_one(r.d2h_stream()));
  ASSERT_TRUE(r.wait_all().ok());
  std::vector<unsigned char> want = payload;
  for (unsigned char& b : want) b ^= 0xff;
  EXPECT_EQ(read_all(r, m), want);
}

// A slot's next fetch must wait until the write-backs out of it have read it, also when the event
// that marks that could not be recorded at first and unstage_layer was retried. Each case fails the
// k-th event record of unstage_layer, retries it, refills the one slot, and then runs the H2D
// stream ahead of everything it is not made to wait for: the write-back must still carry layer 0's
// bytes.
TEST(StagingTest, ARetriedUnstageStillGuardsTheSlotAgainstTheNextFetch) {
  constexpr std::size_t kN = 1000;
  const std::vector<unsigned char> first = special_payload(kN * 4, 1);
  const std::vector<unsigned char> second = special_payload(kN * 4, 2);
  int failed_records = 0;
  for (std::int64_t k = 1; k <= 8; ++k) {
    auto [runtime, sim, dev] = deferred_bulk_runtime();
    ASSERT_NE(runtime, nullptr);
    Runtime& r = *runtime;
    for (int l = 0; l < 2; ++l) {
      ASSERT_TRUE(r.register_tensor(spec(str_cat("m", l), l, Role::kOptimizerState, kN,
                                         DType::kFloat32, Tier::kPinnedHost),
                                    (l == 0 ? first : second).data())
                      .ok());
    }
    ASSERT_TRUE(r.configure_staging(1, RoleSet::optimizer_states()).ok());
    ASSERT_TRUE(r.stage_layer(0).ok());
    ASSERT_TRUE(r.wait_all().ok());

    dev->fail_call(DeviceCall::kRecord, k);
    absl::Status unstaged = r.unstage_layer(0);
    dev->disarm();
    if (!unstaged.ok()) {
      ++failed_records;
      ASSERT_TRUE(r.unstage_layer(0).ok()) << "k " << k;
    }
    ASSERT_TRUE(r.stage_layer(1).ok()) << "k " << k;
    while (sim->run_one(r.h2d_stream())) {
    }
    ASSERT_TRUE(r.wait_all().ok());
    ASSERT_TRUE(r.unstage_layer(1).ok());
    ASSERT_TRUE(r.wait_all().ok());
    EXPECT_EQ(read_all(r, *r.find("m0")), first) << "k " << k;
    EXPECT_EQ(read_all(r, *r.find("m1")), second) << "k " << k;
  }
  EXPECT_GT(failed_records, 0);  // the faults reached unstage_layer's records
}

}  // namespace
}  // namespace strata::rt
