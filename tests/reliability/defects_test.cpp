// The defects a line-by-line review of the runtime found on error paths that no run reached
// (issue "Hardening"), one test each, named after the defect. Each failed at 65a4426.
//
// They run on a deferred simulated device behind a ScriptedDevice: a wrapper that fails chosen
// calls, counts the timing events still alive, and remembers every copy with a marker queued right
// behind it on the same stream, so a test can tell whether memory handed back to a pool or an
// upstream is still the destination of a copy that has not run.
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <thread>
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
using testing::special_payload;

// What a ScriptedDevice does, owned by the test so it outlives the runtime.
struct Script {
  // Each returns true when the call it guards must fail.
  std::function<bool()> fail_copy, fail_record, fail_record_timed, fail_stream_wait, fail_sync,
      fail_stream_sync;
  // destroy_stream does not reach the device (a device whose queued work is stuck).
  bool keep_streams = false;
  int live_timed_events = 0;
  struct Copy {
    const std::byte* dst;
    std::size_t bytes;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Copy> copies;

  // Whether a copy that has not run yet writes into [p, p + n).
  bool pending_copy_into(const void* p, std::size_t n) const {
    const auto* b = static_cast<const std::byte*>(p);
    for (const Copy& c : copies) {
      if (!c.done->load() && c.dst < b + n && b < c.dst + c.bytes) return true;
    }
    return false;
  }
};

// The n-th call from now fails.
std::function<bool()> nth(int n) {
  auto count = std::make_shared<int>(0);
  return [count, n] { return ++*count == n; };
}
std::function<bool()> always() {
  return [] { return true; };
}

absl::Status injected(const char* what) {
  return absl::InternalError(str_cat("injected failure of ", what));
}

class ScriptedDevice final : public Device {
 public:
  ScriptedDevice(SimulatedDevice& inner, Script& script) : d_(inner), s_(script) {}
  std::string name() const override { return d_.name(); }
  bool is_simulated() const override { return true; }
  absl::StatusOr<StreamHandle> create_stream() override { return d_.create_stream(); }
  void destroy_stream(StreamHandle st) override {
    if (!s_.keep_streams) d_.destroy_stream(st);
  }
  absl::Status copy_async(void* dst, const void* src, std::size_t n, StreamHandle st) override {
    if (s_.fail_copy && s_.fail_copy()) return injected("copy");
    STRATA_RETURN_IF_ERROR(d_.copy_async(dst, src, n, st));
    auto done = std::make_shared<std::atomic<bool>>(false);
    s_.copies.push_back({static_cast<const std::byte*>(dst), n, done});
    return d_.enqueue_host(st, [done] { done->store(true); });
  }
  absl::Status stream_wait(StreamHandle st, EventHandle e) override {
    if (s_.fail_stream_wait && s_.fail_stream_wait()) return injected("stream wait");
    return d_.stream_wait(st, e);
  }
  absl::Status enqueue_host(StreamHandle st, std::function<void()> fn) override {
    return d_.enqueue_host(st, std::move(fn));
  }
  absl::Status stream_synchronize(StreamHandle st) override {
    if (s_.fail_stream_sync && s_.fail_stream_sync()) return injected("stream synchronize");
    return d_.stream_synchronize(st);
  }
  absl::StatusOr<EventHandle> record_timed(StreamHandle st) override {
    if (s_.fail_record_timed && s_.fail_record_timed()) return injected("timed record");
    absl::StatusOr<EventHandle> e = d_.record_timed(st);
    if (e.ok()) ++s_.live_timed_events;
    return e;
  }
  absl::StatusOr<double> elapsed_ms(EventHandle a, EventHandle b) override {
    return d_.elapsed_ms(a, b);
  }
  void release_timed(EventHandle e) override {
    --s_.live_timed_events;
    d_.release_timed(e);
  }
  std::int64_t host_syncs() const override { return d_.host_syncs(); }
  absl::StatusOr<EventHandle> record(StreamHandle st) override {
    if (s_.fail_record && s_.fail_record()) return injected("record");
    return d_.record(st);
  }
  absl::StatusOr<bool> query(EventHandle e) override { return d_.query(e); }
  absl::Status synchronize(EventHandle e) override {
    if (s_.fail_sync && s_.fail_sync()) return injected("host wait");
    return d_.synchronize(e);
  }
  void release(EventHandle e) override { d_.release(e); }

 private:
  SimulatedDevice& d_;
  Script& s_;
};

// An upstream that remembers the segments it took back.
class RecordingUpstream final : public alloc::Upstream {
 public:
  RecordingUpstream(std::unique_ptr<alloc::Upstream> inner,
                    std::vector<std::pair<const std::byte*, std::size_t>>& returned)
      : inner_(std::move(inner)), returned_(returned) {}
  std::string_view name() const override { return inner_->name(); }
  absl::StatusOr<void*> allocate(std::size_t n) override { return inner_->allocate(n); }
  absl::Status deallocate(void* p, std::size_t n) override {
    returned_.emplace_back(static_cast<const std::byte*>(p), n);
    return inner_->deallocate(p, n);
  }

 private:
  std::unique_ptr<alloc::Upstream> inner_;
  std::vector<std::pair<const std::byte*, std::size_t>>& returned_;
};

// A runtime over `inner` (deferred unless told otherwise) through a ScriptedDevice.
std::unique_ptr<Runtime> scripted_runtime(SimulatedDevice& inner, Script& script,
                                          const std::string& policy = "bulk",
                                          PolicyConfig config = {},
                                          std::size_t gpu_budget = alloc::kNoBudget) {
  RuntimeOptions options;
  options.policy = policy;
  options.policy_config = config;
  options.allocator.track_allocations = true;
  options.allocator.simulated_device.capacity = std::size_t{1} << 30;
  options.allocator.budgets[alloc::tier_index(Tier::kGpu)] = gpu_budget;
  options.device_override = std::make_unique<ScriptedDevice>(inner, script);
  absl::StatusOr<std::unique_ptr<Runtime>> rt =
      Runtime::create(std::move(options), policy::builtin_policies());
  EXPECT_TRUE(rt.ok()) << rt.status();
  return rt.ok() ? std::move(*rt) : nullptr;
}

// A tensor of `bytes` random bytes resting in pinned memory.
TensorHandle pinned_tensor(Runtime& rt, std::size_t bytes, std::uint64_t seed) {
  TensorSpec s = spec("t", 0, Role::kOther, bytes, DType::kUInt8);
  s.home = Tier::kPinnedHost;
  absl::StatusOr<TensorHandle> h = rt.register_tensor(s, special_payload(bytes, seed).data());
  EXPECT_TRUE(h.ok()) << h.status();
  return h.ok() ? *h : TensorHandle{};
}

// The next GPU block of `bytes` is not one a queued copy still writes; then the copies run.
void expect_no_block_under_a_queued_copy(Runtime& rt, SimulatedDevice& inner, const Script& script,
                                         std::size_t bytes) {
  absl::StatusOr<void*> next = rt.allocator().allocate(Tier::kGpu, bytes);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_FALSE(script.pending_copy_into(*next, bytes))
      << "a block still being written by a queued copy was handed out again";
  inner.run_pending();
  ASSERT_TRUE(rt.allocator().deallocate(Tier::kGpu, *next).ok());
}

// adam.h promised that a failed load changes nothing; it wrote tensor by tensor, so a write that
// failed part way left the states before it loaded.
TEST(DefectTest, AdamLoadThatFailsPartWayChangesNothing) {
  SimulatedDevice inner;
  Script script;
  auto rt = scripted_runtime(inner, script, "keep_on_gpu");
  std::vector<std::pair<TensorHandle, TensorHandle>> params;
  std::vector<float> values(1000);
  for (int l = 0; l < 3; ++l) {
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.01f * (i % 97) - 0.3f * l;
    TensorHandle p =
        *rt->register_tensor(spec(str_cat("w", l), l, Role::kParameter, 1000), values.data());
    TensorHandle g = *rt->register_tensor(spec(str_cat("w", l, ".grad"), l, Role::kGradient, 1000),
                                          values.data());
    params.push_back({p, g});
  }
  optim::AdamOptions o;
  o.groups.push_back({.params = params, .hyper = {.lr = 0.1f}});
  auto adam = *optim::Adam::create(*rt, o);
  ASSERT_TRUE(adam->step().ok());
  std::stringstream checkpoint;
  ASSERT_TRUE(adam->save(checkpoint).ok());
  ASSERT_TRUE(adam->step().ok());  // the states move on from the checkpoint
  ASSERT_TRUE(rt->wait_all().ok());
  std::vector<std::vector<unsigned char>> before;
  for (TensorHandle h : rt->tensors()) before.push_back(read_all(*rt, h));

  script.fail_copy = nth(3);  // the third state written
  absl::Status s = adam->load(checkpoint);
  script.fail_copy = nullptr;
  EXPECT_FALSE(s.ok());
  std::vector<std::vector<unsigned char>> after;
  for (TensorHandle h : rt->tensors()) after.push_back(read_all(*rt, h));
  EXPECT_TRUE(after == before) << "a failed load changed states";
  EXPECT_EQ(adam->step_count(0), 2);
}

// slot_layout_locked computed a staged layer's offsets from the live registry: after an earlier
// tensor of the layer was unregistered, the gradients staged next were placed over a staged
// parameter.
TEST(DefectTest, SlotLayoutSurvivesUnregisteringAnEarlierTensor) {
  SimulatedDevice inner;
  inner.set_deferred(false);
  Script script;
  auto rt = scripted_runtime(inner, script, "bulk");
  const RoleSet staged{Role::kParameter, Role::kGradient};
  std::vector<std::vector<unsigned char>> payload;
  std::vector<TensorHandle> h;
  int i = 0;
  for (const char* name : {"p0", "p1", "g0", "g1"}) {
    payload.push_back(special_payload(4096, 10 + i));
    TensorSpec s = spec(name, 0, i < 2 ? Role::kParameter : Role::kGradient, 1024);
    s.home = Tier::kPinnedHost;
    h.push_back(*rt->register_tensor(s, payload.back().data()));
    ++i;
  }
  ASSERT_TRUE(rt->configure_staging(1, staged).ok());
  ASSERT_TRUE(rt->stage_layer(0, RoleSet{Role::kParameter}).ok());
  ASSERT_TRUE(rt->unregister(h[0]).ok());
  ASSERT_TRUE(rt->stage_layer(0, RoleSet{Role::kGradient}).ok());
  ASSERT_TRUE(rt->wait_all().ok());
  EXPECT_EQ(read_all(*rt, h[1]), payload[1]) << "a gradient was staged over parameter p1";
  EXPECT_EQ(read_all(*rt, h[2]), payload[2]);
  EXPECT_EQ(read_all(*rt, h[3]), payload[3]);
  ASSERT_TRUE(rt->unstage_layer(0).ok());
  EXPECT_EQ(read_all(*rt, h[1]), payload[1]);
}

// The undo after a failed H2D bounce copy freed the destination while the pieces already queued
// could still write into it; the next allocation got that block.
TEST(DefectTest, FailedBounceCopyToTheGpuFreesNoBlockACopyStillWrites) {
  SimulatedDevice inner;
  inner.set_deferred(true);
  Script script;
  auto rt = scripted_runtime(inner, script);
  const std::size_t bytes = 3 * kBounceChunkBytes;
  TensorSpec s = spec("t", 0, Role::kOther, bytes, DType::kUInt8);
  s.home = Tier::kPageableHost;
  const std::vector<unsigned char> payload = special_payload(bytes, 3);
  TensorHandle t = *rt->register_tensor(s, payload.data());
  script.fail_copy = nth(2);  // the second piece
  EXPECT_FALSE(rt->migrate(t, Tier::kGpu).ok());
  script.fail_copy = nullptr;
  expect_no_block_under_a_queued_copy(*rt, inner, script, bytes);
  EXPECT_EQ(read_all(*rt, t), payload);
}

// When the arrival event of a copy could not be recorded, migrate waited for the stream without
// checking that the wait worked, then freed the destination the copy was writing.
TEST(DefectTest, UncheckedStreamSynchronizeFreesNoBlockACopyStillWrites) {
  SimulatedDevice inner;
  inner.set_deferred(true);
  Script script;
  auto rt = scripted_runtime(inner, script);
  TensorHandle t = pinned_tensor(*rt, 1 << 20, 4);
  script.fail_record = nth(1);  // the arrival event
  script.fail_stream_sync = always();
  EXPECT_FALSE(rt->migrate(t, Tier::kGpu).ok());
  script.fail_record = nullptr;
  script.fail_stream_sync = nullptr;
  expect_no_block_under_a_queued_copy(*rt, inner, script, 1 << 20);
}

// register_tensor freed the new block when the wait for its initializing copy failed, though the
// copy could still write into it.
TEST(DefectTest, RegisterAfterAFailedCopyWaitFreesNoBlockACopyStillWrites) {
  SimulatedDevice inner;
  inner.set_deferred(true);
  Script script;
  auto rt = scripted_runtime(inner, script);
  const std::vector<unsigned char> payload = special_payload(1 << 20, 5);
  script.fail_stream_sync = nth(1);
  EXPECT_FALSE(
      rt->register_tensor(spec("t", 0, Role::kOther, 1 << 20, DType::kUInt8), payload.data()).ok());
  script.fail_stream_sync = nullptr;
  EXPECT_TRUE(rt->tensors().empty());
  expect_no_block_under_a_queued_copy(*rt, inner, script, 1 << 20);
}

// ~Impl ignored a failed wait: with a copy still queued (the device stuck), the runtime freed the
// copy's destination and its pools gave the segments back to their upstreams.
TEST(DefectTest, DestroyingTheRuntimeAfterAFailedWaitGivesBackNoMemoryACopyStillWrites) {
  SimulatedDevice inner;
  inner.set_deferred(true);
  Script script;
  std::vector<std::pair<const std::byte*, std::size_t>> returned;
  {
    RuntimeOptions options;
    options.policy = "bulk";
    options.allocator.upstreams[alloc::tier_index(Tier::kPinnedHost)] =
        std::make_unique<RecordingUpstream>(alloc::make_simulated_pinned_upstream(), returned);
    options.allocator.upstreams[alloc::tier_index(Tier::kGpu)] =
        std::make_unique<RecordingUpstream>(
            alloc::make_simulated_device_upstream({.capacity = 1 << 30}), returned);
    options.device_override = std::make_unique<ScriptedDevice>(inner, script);
    auto rt = *Runtime::create(std::move(options), policy::builtin_policies());
    TensorHandle t = *rt->register_tensor(spec("t", 0, Role::kOther, 1 << 20, DType::kUInt8),
                                          special_payload(1 << 20, 6).data());
    ASSERT_TRUE(rt->migrate(t, Tier::kPinnedHost).ok());  // queued, not run
    // The device gets stuck: no wait can succeed, no stream is torn down.
    script.fail_sync = always();
    script.fail_stream_sync = always();
    script.keep_streams = true;
  }
  for (const auto& [p, n] : returned) {
    EXPECT_FALSE(script.pending_copy_into(p, n))
        << "a segment still being written by a queued copy went back to its upstream";
  }
  script.fail_sync = nullptr;
  script.fail_stream_sync = nullptr;
}

// acquire recorded a timing event before making the stream wait; when the wait failed, the event
// was never released.
TEST(DefectTest, AcquireReleasesItsTimingEventWhenTheStreamWaitFails) {
  SimulatedDevice inner;
  inner.set_deferred(true);
  Script script;
  auto rt = scripted_runtime(inner, script);
  TensorHandle t = pinned_tensor(*rt, 1 << 16, 7);
  ASSERT_TRUE(rt->migrate(t, Tier::kGpu).ok());  // in flight
  const int live = script.live_timed_events;
  script.fail_stream_wait = nth(1);
  EXPECT_FALSE(rt->acquire(t, Tier::kGpu, rt->compute_stream()).ok());
  script.fail_stream_wait = nullptr;
  EXPECT_EQ(script.live_timed_events, live) << "a timing event leaked";
  EXPECT_EQ(rt->info(t)->holds, 0);
}

TEST(DefectTest, AcquireReleasesItsTimingEventWhenTheSecondTimedRecordFails) {
  SimulatedDevice inner;
  inner.set_deferred(true);
  Script script;
  auto rt = scripted_runtime(inner, script);
  TensorHandle t = pinned_tensor(*rt, 1 << 16, 8);
  ASSERT_TRUE(rt->migrate(t, Tier::kGpu).ok());
  const int live = script.live_timed_events;
  script.fail_record_timed = nth(2);
  EXPECT_FALSE(rt->acquire(t, Tier::kGpu, rt->compute_stream()).ok());
  script.fail_record_timed = nullptr;
  EXPECT_EQ(script.live_timed_events, live) << "a timing event leaked";
  EXPECT_EQ(rt->info(t)->holds, 0);
}

// register_tensor undid a registration the policy refused with a plain unregister and ignored
// its failure: a tensor the policy had acquired stayed registered, with no handle given out.
TEST(DefectTest, RegisterWhoseRollbackFailsLeavesNoTensorBehind) {
  class Refusing final : public ResidencyPolicy {
   public:
    Refusing() : ResidencyPolicy({}) {}
    std::string_view name() const override { return "refusing"; }
    absl::Status on_register(PolicyContext& rt, TensorHandle h) override {
      (void)rt.hold_layer(rt.info(h)->spec.layer, RoleSet::all(), Tier::kGpu, rt.compute_stream());
      return absl::InvalidArgumentError("refused");
    }
  };
  PolicyRegistry registry;
  ASSERT_TRUE(registry
                  .add("refusing",
                       [](const PolicyConfig&) -> absl::StatusOr<std::unique_ptr<ResidencyPolicy>> {
                         return std::unique_ptr<ResidencyPolicy>(new Refusing());
                       })
                  .ok());
  RuntimeOptions options;
  options.policy = "refusing";
  options.device = DeviceKind::kSimulated;
  options.allocator.track_allocations = true;
  auto rt = *Runtime::create(std::move(options), registry);
  EXPECT_FALSE(rt->register_tensor(spec("t", 0, Role::kOther, 100)).ok());
  EXPECT_TRUE(rt->tensors().empty()) << "a refused tensor stayed registered";
  EXPECT_FALSE(rt->find("t").ok());
  for (Tier tier : alloc::kAllTiers) {
    EXPECT_EQ(rt->allocator().stats(tier).allocated_bytes.current, 0) << tier_name(tier);
  }
}

// The hooks called the policy without the runtime's mutex: two threads running steps on one
// runtime raced inside the policy's own state.
TEST(DefectTest, HooksFromTwoThreadsAreSerialized) {
  RuntimeOptions options;
  options.policy = "layer_prefetch";
  options.policy_config = {.prefetch_depth = 1, .roles = RoleSet::all()};
  options.device = DeviceKind::kSimulated;
  auto rt = *Runtime::create(std::move(options), policy::builtin_policies());
  constexpr int kHookLayers = 4;
  std::vector<std::vector<unsigned char>> payload;
  std::vector<TensorHandle> handles;
  for (int l = 0; l < kHookLayers; ++l) {
    const Role roles[] = {Role::kParameter, Role::kGradient, Role::kOptimizerState,
                          Role::kOptimizerState};
    for (int k = 0; k < 4; ++k) {
      const Role r = roles[k];
      payload.push_back(special_payload(4096 * (l + 1), 100 * l + k));
      handles.push_back(*rt->register_tensor(
          spec(str_cat("l", l, ".", k, ".", role_name(r)), l, r, 1024 * (l + 1)),
          payload.back().data()));
    }
  }
  std::atomic<int> odd_errors{0};
  auto steps = [&] {
    for (int i = 0; i < 200; ++i) {
      std::vector<absl::Status> st;
      st.push_back(rt->begin_step());
      for (int l = 0; l < kHookLayers; ++l) st.push_back(rt->before_forward(l));
      for (int l = kHookLayers - 1; l >= 0; --l) st.push_back(rt->after_backward(l));
      st.push_back(rt->end_step());
      for (const absl::Status& s : st) {
        // Interleaved steps may be refused as misuse; anything else is a broken promise.
        if (!s.ok() && s.code() != absl::StatusCode::kFailedPrecondition &&
            s.code() != absl::StatusCode::kResourceExhausted) {
          ++odd_errors;
        }
      }
    }
  };
  std::thread a(steps), b(steps);
  a.join();
  b.join();
  EXPECT_EQ(odd_errors.load(), 0);
  ASSERT_TRUE(rt->begin_step().ok());
  ASSERT_TRUE(rt->end_step().ok());
  ASSERT_TRUE(rt->wait_all().ok());
  for (std::size_t i = 0; i < handles.size(); ++i) {
    EXPECT_EQ(read_all(*rt, handles[i]), payload[i]) << rt->info(handles[i])->spec.name;
    EXPECT_EQ(rt->info(handles[i])->holds, 0);
  }
}

}  // namespace
}  // namespace strata::rt
