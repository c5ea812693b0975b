// Failure modes a user meets that no other suite drove (issue "Hardening"): unregistering a tensor
// while its copy is in flight or its layer is staged, checkpoints taken and loaded in the middle
// of a step and while states are staged, pinned memory exhausted while streaming, and two runtimes
// in one process. (Sticky and asynchronous device errors are sites of the fault sweep; hooks from
// two threads are in defects_test.cpp; bound torch tensors that change under the binding are in
// tests/bridge.) Every test ends with each tensor's bytes checked and nothing leaked.
#include <map>
#include <memory>
#include <sstream>
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

using testing::make_runtime;
using testing::read_all;
using testing::spec;
using testing::special_payload;

using Bytes = std::vector<unsigned char>;

void expect_nothing_live(Runtime& rt) {
  ASSERT_TRUE(rt.wait_all().ok());
  ASSERT_TRUE(rt.allocator().synchronize_pending().ok());
  EXPECT_TRUE(rt.allocator().leak_report().empty()) << rt.allocator().format_leak_report();
}

TEST(FailureModeTest, UnregisterWhileItsCopyIsInFlight) {
  auto [rt, dev] = make_runtime("bulk", {}, /*deferred=*/true);
  const Bytes a = special_payload(1 << 20, 1), b = special_payload(4096, 2);
  TensorHandle ta =
      *rt->register_tensor(spec("a", 0, Role::kOther, a.size(), DType::kUInt8), a.data());
  TensorHandle tb =
      *rt->register_tensor(spec("b", 0, Role::kOther, b.size(), DType::kUInt8), b.data());
  ASSERT_TRUE(rt->migrate(ta, Tier::kPinnedHost).ok());
  ASSERT_TRUE(rt->migrate(tb, Tier::kPinnedHost).ok());
  ASSERT_TRUE(rt->info(ta)->in_flight);
  ASSERT_TRUE(rt->unregister(ta).ok());  // waits for its copy, frees both ends
  EXPECT_FALSE(rt->find("a").ok());
  EXPECT_EQ(read_all(*rt, tb), b);
  EXPECT_EQ(rt->info(tb)->tier, Tier::kPinnedHost);
  ASSERT_TRUE(rt->unregister(tb).ok());
  expect_nothing_live(*rt);
}

TEST(FailureModeTest, UnregisterATensorOfAStagedLayer) {
  auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1}, /*deferred=*/true);
  std::map<std::string, Bytes> want;
  std::map<std::string, TensorHandle> h;
  for (int l = 0; l < 3; ++l) {
    const Role roles[] = {Role::kParameter, Role::kOptimizerState, Role::kOptimizerState};
    const char* names[] = {"parameter", "exp_avg", "exp_avg_sq"};
    for (int k = 0; k < 3; ++k) {
      const Role r = roles[k];
      const std::string name = str_cat("l", l, ".", names[k]);
      want[name] = special_payload(4000 * (l + 1), 10 * l + k);
      h[name] = *rt->register_tensor(spec(name, l, r, 1000 * (l + 1)), want[name].data());
    }
  }
  ASSERT_TRUE(rt->begin_optimizer_step().ok());  // layers 0 and 1 staged, copies in flight
  ASSERT_TRUE(rt->is_staged(0));
  ASSERT_TRUE(rt->unregister(h["l0.exp_avg"]).ok());
  want.erase("l0.exp_avg");
  ASSERT_TRUE(rt->unregister(h["l1.exp_avg_sq"]).ok());  // not fetched yet, or arriving
  want.erase("l1.exp_avg_sq");
  // The step goes on over what is left of each layer.
  for (int layer : rt->optimizer_layer_order()) {
    absl::StatusOr<std::vector<void*>> p =
        rt->acquire_layer(layer, RoleSet::optimizer_states(), Tier::kGpu, rt->compute_stream());
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->size(), layer == 2 ? 2u : 1u);
    ASSERT_TRUE(rt->release_layer(layer, RoleSet::optimizer_states(), rt->compute_stream()).ok());
  }
  ASSERT_TRUE(rt->end_optimizer_step().ok());
  for (const auto& [name, bytes] : want) EXPECT_EQ(read_all(*rt, h[name]), bytes) << name;
  for (const auto& [name, bytes] : want) ASSERT_TRUE(rt->unregister(h[name]).ok());
  expect_nothing_live(*rt);
}

// Adam over three layers of one parameter each.
struct Trainer {
  testing::Made made;
  std::vector<TensorHandle> params, grads;
  std::unique_ptr<optim::Adam> adam;

  Trainer(const std::string& policy, PolicyConfig config, bool deferred,
          std::size_t pinned_budget = alloc::kNoBudget, std::size_t numel = 50000) {
    RuntimeOptions options;
    options.policy = policy;
    options.policy_config = config;
    options.allocator.track_allocations = true;
    options.allocator.budgets[alloc::tier_index(Tier::kPinnedHost)] = pinned_budget;
    auto device = std::make_unique<SimulatedDevice>();
    made.device = device.get();
    made.device->set_deferred(deferred);
    options.device_override = std::move(device);
    made.rt = *Runtime::create(std::move(options), policy::builtin_policies());
    std::vector<float> v(numel);
    optim::AdamOptions o;
    o.groups.resize(1);
    for (int l = 0; l < 3; ++l) {
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.001f * static_cast<float>(i % 101 + l);
      params.push_back(*made.rt->register_tensor(
          spec(str_cat("p", l), l, Role::kParameter, v.size()), v.data()));
      grads.push_back(*made.rt->register_tensor(
          spec(str_cat("p", l, ".grad"), l, Role::kGradient, v.size()), v.data()));
      o.groups[0].params.push_back({params.back(), grads.back()});
    }
    o.groups[0].hyper = {.lr = 1e-2f, .weight_decay = 0.01f};
    adam = *optim::Adam::create(*made.rt, o);
  }
  Runtime& rt() { return *made.rt; }
  absl::Status step() {
    STRATA_RETURN_IF_ERROR(rt().begin_step());
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

TEST(FailureModeTest, CheckpointsInTheMiddleOfAStepAndWhileStatesAreStaged) {
  Trainer reference("keep_on_gpu", {}, false);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(reference.step().ok());

  Trainer t("layer_prefetch", {.prefetch_depth = 1}, /*deferred=*/true);
  ASSERT_TRUE(t.step().ok());
  // Mid-step (forward and backward done, no optimizer step yet): save, then load it back.
  ASSERT_TRUE(t.rt().begin_step().ok());
  std::stringstream mid;
  ASSERT_TRUE(t.adam->save(mid).ok());
  ASSERT_TRUE(t.adam->load(mid).ok());
  ASSERT_TRUE(t.adam->step().ok());
  ASSERT_TRUE(t.rt().end_step().ok());
  // States staged, their copies maybe still arriving: a checkpoint reads them where they are, and
  // a load writes the staged copy and the home block alike, so the write-back keeps it.
  std::stringstream staged;
  ASSERT_TRUE(t.rt().begin_optimizer_step().ok());
  ASSERT_TRUE(t.rt().is_staged(0));
  ASSERT_TRUE(t.adam->save(staged).ok());
  const std::string saved = staged.str();
  ASSERT_TRUE(t.adam->load(staged).ok());
  // A layer held by the optimizer cannot be written: the load is refused and changes nothing.
  ASSERT_TRUE(
      t.rt()
          .acquire_layer(0, RoleSet::optimizer_states(), Tier::kGpu, t.rt().compute_stream())
          .ok());
  const auto before = t.bytes();
  std::stringstream again(saved);
  const absl::Status held = t.adam->load(again);
  EXPECT_EQ(held.code(), absl::StatusCode::kFailedPrecondition) << held;
  EXPECT_EQ(t.bytes(), before) << "a refused load changed something";
  ASSERT_TRUE(t.rt().release_layer(0, RoleSet::optimizer_states(), t.rt().compute_stream()).ok());
  ASSERT_TRUE(t.rt().end_optimizer_step().ok());
  ASSERT_TRUE(t.step().ok());
  EXPECT_EQ(t.bytes(), reference.bytes()) << "checkpoints in the middle changed the trajectory";
}

TEST(FailureModeTest, PinnedMemoryRunsOutWhileStreaming) {
  constexpr std::size_t kNumel = 150000;  // 600 KB a tensor, 3.6 MB of states
  Trainer reference("keep_on_gpu", {}, false, alloc::kNoBudget, kNumel);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(reference.step().ok());
  // Room for a part of the states in pinned memory (one 2 MiB segment): the rest rests in pageable
  // memory and streams through the bounce buffers, every step.
  Trainer t("layer_prefetch", {.prefetch_depth = 1}, /*deferred=*/true, 2 * kMiB, kNumel);
  int pageable = 0;
  for (TensorHandle h : t.rt().tensors()) pageable += t.rt().info(h)->tier == Tier::kPageableHost;
  EXPECT_GT(pageable, 0) << "nothing spilled to pageable memory";
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(t.step().ok());
  EXPECT_EQ(t.bytes(), reference.bytes());
  EXPECT_GT(t.rt().stats().migrated_bytes_h2d, 0);
}

TEST(FailureModeTest, TwoRuntimesInOneProcess) {
  Trainer reference("keep_on_gpu", {}, false);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(reference.step().ok());
  auto a = std::make_unique<Trainer>("layer_prefetch", PolicyConfig{.prefetch_depth = 1}, true);
  auto b = std::make_unique<Trainer>(
      "bulk", PolicyConfig{.roles = RoleSet::optimizer_states(), .offload_after_step = true}, true);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(a->step().ok());
    ASSERT_TRUE(b->step().ok());
  }
  b.reset();  // one goes; the other trains on
  ASSERT_TRUE(a->step().ok());
  EXPECT_EQ(a->bytes(), reference.bytes());
  a->adam.reset();
  for (TensorHandle h : a->rt().tensors()) ASSERT_TRUE(a->rt().unregister(h).ok());
  expect_nothing_live(a->rt());
}

}  // namespace
}  // namespace strata::rt
