// Policy tests on the simulated device: a timeline per policy (which tier every tensor is on at
// every hook), the staging peak of layer_prefetch, state integrity with copy streams delayed at
// random (deferred device), and D1 of RELIABILITY.md for every tier pair.
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>

#include "tests/runtime/fault_injection.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using testing::make_runtime;
using testing::read_all;
using testing::spec;
using testing::special_payload;
using testing::where;

constexpr int kLayers = 3;

void register_model(Runtime& rt, std::size_t numel = 1000) {
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(rt.register_tensor(spec(str_cat("l", l, ".w"), l, Role::kParameter, numel)).ok());
    ASSERT_TRUE(
        rt.register_tensor(spec(str_cat("l", l, ".m"), l, Role::kOptimizerState, numel)).ok());
    ASSERT_TRUE(
        rt.register_tensor(spec(str_cat("l", l, ".v"), l, Role::kOptimizerState, numel)).ok());
  }
}

// One training step through every hook, then a phase switch; returns "hook: placement" lines.
std::vector<std::string> timeline(Runtime& rt, bool phase_switch = true) {
  std::vector<std::string> out;
  auto snap = [&](const std::string& hook) { out.push_back(hook + ": " + where(rt)); };
  StreamHandle s = rt.compute_stream();
  EXPECT_TRUE(rt.begin_step().ok());
  snap("begin_step");
  for (int l = 0; l < kLayers; ++l) EXPECT_TRUE(rt.before_forward(l).ok());
  snap("forward");
  for (int l = kLayers - 1; l >= 0; --l) EXPECT_TRUE(rt.after_backward(l).ok());
  snap("backward");
  EXPECT_TRUE(rt.begin_optimizer_step().ok());
  snap("begin_optimizer_step");
  for (int l : rt.optimizer_layer_order()) {
    EXPECT_TRUE(rt.acquire_layer(l, RoleSet::optimizer_states(), Tier::kGpu, s).ok());
    EXPECT_TRUE(rt.release_layer(l, RoleSet::optimizer_states(), s).ok());
    snap(str_cat("release_layer ", l));
  }
  EXPECT_TRUE(rt.end_optimizer_step().ok());
  snap("end_optimizer_step");
  EXPECT_TRUE(rt.end_step().ok());
  snap("end_step");
  if (!phase_switch) return out;
  EXPECT_TRUE(rt.offload_all().ok());
  snap("offload_all");
  EXPECT_TRUE(rt.reload_all().ok());
  snap("reload_all");
  return out;
}

// keep_on_gpu moves nothing during steps; a phase switch moves everything: at 65a4426 offload_all
// was a silent no-op under it (See Note [Phase switches] in runtime/phase.cpp).
TEST(TimelineTest, KeepOnGpuMovesNothingButAtPhaseSwitches) {
  auto [rt, dev] = make_runtime("keep_on_gpu");
  register_model(*rt);
  const std::vector<std::string> got = timeline(*rt);
  for (std::size_t i = 0; i + 2 < got.size(); ++i) {
    EXPECT_EQ(got[i].substr(got[i].find(": ") + 2), "G G G G G G G G G") << got[i];
  }
  EXPECT_EQ(got[got.size() - 2], "offload_all: P P P P P P P P P");
  EXPECT_EQ(got.back(), "reload_all: G G G G G G G G G");
  EXPECT_EQ(rt->stats().num_migrations, 18);
}

TEST(TimelineTest, BulkMovesNothingDuringStepsAndTheRolesAskedForAtPhaseSwitches) {
  auto [rt, dev] = make_runtime("bulk");
  register_model(*rt);
  std::vector<std::string> got = timeline(*rt);
  std::vector<std::string> want = {
      "begin_step: G G G G G G G G G",      "forward: G G G G G G G G G",
      "backward: G G G G G G G G G",        "begin_optimizer_step: G G G G G G G G G",
      "release_layer 0: G G G G G G G G G", "release_layer 1: G G G G G G G G G",
      "release_layer 2: G G G G G G G G G", "end_optimizer_step: G G G G G G G G G",
      "end_step: G G G G G G G G G",        "offload_all: P P P P P P P P P",
      "reload_all: G G G G G G G G G",
  };
  EXPECT_EQ(got, want);
  // The optimizer's states only, as verl offloads the optimizer apart from the model.
  ASSERT_TRUE(rt->offload_all({.roles = RoleSet::optimizer_states()}).ok());
  EXPECT_EQ(where(*rt), "G P P G P P G P P");
  ASSERT_TRUE(rt->reload_all().ok());
  EXPECT_EQ(where(*rt), "G G G G G G G G G");
}

TEST(TimelineTest, BulkEveryStepMovesEverythingAroundEachStep) {
  auto [rt, dev] = make_runtime("bulk", {.roles = RoleSet::all(), .offload_after_step = true});
  register_model(*rt);
  std::vector<std::string> got = timeline(*rt);
  EXPECT_EQ(got[0], "begin_step: G G G G G G G G G");
  EXPECT_EQ(got[8], "end_step: P P P P P P P P P");
  // Everything rests on the host already: the switch moves nothing, and the reload leaves it
  // resting there until the next step brings it back.
  EXPECT_EQ(got[9], "offload_all: P P P P P P P P P");
  EXPECT_EQ(got[10], "reload_all: P P P P P P P P P");
}

TEST(TimelineTest, BulkSpillsToPageableWhenThePinnedBudgetIsFull) {
  // Pinned first while the pinned budget allows, pageable after; both come back bit for bit.
  RuntimeOptions options;
  options.policy = "bulk";
  options.policy_config.roles = RoleSet::all();
  options.device = DeviceKind::kSimulated;
  options.allocator.budgets[alloc::tier_index(Tier::kPinnedHost)] = 8 << 20;
  auto rt = *Runtime::create(std::move(options), policy::builtin_policies());
  std::vector<std::vector<unsigned char>> payloads;
  std::vector<TensorHandle> hs;
  for (int i = 0; i < 5; ++i) {
    payloads.push_back(special_payload(3 << 20, 40 + i));  // 3 MiB each, 4 MiB segments
    hs.push_back(
        *rt->register_tensor(spec(str_cat("t", i), i, Role::kParameter, 3 << 20, DType::kUInt8),
                             payloads.back().data()));
  }
  absl::Status off = rt->offload_all();
  ASSERT_TRUE(off.ok()) << off;
  EXPECT_EQ(where(*rt), "P P H H H");
  ASSERT_TRUE(rt->reload_all().ok());
  EXPECT_EQ(where(*rt), "G G G G G");
  for (int i = 0; i < 5; ++i) EXPECT_EQ(read_all(*rt, hs[i]), payloads[i]) << i;
  EXPECT_EQ(rt->stats().failed_migrations, 3) << "each spill is a refused pinned move first";
}

TEST(TimelineTest, LayerPrefetchStreamsStatesThroughTheRing) {
  auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1});
  register_model(*rt);
  std::vector<std::string> got = timeline(*rt);
  std::vector<std::string> want = {
      "begin_step: G P P G P P G P P",      "forward: G P P G P P G P P",
      "backward: G P P G P P G P P",        "begin_optimizer_step: G S S G S S G P P",
      "release_layer 0: G P P G S S G S S", "release_layer 1: G P P G P P G S S",
      "release_layer 2: G P P G P P G P P", "end_optimizer_step: G P P G P P G P P",
      "end_step: G P P G P P G P P",        "offload_all: P P P P P P P P P",
      "reload_all: G P P G P P G P P",
  };
  EXPECT_EQ(got, want);
  // A phase switch waits on the host; a step does not.
  const std::int64_t syncs = rt->stats().host_syncs;
  timeline(*rt, /*phase_switch=*/false);
  EXPECT_EQ(rt->stats().host_syncs, syncs) << "a layer_prefetch step must not wait on the host";
}

TEST(TimelineTest, LayerPrefetchInFlightStatesWithADelayedDevice) {
  // With the device deferred, copies stay queued until run: the ring's in-flight states show.
  auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1}, /*deferred=*/true);
  register_model(*rt);
  StreamHandle s = rt->compute_stream();
  ASSERT_TRUE(rt->begin_optimizer_step().ok());
  EXPECT_EQ(where(*rt), "G S* S* G S* S* G P P");
  ASSERT_TRUE(rt->acquire_layer(0, RoleSet::optimizer_states(), Tier::kGpu, s).ok());
  ASSERT_TRUE(rt->release_layer(0, RoleSet::optimizer_states(), s).ok());
  // Layer 0's fetch was chained into its write-back on the GPU; layer 2 waits for slot 0.
  EXPECT_EQ(where(*rt), "G P* P* G S* S* G S* S*");
  dev->run_pending();
  EXPECT_EQ(where(*rt), "G P P G S S G S S");
  ASSERT_TRUE(rt->end_optimizer_step().ok());
  dev->run_pending();
  EXPECT_EQ(where(*rt), "G P P G P P G P P");
}

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

TEST(StagingTest, SlotsFreedOutOfOrderAreReusedAndAFullRingSaysSo) {
  auto [rt, dev] = make_runtime("bulk", {.roles = RoleSet::optimizer_states()});
  for (int l = 0; l < 4; ++l) {
    ASSERT_TRUE(rt->register_tensor(spec(str_cat("m", l), l, Role::kOptimizerState, 100,
                                         DType::kFloat32, Tier::kPinnedHost))
                    .ok());
  }
  ASSERT_TRUE(rt->configure_staging(2, RoleSet::optimizer_states()).ok());
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

// D1 of RELIABILITY.md: 10^4 offload/reload cycles per tier pair, payloads with NaN, +-Inf, -0 and
// denormals that change every cycle (so a stale copy, one that missed a cycle, is caught), sizes
// 1 B, 255 B and 2^k +- 1, every tensor read back every cycle: zero bitwise mismatches.
TEST(D1Test, TenThousandCyclesPerTierPairWithPayloadsThatChangeEveryCycle) {
  const std::pair<Tier, Tier> pairs[] = {{Tier::kGpu, Tier::kPinnedHost},
                                         {Tier::kGpu, Tier::kPageableHost},
                                         {Tier::kPinnedHost, Tier::kPageableHost}};
  std::vector<std::size_t> sizes = {1, 255};
  for (int k : {3, 8, 12, 16}) {
    sizes.push_back((std::size_t{1} << k) - 1);
    sizes.push_back((std::size_t{1} << k) + 1);
  }
  constexpr int kVariants = 4;
  std::int64_t mismatches = 0, cycles = 0;
  for (auto [a, b] : pairs) {
    auto [rt, dev] = make_runtime("bulk");
    std::vector<TensorHandle> hs;
    std::vector<std::vector<std::vector<unsigned char>>> variants(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      for (int v = 0; v < kVariants; ++v)
        variants[i].push_back(special_payload(sizes[i], 100 * i + v));
      TensorSpec s = spec(str_cat("t", i), 0, Role::kOther, sizes[i], DType::kUInt8, a);
      hs.push_back(*rt->register_tensor(s, variants[i][0].data()));
      if (rt->info(hs.back())->tier != a) {
        ASSERT_TRUE(rt->migrate(hs.back(), a).ok());
        ASSERT_TRUE(rt->wait_all().ok());
      }
    }
    std::vector<unsigned char> payload;
    for (int c = 0; c < 10'000; ++c, ++cycles) {
      // This cycle's payload: a variant of special values, its last 4 bytes the cycle number.
      std::vector<std::vector<unsigned char>> now(hs.size());
      for (std::size_t i = 0; i < hs.size(); ++i) {
        now[i] = variants[i][c % kVariants];
        if (now[i].size() >= 8) std::memcpy(now[i].data() + now[i].size() - 4, &c, 4);
        ASSERT_TRUE(rt->write(hs[i], now[i].data()).ok());
      }
      for (Tier t : {b, a}) {
        for (TensorHandle h : hs) ASSERT_TRUE(rt->migrate(h, t).ok());
        ASSERT_TRUE(rt->wait_all().ok());
      }
      for (std::size_t i = 0; i < hs.size(); ++i) mismatches += read_all(*rt, hs[i]) != now[i];
    }
    EXPECT_EQ(rt->stats().num_migrations, static_cast<std::int64_t>(2 * 10'000 * hs.size()));
  }
  std::printf(
      "D1: %lld cycles over 3 tier pairs, %zu tensors each, new payloads every cycle, %lld "
      "mismatches\n",
      static_cast<long long>(cycles), sizes.size(), static_cast<long long>(mismatches));
  EXPECT_EQ(mismatches, 0);
}

}  // namespace
}  // namespace strata::rt

namespace strata::rt {
namespace {

// See Note [Step placement] in runtime/policy.h and See Note [Hybrid placement] in
// policies/hybrid.cpp.
StepCosts equal_layers(int layers, std::int64_t params) {
  StepCosts costs;
  costs.rates = {.link_h2d_gbps = 50,
                 .link_d2h_gbps = 50,
                 .link_both_gbps = 40,
                 .host_params_per_s = 2e9,
                 .host_memory_gbps = 100};
  for (int l = 0; l < layers; ++l) {
    costs.layers.push_back({.layer = l,
                            .params = params,
                            .state_bytes = 8,
                            .grad_bytes = 4,
                            .param_bytes = 4,
                            .host_touch_bytes = 28});
  }
  return costs;
}

TEST(PlacementTest, OnlyHybridPlacesStepsAndItsHostLayersNeverStream) {
  for (const char* name : {"keep_on_gpu", "bulk", "layer_prefetch"}) {
    auto [rt, dev] = make_runtime(name);
    EXPECT_FALSE(rt->places_steps()) << name;
    EXPECT_EQ(rt->step_place(0), StepPlace::kGpu) << name;
  }
  PolicyConfig config{.prefetch_depth = 1};
  config.hybrid_fraction = 0.5;  // of parameters on the GPU: the two highest layers go to the host
  auto [rt, dev] = make_runtime("hybrid", config);
  ASSERT_TRUE(rt->places_steps());
  absl::StatusOr<std::string> line = rt->place_steps(equal_layers(4, 1000));
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_NE(line->find("2 of 4 layers"), std::string::npos) << *line;
  EXPECT_NE(line->find("hybrid_fraction 0.5 forced"), std::string::npos) << *line;
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ(rt->step_place(l), l >= 2 ? StepPlace::kHost : StepPlace::kGpu) << l;
    ASSERT_TRUE(
        rt->register_tensor(spec(str_cat("l", l, ".m"), l, Role::kOptimizerState, 1000)).ok());
  }
  // Placing again once states exist is refused: the states a layer has depend on its place.
  EXPECT_EQ(rt->place_steps(equal_layers(4, 1000)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // An optimizer step streams layers 0 and 1 only; 2 and 3 stay in pinned memory throughout.
  ASSERT_TRUE(rt->prepare().ok());
  ASSERT_TRUE(rt->begin_step().ok());
  ASSERT_TRUE(rt->begin_optimizer_step().ok());
  std::vector<int> staged;
  for (int layer : rt->optimizer_layer_order()) {
    if (rt->step_place(layer) == StepPlace::kHost) {
      EXPECT_EQ(rt->info(rt->layer_tensors(layer, RoleSet::optimizer_states())[0])->tier,
                Tier::kPinnedHost);
      continue;
    }
    ASSERT_TRUE(
        rt->acquire_layer(layer, RoleSet::optimizer_states(), Tier::kGpu, rt->compute_stream())
            .ok());
    staged.push_back(layer);
    ASSERT_TRUE(rt->release_layer(layer, RoleSet::optimizer_states(), rt->compute_stream()).ok());
  }
  ASSERT_TRUE(rt->end_optimizer_step().ok());
  ASSERT_TRUE(rt->end_step().ok());
  EXPECT_EQ(staged, (std::vector<int>{0, 1}));
  EXPECT_EQ(rt->stats().migrated_bytes_h2d, 2 * 4000);
  for (int l = 2; l < 4; ++l) {
    EXPECT_EQ(rt->info(rt->layer_tensors(l, RoleSet::optimizer_states())[0])->tier,
              Tier::kPinnedHost);
  }
}

TEST(PlacementTest, HybridRefusesWhatItCannotDo) {
  auto refused = [](std::string policy, PolicyConfig config, std::string_view want) {
    RuntimeOptions options;
    options.policy = std::move(policy);
    options.policy_config = config;
    options.device = DeviceKind::kSimulated;
    absl::StatusOr<std::unique_ptr<Runtime>> rt =
        Runtime::create(std::move(options), policy::builtin_policies());
    ASSERT_FALSE(rt.ok());
    EXPECT_EQ(rt.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(rt.status().message()).find(want), std::string::npos) << rt.status();
  };
  PolicyConfig forced;
  forced.hybrid_fraction = 0.5;
  refused("layer_prefetch", forced, "only the hybrid policy");
  PolicyConfig out_of_range;
  out_of_range.hybrid_fraction = 1.5;
  refused("hybrid", out_of_range, "not in [0, 1]");
  PolicyConfig everything{.roles = RoleSet::all()};
  refused("hybrid", everything, "use roles=optimizer_states");
}

}  // namespace
}  // namespace strata::rt
