// Phase switches under every policy (See Note [Phase switches] in runtime/phase.cpp): train,
// offload everything, read every tensor (a checkpoint), reload, train on. The GPU tier holds
// nothing while offloaded, no pinned memory is allocated after the first switch, and the run ends
// bitwise equal to one without switches; on a deferred simulated device, so copies are in flight
// when a switch comes. And the edges: a switch while a layer is staged or copies are in flight,
// twice in a row, a reload with nothing offloaded, a step while offloaded, some roles only, keeping
// the memory cached.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/units.h"
#include "gtest/gtest.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using testing::read_all;
using testing::spec;
using Bytes = std::vector<unsigned char>;

constexpr int kLayers = 4;
constexpr std::size_t kNumel = 96 * 1024;

struct Model {
  testing::Made made;
  std::vector<std::pair<TensorHandle, TensorHandle>> params;
  std::unique_ptr<optim::Adam> adam;

  Model(const std::string& policy, PolicyConfig config, std::size_t gpu_budget = alloc::kNoBudget) {
    made = testing::make_runtime(policy, config, /*deferred=*/true, gpu_budget);
    std::vector<float> v(kNumel);
    optim::AdamOptions o;
    o.groups.resize(1);
    o.groups[0].hyper = {.lr = 1e-2f, .weight_decay = 0.01f};
    for (int l = 0; l < kLayers; ++l) {
      for (std::size_t i = 0; i < kNumel; ++i) v[i] = 0.001f * static_cast<float>((i * 7 + l) % 97);
      TensorHandle p =
          *rt().register_tensor(spec(str_cat("l", l, ".w"), l, Role::kParameter, kNumel), v.data());
      TensorHandle g =
          *rt().register_tensor(spec(str_cat("l", l, ".g"), l, Role::kGradient, kNumel), v.data());
      params.push_back({p, g});
    }
    o.groups[0].params = params;
    adam = *optim::Adam::create(rt(), o);
  }
  Runtime& rt() { return *made.rt; }

  absl::Status step(int n) {
    std::vector<float> g(kNumel);
    for (int l = 0; l < kLayers; ++l) {
      for (std::size_t i = 0; i < kNumel; ++i)
        g[i] = 0.01f * static_cast<float>((i + n + l) % 13) - 0.06f;
      STRATA_RETURN_IF_ERROR(rt().write(params[l].second, g.data()));
    }
    STRATA_RETURN_IF_ERROR(rt().begin_step());
    for (int l = 0; l < kLayers; ++l) STRATA_RETURN_IF_ERROR(rt().before_forward(l));
    for (int l = kLayers - 1; l >= 0; --l) STRATA_RETURN_IF_ERROR(rt().after_backward(l));
    STRATA_RETURN_IF_ERROR(adam->step());
    return rt().end_step();
  }

  std::map<std::string, Bytes> bytes() {
    std::map<std::string, Bytes> out;
    EXPECT_TRUE(rt().wait_all().ok());
    for (TensorHandle h : rt().tensors()) out[rt().info(h)->spec.name] = read_all(rt(), h);
    return out;
  }
};

struct Case {
  std::string name;
  std::string policy;
  PolicyConfig config;
  std::size_t budget = alloc::kNoBudget;
};

std::vector<Case> cases() {
  return {
      {"keep_on_gpu", "keep_on_gpu", {}},
      {"bulk", "bulk", {.roles = RoleSet::all()}},
      {"bulk, states rest on the host",
       "bulk",
       {.roles = RoleSet::optimizer_states(), .offload_after_step = true}},
      {"layer_prefetch", "layer_prefetch", {.prefetch_depth = 1}},
      {"layer_prefetch, every role, resident layers",
       "layer_prefetch",
       {.prefetch_depth = 1, .roles = RoleSet::all()},
       12 * kMiB},
  };
}

TEST(PhaseSwitchTest, EveryPolicyTrainsOnBitwiseAsIfNoSwitchHappened) {
  for (const Case& c : cases()) {
    Model plain(c.policy, c.config, c.budget);
    for (int n = 1; n <= 6; ++n) ASSERT_TRUE(plain.step(n).ok()) << c.name;
    const auto want = plain.bytes();

    Model m(c.policy, c.config, c.budget);
    std::int64_t pinned_segments = -1;
    for (int n = 1; n <= 6; ++n) {
      ASSERT_TRUE(m.step(n).ok()) << c.name;
      if (n % 2 != 0) continue;
      const auto before = m.bytes();
      absl::Status off = m.rt().offload_all();
      ASSERT_TRUE(off.ok()) << c.name << ": " << off;
      EXPECT_TRUE(m.rt().offloaded()) << c.name;
      // Nothing of strata's on the GPU: the GPU tier and the ring hold no memory.
      EXPECT_EQ(m.rt().stats().gpu_reserved_bytes, 0) << c.name;
      EXPECT_EQ(m.rt().allocator().stats(Tier::kGpu).reserved_bytes.current, 0) << c.name;
      for (TensorHandle h : m.rt().tensors()) {
        EXPECT_NE(m.rt().info(h)->tier, Tier::kGpu) << c.name << " " << m.rt().info(h)->spec.name;
      }
      // Everything reads as it was (a checkpoint taken while offloaded).
      EXPECT_EQ(m.bytes(), before) << c.name;
      // No step while offloaded.
      const absl::Status refused = m.rt().begin_step();
      EXPECT_EQ(refused.message(),
                "begin_step: tensors are offloaded (offload_all); call reload_all first")
          << c.name;
      ASSERT_TRUE(m.rt().reload_all().ok()) << c.name;
      EXPECT_FALSE(m.rt().offloaded());
      EXPECT_EQ(m.bytes(), before) << c.name;
      const std::int64_t segments = m.rt().allocator().stats(Tier::kPinnedHost).num_segment_allocs;
      if (pinned_segments >= 0) {
        EXPECT_EQ(segments, pinned_segments) << c.name << ": pinned memory allocated again";
      }
      pinned_segments = segments;
    }
    EXPECT_EQ(m.bytes(), want) << c.name << ": switches changed the trajectory";
  }
}

TEST(PhaseSwitchTest, TheEdges) {
  Model m("layer_prefetch", {.prefetch_depth = 1, .roles = RoleSet::all()});
  ASSERT_TRUE(m.step(1).ok());
  // A reload with nothing offloaded does nothing.
  ASSERT_TRUE(m.rt().reload_all().ok());
  // In the middle of a forward pass, layers staged and their copies in flight.
  const auto before = m.bytes();
  ASSERT_TRUE(m.rt().begin_step().ok());
  ASSERT_TRUE(m.rt().before_forward(0).ok());
  ASSERT_TRUE(m.rt().before_forward(1).ok());
  ASSERT_TRUE(m.rt().is_staged(1));
  ASSERT_TRUE(m.rt().offload_all().ok());
  EXPECT_FALSE(m.rt().is_staged(1));
  ASSERT_TRUE(m.rt().offload_all().ok());  // twice in a row
  EXPECT_EQ(m.bytes(), before);
  ASSERT_TRUE(m.rt().reload_all().ok());
  ASSERT_TRUE(m.rt().end_step().ok());
  EXPECT_EQ(m.bytes(), before);
  ASSERT_TRUE(m.step(2).ok());
  // A tensor held by an acquire cannot move, and says so.
  const TensorHandle w = m.params[0].first;
  Model k("keep_on_gpu", {});
  const TensorHandle kw = k.params[0].first;
  ASSERT_TRUE(k.rt().acquire(kw, Tier::kGpu, k.rt().compute_stream()).ok());
  const absl::Status held = k.rt().offload_all();
  EXPECT_EQ(held.message(),
            "offload_all: tensor 'l0.w' is held by 1 acquire(s); release it before moving it "
            "(what moved before it stays offloaded; reload_all brings it back)");
  ASSERT_TRUE(k.rt().release(kw, k.rt().compute_stream()).ok());
  ASSERT_TRUE(k.rt().reload_all().ok());
  ASSERT_TRUE(k.step(1).ok());
  (void)w;
}

TEST(PhaseSwitchTest, SomeRolesOnlyAndKeepingTheMemoryCached) {
  Model m("keep_on_gpu", {});
  ASSERT_TRUE(m.step(1).ok());
  const auto before = m.bytes();
  // The optimizer's states only, as verl offloads the model and the optimizer separately.
  ASSERT_TRUE(m.rt().offload_all({.roles = RoleSet::optimizer_states()}).ok());
  for (TensorHandle h : m.rt().tensors()) {
    const TensorInfo i = *m.rt().info(h);
    const bool state = i.spec.role == Role::kOptimizerState || i.spec.role == Role::kOptimizerState;
    EXPECT_EQ(i.tier == Tier::kGpu, !state) << i.spec.name;
  }
  ASSERT_TRUE(m.rt().reload_all().ok());
  // Cached: the GPU tier keeps its segments for the reload.
  const std::int64_t reserved = m.rt().allocator().stats(Tier::kGpu).reserved_bytes.current;
  ASSERT_TRUE(m.rt().offload_all({.keep_cached = true}).ok());
  EXPECT_EQ(m.rt().allocator().stats(Tier::kGpu).reserved_bytes.current, reserved);
  EXPECT_EQ(m.rt().allocator().stats(Tier::kGpu).allocated_bytes.current, 0);
  const std::int64_t segments = m.rt().allocator().stats(Tier::kGpu).num_segment_allocs;
  ASSERT_TRUE(m.rt().reload_all().ok());
  EXPECT_EQ(m.rt().allocator().stats(Tier::kGpu).num_segment_allocs, segments);
  EXPECT_EQ(m.bytes(), before);
  ASSERT_TRUE(m.step(2).ok());
}

// A reload that does not fit (another engine kept some of the GPU) moves nothing, says so, and
// succeeds once there is room (See Note [Allocating before the copies] in runtime/phase.cpp).
TEST(PhaseSwitchTest, AReloadThatDoesNotFitMovesNothing) {
  Model m("keep_on_gpu", {});
  ASSERT_TRUE(m.step(1).ok());
  const auto before = m.bytes();
  ASSERT_TRUE(m.rt().offload_all().ok());
  ASSERT_TRUE(m.rt().allocator().set_budget(Tier::kGpu, 2 * kMiB).ok());
  const absl::Status refused = m.rt().reload_all();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(std::string(refused.message()).find("(nothing came back; call reload_all again once"),
            std::string::npos)
      << refused;
  EXPECT_TRUE(m.rt().offloaded());
  for (TensorHandle h : m.rt().tensors()) EXPECT_NE(m.rt().info(h)->tier, Tier::kGpu);
  EXPECT_EQ(m.rt().allocator().stats(Tier::kGpu).allocated_bytes.current, 0);
  EXPECT_EQ(m.rt().stats().gpu_reserved_bytes, 0) << "the segments it took went back too";
  EXPECT_EQ(m.bytes(), before);
  ASSERT_TRUE(m.rt().allocator().set_budget(Tier::kGpu, alloc::kNoBudget).ok());
  ASSERT_TRUE(m.rt().reload_all().ok());
  EXPECT_EQ(m.bytes(), before);
  ASSERT_TRUE(m.step(2).ok());
}

// Records, at each segment the GPU tier gives back, how many copies the device still had queued.
class FreeRecordingUpstream final : public alloc::Upstream {
 public:
  FreeRecordingUpstream(std::unique_ptr<alloc::Upstream> inner, std::vector<int>* pending_at_free)
      : inner_(std::move(inner)), pending_at_free_(pending_at_free) {}
  void watch(SimulatedDevice* device) { device_ = device; }
  std::string_view name() const override { return inner_->name(); }
  absl::StatusOr<void*> allocate(std::size_t bytes) override { return inner_->allocate(bytes); }
  absl::Status deallocate(void* ptr, std::size_t bytes) override {
    if (device_ != nullptr) pending_at_free_->push_back(device_->pending_copies());
    return inner_->deallocate(ptr, bytes);
  }

 private:
  std::unique_ptr<alloc::Upstream> inner_;
  std::vector<int>* pending_at_free_;
  SimulatedDevice* device_ = nullptr;
};

// A segment goes back to the driver as soon as the copies out of it have landed, while the copies
// out of the others are still queued (See Note [Freeing behind the copies] in runtime/phase.cpp).
TEST(PhaseSwitchTest, SegmentsGoBackWhileLaterCopiesStillStream) {
  constexpr int kTensors = 6;
  constexpr std::size_t kBig = 3 * kMiB / sizeof(float);  // a large block: a segment of its own
  for (bool keep_cached : {false, true}) {
    std::vector<int> pending_at_free;
    RuntimeOptions options;
    options.policy = "keep_on_gpu";
    auto recording = std::make_unique<FreeRecordingUpstream>(
        alloc::make_simulated_device_upstream({.capacity = 256 * kMiB}), &pending_at_free);
    FreeRecordingUpstream* upstream = recording.get();
    options.allocator.upstreams[alloc::tier_index(Tier::kGpu)] = std::move(recording);
    auto device = std::make_unique<SimulatedDevice>();
    SimulatedDevice* raw = device.get();
    raw->set_deferred(true);
    options.device_override = std::move(device);
    absl::StatusOr<std::unique_ptr<Runtime>> made =
        Runtime::create(std::move(options), policy::builtin_policies());
    ASSERT_TRUE(made.ok()) << made.status();
    Runtime& rt = **made;
    std::vector<float> v(kBig);
    std::map<std::string, Bytes> before;
    for (int t = 0; t < kTensors; ++t) {
      for (std::size_t i = 0; i < kBig; ++i) v[i] = static_cast<float>(i % 101 + t);
      TensorHandle h =
          *rt.register_tensor(spec(str_cat("t", t), t, Role::kParameter, kBig), v.data());
      before[str_cat("t", t)] = read_all(rt, h);
    }
    ASSERT_TRUE(rt.wait_all().ok());
    upstream->watch(raw);
    ASSERT_TRUE(rt.offload_all({.keep_cached = keep_cached}).ok());
    upstream->watch(nullptr);
    if (keep_cached) {
      EXPECT_TRUE(pending_at_free.empty()) << "cached segments stay in the pool";
    } else {
      ASSERT_EQ(pending_at_free.size(), static_cast<std::size_t>(kTensors));
      EXPECT_GT(pending_at_free.front(), 0) << "the first segment waited for every copy";
      EXPECT_EQ(pending_at_free.back(), 0);
    }
    EXPECT_EQ(rt.allocator().stats(Tier::kGpu).allocated_bytes.current, 0);
    ASSERT_TRUE(rt.reload_all().ok());
    for (TensorHandle h : rt.tensors()) {
      EXPECT_EQ(read_all(rt, h), before[rt.info(h)->spec.name]) << rt.info(h)->spec.name;
    }
  }
}

}  // namespace
}  // namespace strata::rt
