// Policy tests on the simulated device: a timeline per policy (which tier every tensor is on at
// every hook), D1 of RELIABILITY.md for every tier pair, and which policies place steps. The
// staging ring's own tests are in tests/runtime/staging_test.cpp.
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
  // The first layers' states are staged at begin_step, while forward and backward run (See Note
  // [States staged ahead] in policies/state_streaming.cpp), and stepped first.
  std::vector<std::string> want = {
      "begin_step: G S S G S S G P P",      "forward: G S S G S S G P P",
      "backward: G S S G S S G P P",        "begin_optimizer_step: G S S G S S G P P",
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

// A step that ends with no optimizer step (an evaluation, a backward whose step() never came)
// drops what begin_step staged ahead without a copy back, and the states read back as they were
// (See Note [States staged ahead] in policies/state_streaming.cpp).
TEST(TimelineTest, StatesStagedAheadOfAStepNotTakenGoHomeWithoutACopy) {
  auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1});
  register_model(*rt);
  timeline(*rt, /*phase_switch=*/false);
  std::vector<std::vector<unsigned char>> before;
  for (TensorHandle h : rt->tensors()) before.push_back(read_all(*rt, h));
  const std::int64_t d2h = rt->stats().migrated_bytes_d2h;
  ASSERT_TRUE(rt->begin_step().ok());
  EXPECT_EQ(where(*rt), "G S S G S S G P P");
  ASSERT_TRUE(rt->end_step().ok());
  EXPECT_EQ(where(*rt), "G P P G P P G P P");
  EXPECT_EQ(rt->stats().migrated_bytes_d2h, d2h);
  std::size_t i = 0;
  for (TensorHandle h : rt->tensors()) EXPECT_EQ(read_all(*rt, h), before[i++]);
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

// See Note [Draining slot] in policies/ring_plan.cpp: under overlap the ring has a slot more than
// it stages layers, so the fetch a release queues does not wait for that release's write-back,
// which waits for the step. Here the compute and host-to-device streams run while the
// device-to-host stream does not: layer 0 comes in while layer 2's write-back has not run.
TEST(TimelineTest, UnderOverlapAFetchDoesNotWaitForTheWriteBackJustQueued) {
  for (const Overlap overlap : {Overlap::kNone, Overlap::kBackward}) {
    SCOPED_TRACE(overlap_name(overlap));
    auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1, .overlap = overlap},
                                  /*deferred=*/true);
    register_model(*rt);
    StreamHandle s = rt->compute_stream();
    ASSERT_TRUE(rt->prepare().ok());
    // Two float32 moments of 1000: 4000 bytes each, 4096 in the slot.
    const std::int64_t layer_bytes = 2 * 4096;
    const int slots = overlap == Overlap::kBackward ? 3 : 2;
    EXPECT_EQ(rt->stats().staging_bytes, slots * layer_bytes);
    ASSERT_TRUE(rt->begin_step().ok());
    dev->run_pending();
    if (overlap == Overlap::kNone) {
      // The optimizer step's first layers, staged ahead (See Note [States staged ahead]).
      EXPECT_EQ(where(*rt), "G S S G S S G P P");
      ASSERT_TRUE(rt->end_step().ok());
      continue;
    }
    // Backward's first layers (See Note [Overlapped backward]).
    EXPECT_EQ(where(*rt), "G P P G S S G S S");
    for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(rt->before_forward(l).ok());
    ASSERT_TRUE(rt->after_backward(2).ok());
    ASSERT_TRUE(rt->acquire_layer(2, RoleSet::optimizer_states(), Tier::kGpu, s).ok());
    ASSERT_TRUE(rt->release_layer(2, RoleSet::optimizer_states(), s).ok());
    EXPECT_EQ(where(*rt), "G S* S* G S S G P* P*");
    while (dev->run_one(s) || dev->run_one(rt->h2d_stream())) {
    }
    EXPECT_EQ(where(*rt), "G S S G S S G P* P*");
    dev->run_pending();
    EXPECT_EQ(where(*rt), "G S S G S S G P P");
    for (int l : {1, 0}) {
      ASSERT_TRUE(rt->after_backward(l).ok());
      ASSERT_TRUE(rt->acquire_layer(l, RoleSet::optimizer_states(), Tier::kGpu, s).ok());
      ASSERT_TRUE(rt->release_layer(l, RoleSet::optimizer_states(), s).ok());
    }
    dev->run_pending();
    EXPECT_EQ(where(*rt), "G P P G P P G P P");
    ASSERT_TRUE(rt->begin_optimizer_step().ok());
    ASSERT_TRUE(rt->end_optimizer_step().ok());
    ASSERT_TRUE(rt->end_step().ok());
    dev->run_pending();
    EXPECT_EQ(where(*rt), "G P P G P P G P P");
  }
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
                 .link_h2d_loaded_gbps = 30,
                 .link_d2h_loaded_gbps = 38};
  for (int l = 0; l < layers; ++l) {
    costs.layers.push_back(
        {.layer = l, .params = params, .state_bytes = 8, .grad_bytes = 4, .param_bytes = 4});
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

// See Note [Host rate in the step] in policies/hybrid.cpp: the cost model, told of a fast host,
// steps every layer there. A first measured step that gives no host kernel time (one taken in
// backward) leaves the split; the next step's host kernel says the host is a thousandth as fast,
// and the model then keeps every layer on the GPU, where the search starts. A host kernel as fast
// as the setup's leaves the split where it was. The search's line names both rates.
TEST(PlacementTest, HybridRefitsItsHostRateFromTheFirstMeasuredStep) {
  StepCosts costs = equal_layers(4, 1000);
  costs.rates.host_params_per_s = 1e12;
  for (LayerCost& c : costs.layers) c.movable = true;
  for (double host_rate : {1e12, 1e9}) {
    SCOPED_TRACE(host_rate);
    auto [rt, dev] = make_runtime("hybrid", PolicyConfig{.prefetch_depth = 1});
    absl::StatusOr<std::string> line = rt->place_steps(costs);
    ASSERT_TRUE(line.ok()) << line.status();
    EXPECT_NE(line->find("4 of 4 layers"), std::string::npos) << *line;
    for (int l = 0; l < 4; ++l) {
      ASSERT_TRUE(
          rt->register_tensor(spec(str_cat("l", l, ".m"), l, Role::kOptimizerState, 1000)).ok());
    }
    ASSERT_TRUE(rt->prepare().ok());
    ASSERT_TRUE(rt->wants_step_times());
    ASSERT_TRUE(rt->step_measured({.seconds = 1e-3}).ok());
    for (int l = 0; l < 4; ++l) EXPECT_EQ(rt->step_place(l), StepPlace::kHost) << l;
    absl::StatusOr<std::string> second =
        rt->step_measured({.seconds = 1e-3, .host_kernel_seconds = 4000 / host_rate});
    ASSERT_TRUE(second.ok()) << second.status();
    EXPECT_EQ(*second, "");
    const bool slow = host_rate < 1e12;
    for (int l = 0; l < 4; ++l) {
      EXPECT_EQ(rt->step_place(l), slow ? StepPlace::kGpu : StepPlace::kHost) << l;
    }
    std::string last;
    for (int step = 0; step < 40 && rt->wants_step_times(); ++step) {
      absl::StatusOr<std::string> measured = rt->step_measured({.seconds = 1e-3});
      ASSERT_TRUE(measured.ok()) << measured.status();
      last = *measured;
    }
    EXPECT_FALSE(rt->wants_step_times());
    EXPECT_NE(last.find(slow ? "host Adam: 1.00 G params/s, measured in the first step (1000.00 at "
                               "setup)"
                             : "host Adam: 1000.00 G params/s, measured in the first step"),
              std::string::npos)
        << last;
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
