// F1-F5 of RELIABILITY.md as one sweep. A training-step scenario (runtime creation, registration,
// two steps with forward/backward hooks and a layer-by-layer optimizer pass, phase switches, single
// migrations, unregistration) runs once per fault, under bulk (spilling to pageable memory) and
// layer_prefetch (every role streamed), on a deferred simulated device whose copies and kernels
// complete in a random order, so faults land while copies are queued and in flight.
//
// Sites: each upstream's allocations (the three tiers, the runtime's staging ring and bounce
// buffers), failing from the k-th call on, either for the one runtime call that meets the first
// failure (a shortage that passes, whatever the pool and the runtime retry meanwhile) or for good;
// each kind of device call failing once; and sticky device errors (every call of every kind fails
// from the k-th copy, an asynchronous error, or the k-th host wait on). For every site and k up to
// the calls that site sees in the fault-free run, the k-th call fails. Every scenario call that
// fails is checked:
//   - without waiting for anything: the error is typed and carries its cause; the registry (names,
//     sizes, roles, layers) is as before; for calls other than hooks, holds and placement (where
//     each tensor is or is going, staged or not) are as before;
//   - a sticky error fails the call twice more, the same way;
//   - once the fault is gone, the same call succeeds; then, with the device drained: nothing is
//     withheld (blocks whose events could not be had came back), each tier's live bytes are
//     exactly those of the tensors the registry places there, and every tensor's bytes are what
//     the scenario expects (an oracle that follows the registration payloads and the kernels).
// Each run must end with the same bytes as the fault-free run; then, after unregistering and
// destroying the runtime, every upstream got back every segment it gave, and no event or stream of
// the device is left alive. Every site must have made at least one call fail.
//
// make test runs a seeded sample (per site at most 6 values of k, STRATA_FAULT_SAMPLE to change,
// a fixed seed and a fresh one, printed); STRATA_FAULT_EXHAUSTIVE=1 runs every k (make fault-sweep,
// and the GPU script). STRATA_FAULT_SEED=S reruns one seed;
// STRATA_FAULT_CASE="layer_prefetch/copy/17" one case, STRATA_FAULT_VERBOSE=1 prints every failed
// call. Prints "fault sites: S, injections: N, failed calls: F, in flight: M, failures: 0" (M:
// injections that landed while a copy was queued or running; failures: runs that broke a promise).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "allocator/upstream.h"
#include "base/status.h"
#include "base/units.h"
#include "gtest/gtest.h"
#include "optim/adam.h"
#include "tests/runtime/fault_injection.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using strata::kMiB;
using testing::read_all;
using testing::spec;
using testing::special_payload;

constexpr int kLayers = 3;
// Per layer: sizes that share small-block segments in odd ways; four roles each.
constexpr std::size_t kBytes[kLayers] = {600001, 255, 70000};
const Role kRoles[] = {Role::kParameter, Role::kGradient, Role::kExpAvg, Role::kExpAvgSq};
// What the policies move; a buffer of role other stays on the GPU.
constexpr RoleSet kMoved = {Role::kParameter, Role::kGradient, Role::kExpAvg, Role::kExpAvgSq};
constexpr std::size_t kBufferBytes = 300000;
// k values tried per site in a sample; STRATA_FAULT_SAMPLE overrides (the sanitizer builds).
std::int64_t sample_per_site() {
  const char* env = std::getenv("STRATA_FAULT_SAMPLE");
  return env != nullptr ? std::max(1, std::atoi(env)) : 6;
}

// The upstreams that can fail: one per tier, then the runtime's own staging ring and bounce
// buffers.
constexpr int kStagingUpstream = alloc::kNumTiers;
constexpr int kBounceUpstream = alloc::kNumTiers + 1;
constexpr int kNumUpstreams = alloc::kNumTiers + 2;

// A site: allocations from one upstream (once or from the k-th on), a kind of device call, or a
// sticky device error starting at the k-th call of a kind.
struct Site {
  enum Kind { kAllocOnce, kAllocPersistent, kDeviceCall, kSticky };
  std::string name;
  Kind kind = kDeviceCall;
  int upstream = -1;
  DeviceCall call = DeviceCall::kCopy;
};

// Every kind of device call failing once, and sticky errors from a copy and from a host wait.
std::vector<Site> device_sites() {
  std::vector<Site> sites;
  for (int c = 0; c < kNumDeviceCalls; ++c) {
    const auto call = static_cast<DeviceCall>(c);
    sites.push_back({std::string(device_call_name(call)), Site::kDeviceCall, -1, call});
  }
  sites.push_back({"sticky error from a copy", Site::kSticky, -1, DeviceCall::kCopy});
  sites.push_back({"sticky error from a host wait", Site::kSticky, -1, DeviceCall::kHostWait});
  return sites;
}

std::vector<Site> all_sites() {
  const char* upstream_names[kNumUpstreams] = {"gpu", "pinned_host", "pageable_host",
                                               "staging ring", "bounce buffers"};
  std::vector<Site> out;
  for (int u = 0; u < kNumUpstreams; ++u) {
    out.push_back({str_cat("alloc ", upstream_names[u]), Site::kAllocOnce, u});
    out.push_back(
        {str_cat("alloc ", upstream_names[u], " persistently"), Site::kAllocPersistent, u});
  }
  for (const Site& site : device_sites()) out.push_back(site);
  return out;
}

// An upstream's allocate calls and the segments it gave and took back, kept by the run (the
// upstream goes with the runtime).
struct SegmentCount {
  std::int64_t calls = 0;
  std::int64_t given = 0;
  std::int64_t returned = 0;
};

class CountingUpstream final : public alloc::Upstream {
 public:
  CountingUpstream(std::unique_ptr<alloc::Upstream> inner, SegmentCount& count)
      : inner_(std::move(inner)), count_(count) {}
  std::string_view name() const override { return inner_->name(); }
  absl::StatusOr<void*> allocate(std::size_t bytes) override {
    ++count_.calls;
    absl::StatusOr<void*> p = inner_->allocate(bytes);
    if (p.ok()) ++count_.given;
    return p;
  }
  absl::Status deallocate(void* ptr, std::size_t bytes) override {
    ++count_.returned;
    return inner_->deallocate(ptr, bytes);
  }

 private:
  std::unique_ptr<alloc::Upstream> inner_;
  SegmentCount& count_;
};

// Hands the runtime a Device it can own while the run keeps the faulty one (and the simulated one
// under it) beyond the runtime's end.
class ForwardingDevice final : public Device {
 public:
  explicit ForwardingDevice(Device& d) : d_(d) {}
  std::string name() const override { return d_.name(); }
  bool is_simulated() const override { return d_.is_simulated(); }
  absl::StatusOr<StreamHandle> create_stream() override { return d_.create_stream(); }
  void destroy_stream(StreamHandle s) override { d_.destroy_stream(s); }
  absl::Status copy_async(void* dst, const void* src, std::size_t n, StreamHandle s) override {
    return d_.copy_async(dst, src, n, s);
  }
  absl::Status stream_wait(StreamHandle s, EventHandle e) override { return d_.stream_wait(s, e); }
  absl::Status enqueue_host(StreamHandle s, std::function<void()> fn) override {
    return d_.enqueue_host(s, std::move(fn));
  }
  absl::Status stream_synchronize(StreamHandle s) override { return d_.stream_synchronize(s); }
  absl::StatusOr<EventHandle> record_timed(StreamHandle s) override { return d_.record_timed(s); }
  absl::StatusOr<double> elapsed_ms(EventHandle a, EventHandle b) override {
    return d_.elapsed_ms(a, b);
  }
  void release_timed(EventHandle e) override { d_.release_timed(e); }
  std::int64_t host_syncs() const override { return d_.host_syncs(); }
  absl::StatusOr<EventHandle> record(StreamHandle s) override { return d_.record(s); }
  absl::StatusOr<bool> query(EventHandle e) override { return d_.query(e); }
  absl::Status synchronize(EventHandle e) override { return d_.synchronize(e); }
  void release(EventHandle e) override { d_.release(e); }

 private:
  Device& d_;
};

using Bytes = std::vector<unsigned char>;

// What is known about tensors without waiting for the device.
struct Meta {
  std::map<std::string, std::string> registry;   // name -> "bytes role layer"
  std::map<std::string, int> holds;              // name -> holds
  std::map<std::string, std::string> placement;  // name -> where it is or is going, staged or not
};

// One run of the scenario, with at most one planned fault.
class ScenarioRun {
 public:
  ScenarioRun(std::string policy, PolicyConfig config, std::uint64_t seed)
      : policy_(std::move(policy)), config_(config) {
    auto inner = std::make_unique<SimulatedDevice>();
    inner_ = inner.get();
    inner_->set_deferred(true);
    inner_->set_random_completion(seed);
    device_ = std::make_unique<FaultInjectingDevice>(std::move(inner));
    device_->set_on_inject([this] { landed_in_flight_ |= inner_->pending_copies() > 0; });
  }

  // Plans the k-th call of `site` (counted from the start of the run) to fail.
  void plan(const Site& site, std::int64_t k) {
    planned_ = true;
    site_ = site;
    k_ = k;
  }

  void execute() {
    if (planned_ && site_.kind == Site::kDeviceCall) device_->fail_call(site_.call, k_);
    if (planned_ && site_.kind == Site::kSticky) device_->fail_sticky(site_.call, k_);
    call(
        "create", [&] { return create(); }, Kind::kNoRuntime);
    if (rt_ == nullptr) return;
    std::vector<TensorHandle> handles;
    // A buffer that stays on the GPU, registered first: its block is the GPU tier's first
    // allocation, which no policy can work around by streaming instead.
    const Bytes buffer_payload = special_payload(kBufferBytes, 99);
    call("register buffer", [&] {
      absl::StatusOr<TensorHandle> h = rt_->register_tensor(
          spec("buffer", 0, Role::kOther, kBufferBytes, DType::kUInt8), buffer_payload.data());
      if (h.ok()) {
        handles.push_back(*h);
        expected_["buffer"] = buffer_payload;
      }
      return h.status();
    });
    if (handles.empty()) return;
    const TensorHandle buffer = handles.front();
    // The buffer to each host tier and back, into empty pools: each move takes its tier's first
    // segment (and the way back from pageable memory the bounce buffers), which no policy can
    // work around by spilling or streaming instead.
    for (Tier t : {Tier::kPinnedHost, Tier::kPageableHost, Tier::kGpu}) {
      call(str_cat("migrate buffer to ", alloc::tier_name(t)),
           [&] { return rt_->migrate(buffer, t); });
      call("wait_all", [&] { return rt_->wait_all(); });
    }
    for (int l = 0; l < kLayers; ++l) {
      for (Role role : kRoles) {
        const std::string name = str_cat("l", l, ".", role_name(role));
        const Bytes payload = special_payload(kBytes[l], 100 * l + static_cast<int>(role));
        call(str_cat("register ", name), [&] {
          absl::StatusOr<TensorHandle> h =
              rt_->register_tensor(spec(name, l, role, kBytes[l], DType::kUInt8), payload.data());
          if (h.ok()) {
            handles.push_back(*h);
            expected_[name] = payload;
          }
          return h.status();
        });
      }
    }
    for (int step = 1; step <= 2; ++step) {
      call(
          "begin_step", [&] { return rt_->begin_step(); }, Kind::kHook);
      for (int l = 0; l < kLayers; ++l) {
        call(
            str_cat("before_forward ", l), [&] { return rt_->before_forward(l); }, Kind::kHook);
      }
      for (int l = kLayers - 1; l >= 0; --l) {
        call(
            str_cat("after_backward ", l), [&] { return rt_->after_backward(l); }, Kind::kHook);
      }
      call(
          "begin_optimizer_step", [&] { return rt_->begin_optimizer_step(); }, Kind::kHook);
      for (int l : rt_->optimizer_layer_order()) {
        if (!optimizer_layer(l)) return;
      }
      call(
          "end_optimizer_step", [&] { return rt_->end_optimizer_step(); }, Kind::kHook);
      call(
          "end_step", [&] { return rt_->end_step(); }, Kind::kHook);
    }
    call(
        "offload_all", [&] { return rt_->offload_all(); }, Kind::kHook);
    call(
        "reload_all", [&] { return rt_->reload_all(); }, Kind::kHook);
    // With the pools' cached segments given back, each move below takes a new one from its tier.
    device_->set_paused(true);
    (void)rt_->allocator().trim_all();
    device_->set_paused(false);
    for (Tier t : {Tier::kPageableHost, Tier::kPinnedHost, Tier::kGpu}) {
      call(str_cat("migrate to ", alloc::tier_name(t)),
           [&] { return rt_->migrate(handles[1], t); });
      call("wait_all", [&] { return rt_->wait_all(); });
    }
    settle_and_check("before unregistering");
    final_ = expected_;
    for (TensorHandle h : handles) {
      call(str_cat("unregister ", h.id), [&] { return rt_->unregister(h); });
    }
    device_->set_paused(true);
    rt_.reset();
    faulty_ = {};  // gone with the runtime
    for (int u = 0; u < kNumUpstreams; ++u) {
      if (segments_[u].given != segments_[u].returned) {
        problems_.push_back(str_cat("upstream ", u, " gave ", segments_[u].given,
                                    " segments and got back ", segments_[u].returned));
      }
    }
    if (inner_->live_events() != 0) {
      problems_.push_back(str_cat(inner_->live_events(), " events left alive"));
    }
    if (inner_->live_streams() != 0) {
      problems_.push_back(str_cat(inner_->live_streams(), " streams left alive"));
    }
  }

  const std::map<std::string, Bytes>& final_state() const { return final_; }
  const std::vector<std::string>& problems() const { return problems_; }
  std::int64_t calls_of(const Site& site) const {
    return site.upstream >= 0 ? segments_[site.upstream].calls : device_->calls(site.call);
  }
  bool fired() const { return device_->injected() + upstream_injections_ > 0; }
  int failed_calls() const { return failed_calls_; }
  bool landed_in_flight() const { return landed_in_flight_; }

 private:
  // kPolicyCall: a call that lets the policy act (release_layer), which may change placement.
  enum class Kind { kCall, kPolicyCall, kHook, kNoRuntime };

  // One layer of the optimizer pass: acquire, a "kernel" that changes the parameter and the first
  // moment in a way that shows if it ran twice, release.
  bool optimizer_layer(int l) {
    const StreamHandle stream = rt_->compute_stream();
    std::vector<void*> ptrs;
    call(str_cat("acquire_layer ", l), [&] {
      absl::StatusOr<std::vector<void*>> p = rt_->acquire_layer(l, kMoved, Tier::kGpu, stream);
      if (p.ok()) ptrs = *p;
      return p.status();
    });
    if (ptrs.size() != 4) {
      problems_.push_back(str_cat("acquire_layer ", l, " gave ", ptrs.size(), " pointers"));
      return false;
    }
    const std::size_t n = kBytes[l];
    call(str_cat("kernel ", l), [&] {
      absl::Status s = rt_->device().enqueue_host(stream, [ptrs, n, l] {
        auto* p = static_cast<unsigned char*>(ptrs[0]);
        auto* m = static_cast<unsigned char*>(ptrs[2]);
        for (std::size_t i = 0; i < n; ++i) {
          p[i] = static_cast<unsigned char>(p[i] * 3 + l + 1);
          m[i] = static_cast<unsigned char>(m[i] ^ p[i]);
        }
      });
      if (s.ok()) {
        Bytes& p = expected_[str_cat("l", l, ".parameter")];
        Bytes& m = expected_[str_cat("l", l, ".exp_avg")];
        for (std::size_t i = 0; i < n; ++i) {
          p[i] = static_cast<unsigned char>(p[i] * 3 + l + 1);
          m[i] = static_cast<unsigned char>(m[i] ^ p[i]);
        }
      }
      return s;
    });
    call(
        str_cat("release_layer ", l), [&] { return rt_->release_layer(l, kMoved, stream); },
        Kind::kPolicyCall);
    return true;
  }

  absl::Status create() {
    RuntimeOptions options;
    options.policy = policy_;
    options.policy_config = config_;
    options.allocator.track_allocations = true;
    if (policy_ == "bulk") {
      options.allocator.budgets[alloc::tier_index(Tier::kPinnedHost)] = 2 * kMiB;
    }
    std::array<std::unique_ptr<alloc::Upstream>, alloc::kNumTiers> inner = {
        alloc::make_simulated_device_upstream({.capacity = 256 * kMiB}),
        alloc::make_simulated_pinned_upstream(), alloc::make_pageable_host_upstream()};
    // The upstreams belong to the runtime: kept track of only once it exists.
    std::array<alloc::FaultInjectingUpstream*, kNumUpstreams> made{};
    auto wrap = [&](std::unique_ptr<alloc::Upstream> upstream, int index) {
      auto u = std::make_unique<alloc::FaultInjectingUpstream>(std::move(upstream));
      made[index] = u.get();
      if (planned_ && !disarmed_ && site_.upstream == index) {
        // Every allocation from the k-th on fails; once: only until the runtime call that met
        // the first failure returns (a shortage for one call, whatever retries it makes).
        u->fail_allocate_calls(k_, 1 << 30);
      }
      u->set_on_inject([this] {
        ++upstream_injections_;
        landed_in_flight_ |= inner_->pending_copies() > 0;
      });
      segments_[index] = {};
      return std::make_unique<CountingUpstream>(std::move(u), segments_[index]);
    };
    for (Tier t : alloc::kAllTiers) {
      const int i = alloc::tier_index(t);
      options.allocator.upstreams[i] = wrap(std::move(inner[i]), i);
    }
    // The runtime wraps its staging ring's upstream first, then its bounce buffers'.
    int internal = 0;
    options.wrap_internal_upstream = [&](std::unique_ptr<alloc::Upstream> upstream) {
      return std::unique_ptr<alloc::Upstream>(
          wrap(std::move(upstream), internal++ == 0 ? kStagingUpstream : kBounceUpstream));
    };
    options.device_override = std::make_unique<ForwardingDevice>(*device_);
    absl::StatusOr<std::unique_ptr<Runtime>> rt =
        Runtime::create(std::move(options), policy::builtin_policies());
    if (!rt.ok()) return rt.status();
    rt_ = std::move(*rt);
    faulty_ = made;
    return absl::OkStatus();
  }

  Meta meta() const {
    Meta m;
    if (rt_ == nullptr) return m;
    for (TensorHandle h : rt_->tensors()) {
      const TensorInfo i = *rt_->info(h);
      m.registry[i.spec.name] = str_cat(i.bytes, " ", role_name(i.spec.role), " ", i.spec.layer);
      m.holds[i.spec.name] = i.holds;
      m.placement[i.spec.name] =
          str_cat(alloc::tier_name(i.destination), i.in_flight ? i.destination_staged : i.staged);
    }
    return m;
  }

  void disarm() {
    disarmed_ = true;
    device_->disarm();
    for (auto* u : faulty_) {
      if (u != nullptr) u->disarm();
    }
  }

  // Drains the device, then checks what must hold whenever nothing is in flight.
  void settle_and_check(const std::string& what) {
    device_->set_paused(true);
    // Kernels too: a held tensor's queued kernel must have run before its bytes are read.
    if (absl::Status w = rt_->device().stream_synchronize(rt_->compute_stream()); !w.ok()) {
      problems_.push_back(str_cat(what, ": draining the compute stream: ", w.ToString()));
    }
    if (absl::Status w = rt_->wait_all(); !w.ok()) {
      problems_.push_back(str_cat(what, ": wait_all: ", w.ToString()));
    }
    if (absl::Status w = rt_->allocator().synchronize_pending(); !w.ok()) {
      problems_.push_back(str_cat(what, ": blocks stay withheld: ", w.ToString()));
    }
    std::array<std::int64_t, alloc::kNumTiers> placed{};
    for (TensorHandle h : rt_->tensors()) {
      const TensorInfo i = *rt_->info(h);
      // A staged tensor's bytes are in the ring; it keeps its home block meanwhile.
      const Tier block = i.staged ? i.kept_tier : i.tier;
      if (i.bytes > 0) {
        placed[alloc::tier_index(block)] += static_cast<std::int64_t>((i.bytes + 511) & ~511ull);
      }
      if (read_all(*rt_, h) != expected_.at(i.spec.name)) {
        problems_.push_back(str_cat(what, ": bytes of '", i.spec.name, "' are not as expected"));
      }
    }
    for (Tier t : alloc::kAllTiers) {
      const alloc::TierStats s = rt_->allocator().stats(t);
      if (s.withheld_bytes.current != 0) {
        problems_.push_back(str_cat(what, ": ", s.withheld_bytes.current, " bytes withheld in ",
                                    alloc::tier_name(t)));
      }
      if (s.allocated_bytes.current != placed[alloc::tier_index(t)]) {
        problems_.push_back(str_cat(what, ": ", alloc::tier_name(t), " has ",
                                    s.allocated_bytes.current, " bytes live, the registry places ",
                                    placed[alloc::tier_index(t)], " there"));
      }
    }
    device_->set_paused(false);
  }

  // Runs one scenario call; when it fails, checks the promises, retries without the fault, and
  // checks the drained state. Hooks (the policy's work at step boundaries) may leave the policy's
  // own holds and placement changed; every other call must leave them as they were.
  void call(const std::string& what, const std::function<absl::Status()>& fn,
            Kind kind = Kind::kCall) {
    const bool have_runtime = kind != Kind::kNoRuntime;
    const Meta before = have_runtime ? meta() : Meta{};
    absl::Status s = fn();
    if (planned_ && site_.kind == Site::kAllocOnce && upstream_injections_ > 0) disarm();
    if (s.ok()) return;
    const int attempts = planned_ && site_.kind == Site::kSticky ? 3 : 1;
    for (int attempt = 0; attempt < attempts; ++attempt) {
      if (attempt > 0) {
        s = fn();
        if (s.ok()) {
          problems_.push_back(str_cat(what, ": succeeded under a sticky error"));
          break;
        }
      }
      ++failed_calls_;
      if (std::getenv("STRATA_FAULT_VERBOSE") != nullptr) {
        std::fprintf(stderr, "  %s failed: %s\n", what.c_str(), s.ToString().c_str());
      }
      const bool typed = s.code() == absl::StatusCode::kResourceExhausted ||
                         s.code() == absl::StatusCode::kInternal ||
                         s.code() == absl::StatusCode::kUnavailable;
      if (!typed || s.message().find("injected failure") == std::string_view::npos) {
        problems_.push_back(str_cat(what, ": untyped or causeless error: ", s.ToString()));
      }
      if (!have_runtime) continue;
      const Meta after = meta();
      if (after.registry != before.registry) {
        problems_.push_back(str_cat(what, ": registry changed"));
      }
      if (kind != Kind::kHook && after.holds != before.holds) {
        problems_.push_back(str_cat(what, ": holds changed"));
      }
      if (kind == Kind::kCall && after.placement != before.placement) {
        problems_.push_back(str_cat(what, ": placement changed"));
      }
    }
    disarm();
    absl::Status retry = fn();
    if (!retry.ok()) problems_.push_back(str_cat(what, ": retry failed: ", retry.ToString()));
    if (rt_ != nullptr) settle_and_check(what);
  }

  std::string policy_;
  PolicyConfig config_;
  SimulatedDevice* inner_ = nullptr;  // owned by device_
  std::unique_ptr<FaultInjectingDevice> device_;
  std::array<alloc::FaultInjectingUpstream*, kNumUpstreams> faulty_{};
  std::array<SegmentCount, kNumUpstreams> segments_{};
  std::int64_t upstream_injections_ = 0;
  std::unique_ptr<Runtime> rt_;
  bool planned_ = false;
  bool disarmed_ = false;
  Site site_;
  std::int64_t k_ = 0;
  std::map<std::string, Bytes> expected_;  // the oracle
  std::map<std::string, Bytes> final_;
  std::vector<std::string> problems_;
  int failed_calls_ = 0;
  bool landed_in_flight_ = false;
};

struct Tally {
  int sites = 0;
  std::int64_t injections = 0, failed_calls = 0, in_flight = 0;
  int failures = 0;
};

// One pass: every site under both policies, each k (exhaustive) or a sample of them.
void sweep(std::uint64_t seed, bool exhaustive, Tally& tally) {
  // bulk with a small pinned budget, so its phase switches spill into pageable memory through
  // the bounce buffers; layer_prefetch keeps everything pinned at rest and stages it.
  const std::vector<std::pair<std::string, PolicyConfig>> policies = {
      {"bulk", {.roles = kMoved, .offload_after_step = true}},
      {"layer_prefetch", {.prefetch_depth = 1, .roles = kMoved}},
  };
  std::mt19937_64 pick(seed);
  for (const auto& [policy, config] : policies) {
    ScenarioRun reference(policy, config, seed);
    reference.execute();
    ASSERT_TRUE(reference.problems().empty()) << policy << ": " << reference.problems().front();
    for (const Site& site : all_sites()) {
      const std::int64_t n = reference.calls_of(site);
      if (n == 0) continue;
      ++tally.sites;
      std::vector<std::int64_t> ks(static_cast<std::size_t>(n));
      for (std::int64_t k = 1; k <= n; ++k) ks[k - 1] = k;
      // A sample: k values in a random order, the first few of them, then more only until one
      // makes a call fail (some faults the runtime absorbs by design: a move to the GPU with no
      // room streams instead, pinned memory with none spills to pageable).
      std::size_t sample = ks.size();
      if (!exhaustive && n > sample_per_site()) {
        std::shuffle(ks.begin(), ks.end(), pick);
        sample = static_cast<std::size_t>(sample_per_site());
      }
      std::int64_t site_failed_calls = 0;
      for (std::size_t i = 0; i < ks.size(); ++i) {
        const std::int64_t k = ks[i];
        if (const char* only = std::getenv("STRATA_FAULT_CASE");
            only != nullptr && str_cat(policy, "/", site.name, "/", k) != only) {
          continue;
        }
        if (i >= sample && site_failed_calls > 0) break;
        ScenarioRun run(policy, config, seed);
        run.plan(site, k);
        run.execute();
        ++tally.injections;
        tally.failed_calls += run.failed_calls();
        tally.in_flight += run.landed_in_flight() ? 1 : 0;
        site_failed_calls += run.failed_calls();
        std::vector<std::string> problems = run.problems();
        if (!run.fired()) problems.push_back("the fault never fired");
        if (problems.empty() && run.final_state() != reference.final_state()) {
          problems.push_back("final bytes differ from the fault-free run");
        }
        if (!problems.empty()) {
          ++tally.failures;
          std::string all;
          for (const std::string& p : problems) str_append(&all, "\n  ", p);
          ADD_FAILURE() << "seed " << seed << ", " << policy << ", " << site.name << " call " << k
                        << " of " << n << ":" << all;
        }
      }
      if (std::getenv("STRATA_FAULT_CASE") == nullptr) {
        EXPECT_GT(site_failed_calls, 0) << policy << ", " << site.name
                                        << ": no injection made a call fail (seed " << seed << ")";
      }
    }
  }
}

TEST(FaultSweepTest, EveryCallOfEverySiteFailsAndNothingIsLost) {
  const bool exhaustive = std::getenv("STRATA_FAULT_EXHAUSTIVE") != nullptr;
  std::vector<std::uint64_t> seeds;
  if (const char* env = std::getenv("STRATA_FAULT_SEED")) {
    seeds.push_back(std::strtoull(env, nullptr, 10));
  } else {
    seeds.push_back(1);
    if (!exhaustive) {
      seeds.push_back(static_cast<std::uint64_t>(
          std::chrono::steady_clock::now().time_since_epoch().count() % 1000000007));
    }
  }
  Tally tally;
  for (std::uint64_t seed : seeds) {
    std::printf(
        "fault sweep seed %llu (STRATA_FAULT_SEED=%llu reruns it)%s\n",
        static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed),
        exhaustive ? ", every k" : str_cat(", at most ", sample_per_site(), " k per site").c_str());
    sweep(seed, exhaustive, tally);
  }
  std::printf(
      "fault sites: %d, injections: %lld, failed calls: %lld, in flight: %lld, failures: %d\n",
      tally.sites / static_cast<int>(seeds.size()), static_cast<long long>(tally.injections),
      static_cast<long long>(tally.failed_calls), static_cast<long long>(tally.in_flight),
      tally.failures);
  EXPECT_GT(tally.in_flight, 0) << "no fault landed while a copy was in flight";
}

}  // namespace
}  // namespace strata::rt

namespace strata::rt {
namespace {

// A runtime over a fault-injecting deferred device (copies completing in a random order) with an
// Adam over `layers` parameters of `numel` elements, odd layers in bfloat16 stepped through
// float32 master copies (Note [Mixed precision]): the rig of the Adam fault tests below.
struct AdamRig {
  std::unique_ptr<Runtime> rt;
  FaultInjectingDevice* faults = nullptr;
  std::unique_ptr<optim::Adam> adam;
  // Plans the k-th call of the site's kind from now to fail (once, or sticky); returns the calls
  // of that kind so far (count from there what the armed part made).
  std::int64_t arm(const std::optional<Site>& site, std::int64_t k) {
    if (site && site->kind == Site::kSticky) {
      faults->fail_sticky(site->call, k);
    } else if (site) {
      faults->fail_call(site->call, k);
    }
    return faults->calls(site ? site->call : DeviceCall::kCopy);
  }
};
AdamRig make_adam_rig(const std::string& policy, PolicyConfig config, std::uint64_t seed,
                      int layers, std::size_t numel, std::size_t gpu_budget = alloc::kNoBudget) {
  AdamRig rig;
  auto inner = std::make_unique<SimulatedDevice>();
  inner->set_deferred(true);
  inner->set_random_completion(seed);
  auto device = std::make_unique<FaultInjectingDevice>(std::move(inner));
  rig.faults = device.get();
  RuntimeOptions options;
  options.policy = policy;
  options.policy_config = config;
  options.device_override = std::move(device);
  options.allocator.track_allocations = true;
  options.allocator.budgets[alloc::tier_index(Tier::kGpu)] = gpu_budget;
  rig.rt = *Runtime::create(std::move(options), policy::builtin_policies());
  std::vector<std::pair<TensorHandle, TensorHandle>> params;
  std::vector<float> values(numel);
  std::vector<std::uint16_t> low(numel);
  for (int l = 0; l < layers; ++l) {
    for (std::size_t i = 0; i < numel; ++i) values[i] = 0.001f * static_cast<float>(i % 977 + l);
    const bool bf16 = l % 2 == 1;
    for (std::size_t i = 0; i < numel; ++i) low[i] = optim::float_to_bf16(values[i]);
    const DType dtype = bf16 ? DType::kBFloat16 : DType::kFloat32;
    const void* data = bf16 ? static_cast<const void*>(low.data()) : values.data();
    TensorHandle p =
        *rig.rt->register_tensor(spec(str_cat("a", l), l, Role::kParameter, numel, dtype), data);
    TensorHandle g = *rig.rt->register_tensor(
        spec(str_cat("a", l, ".grad"), l, Role::kGradient, numel, dtype), data);
    params.push_back({p, g});
  }
  optim::AdamOptions o;
  o.groups.push_back({.params = params, .hyper = {.lr = 1e-2f, .weight_decay = 0.01f}});
  rig.adam = *optim::Adam::create(*rig.rt, o);
  return rig;
}

// Note [A failed step] in optim/adam.cpp: an Adam step whose k-th device call fails (every kind,
// once or as a sticky error, every k of one step, under bulk over budget and layer_prefetch, on the
// deferred device with random completion) returns a typed error, leaves no tensor held or staged,
// and every layer's bytes are the fault-free run's: after the step for the layers it stepped,
// before it for the others (all of them when it rolled its counters back). The next steps run; a
// rolled-back step is retried, and that run ends bitwise equal to the fault-free one.
TEST(FaultSweepTest, AFailedAdamStepLeavesEveryLayerSteppedOrNot) {
  constexpr int kAdamLayers = 3;
  constexpr std::size_t kNumel = 100000;
  constexpr std::uint64_t kSeed = 11;
  const std::vector<std::pair<std::string, PolicyConfig>> policies = {
      {"bulk", {.roles = RoleSet::optimizer_states(), .offload_after_step = true}},
      {"layer_prefetch", {.prefetch_depth = 1}},
  };
  using LayerBytes = std::map<int, std::map<std::string, Bytes>>;
  struct Outcome {
    LayerBytes after_first, after_second, end;
    std::vector<int> stepped;  // layers the second step stepped
    std::int64_t calls = 0;
    bool failed = false, rolled_back = false;
    std::vector<std::string> problems;
  };
  // Two steps, the fault armed for the second; then a third step, disarmed.
  auto run = [&](const std::string& policy, PolicyConfig config, std::optional<Site> site,
                 std::int64_t k) {
    Outcome out;
    // Bulk over budget (Note [Bulk over budget]): its states stream a layer at a time.
    AdamRig rig = make_adam_rig(policy, config, kSeed, kAdamLayers, kNumel,
                                policy == "bulk" ? 6 * kMiB : alloc::kNoBudget);
    std::unique_ptr<Runtime>& rt = rig.rt;
    FaultInjectingDevice* faults = rig.faults;
    std::unique_ptr<optim::Adam>& adam = rig.adam;
    auto snapshot = [&]() {
      LayerBytes b;
      if (absl::Status w = rt->wait_all(); !w.ok()) out.problems.push_back(w.ToString());
      for (TensorHandle h : rt->tensors()) {
        const TensorInfo i = *rt->info(h);
        b[i.spec.layer][i.spec.name] = read_all(*rt, h);
      }
      return b;
    };
    auto one_step = [&]() -> absl::Status {
      STRATA_RETURN_IF_ERROR(rt->begin_step());
      STRATA_RETURN_IF_ERROR(adam->step());
      return rt->end_step();
    };
    if (absl::Status s = one_step(); !s.ok()) {
      out.problems.push_back(str_cat("step 1: ", s.ToString()));
    }
    out.after_first = snapshot();
    const DeviceCall counted = site ? site->call : DeviceCall::kCopy;
    const std::int64_t before = rig.arm(site, k);
    // A hook that fails is repeated once the fault is gone (as in the sweep above).
    auto hook = [&](const char* what, const std::function<absl::Status()>& fn) {
      absl::Status h = fn();
      if (h.ok()) return;
      if (std::getenv("STRATA_FAULT_VERBOSE") != nullptr) {
        std::fprintf(stderr, "  %s failed: %s\n", what, h.ToString().c_str());
      }
      if (h.message().find("injected failure") == std::string_view::npos) {
        out.problems.push_back(str_cat(what, ": error without its cause: ", h.ToString()));
      }
      faults->disarm();
      if (absl::Status r = fn(); !r.ok()) {
        out.problems.push_back(str_cat(what, " repeated: ", r.ToString()));
      }
    };
    hook("begin_step", [&] { return rt->begin_step(); });
    absl::Status s = adam->step();
    if (std::getenv("STRATA_FAULT_VERBOSE") != nullptr) {
      std::fprintf(stderr, "  %s k=%lld step: %s\n", policy.c_str(), static_cast<long long>(k),
                   s.ToString().c_str());
    }
    out.stepped = adam->last_step_layers();
    hook("end_step", [&] { return rt->end_step(); });

    out.calls = faults->calls(counted) - before;
    faults->disarm();
    if (!s.ok()) {
      out.failed = true;
      out.rolled_back = adam->step_count(0) == 1;
      if (s.message().find("injected failure") == std::string_view::npos) {
        out.problems.push_back(str_cat("error without its cause: ", s.ToString()));
      }
      if (!out.rolled_back && s.message().find("restore a checkpoint") == std::string_view::npos &&
          s.message().find("stepped every layer") == std::string_view::npos) {
        out.problems.push_back(str_cat("error does not say what was stepped: ", s.ToString()));
      }
    }
    for (TensorHandle h : rt->tensors()) {
      // Where it is going: a write-back home may still be under way.
      const TensorInfo i = *rt->info(h);
      const bool staged = i.in_flight ? i.destination_staged : i.staged;
      if (i.holds != 0 || staged) {
        out.problems.push_back(
            str_cat("'", i.spec.name, "' left ", i.holds, " holds, staged ", staged));
      }
    }
    out.after_second = snapshot();
    if (out.rolled_back) {
      // Retry the step that failed, then the third.
      if (absl::Status r = one_step(); !r.ok()) {
        out.problems.push_back(str_cat("retry: ", r.ToString()));
      }
    }
    if (absl::Status r = one_step(); !r.ok()) {
      out.problems.push_back(str_cat("next: ", r.ToString()));
    }
    out.end = snapshot();
    return out;
  };

  const std::vector<Site> sites = device_sites();
  int injections = 0, failed_steps = 0, exact_retries = 0, partial = 0, failures = 0;
  for (const auto& [policy, config] : policies) {
    const Outcome reference = run(policy, config, std::nullopt, 0);
    ASSERT_TRUE(reference.problems.empty()) << policy << ": " << reference.problems.front();
    for (const Site& site : sites) {
      const std::int64_t n = run(policy, config, site, 0).calls;
      for (std::int64_t k = 1; k <= n; ++k) {
        Outcome o = run(policy, config, site, k);
        ++injections;
        failed_steps += o.failed;
        std::vector<std::string> problems = o.problems;
        // Layer by layer: the fault-free run's bytes after the second step where this step
        // stepped the layer, after the first where it did not.
        for (const auto& [layer, tensors] : o.after_second) {
          const bool stepped =
              std::find(o.stepped.begin(), o.stepped.end(), layer) != o.stepped.end();
          const LayerBytes& want = stepped ? reference.after_second : reference.after_first;
          if (tensors != want.at(layer)) {
            problems.push_back(str_cat("layer ", layer, " (", stepped ? "stepped" : "not stepped",
                                       ") differs from the fault-free run"));
          }
        }
        if (o.failed && !o.rolled_back) ++partial;
        if (o.rolled_back) {
          ++exact_retries;
          if (o.end != reference.end) problems.push_back("bytes differ after an exact retry");
        }
        if (!problems.empty()) {
          ++failures;
          ADD_FAILURE() << policy << ", " << site.name << " call " << k << " of " << n << ": "
                        << problems.front();
        }
      }
    }
  }
  std::printf(
      "Adam step faults: %d injections, %d failed steps (%d rolled back and retried exactly, %d "
      "partly stepped), every layer checked, failures: %d\n",
      injections, failed_steps, exact_retries, partial, failures);
}

// Note [Overlapped step] in optim/adam.h under faults: the second of three overlapped steps (every
// layer stepped during backward, finish_step validating it) meets the k-th call of one device call
// kind failing, once or as a sticky error, for every k of that step, under layer_prefetch with
// every role streamed (undo by fresh home blocks) and keep_on_gpu (undo by copies, to pinned
// memory or on the GPU), with a true
// grad_scale equal to the speculation's (it holds) or not (a redo). Whatever fails is called again
// once the fault is gone, except a failed step_layer, whose layer finish_step steps; the error is
// typed and carries its cause; after the step nothing is held, staged or kept for an undo; and the
// run ends bitwise equal to the fault-free run, unless an error said that part of a step was taken
// and a checkpoint is needed (counted, and only where a redo's own step failed part way).
TEST(FaultSweepTest, AFailedOverlappedStepIsFinishedExactly) {
  constexpr int kAdamLayers = 3;
  constexpr std::size_t kNumel = 20000;
  constexpr std::uint64_t kSeed = 13;
  struct Setup {
    std::string policy;
    PolicyConfig config;
    float true_scale;  // of the faulted step; the speculation assumes 1
  };
  const std::vector<Setup> setups = {
      {"layer_prefetch",
       {.prefetch_depth = 1, .roles = RoleSet::all(), .overlap = Overlap::kBackward},
       1.0f},
      {"layer_prefetch",
       {.prefetch_depth = 1, .roles = RoleSet::all(), .overlap = Overlap::kBackward},
       2.0f},
      {"keep_on_gpu", {.overlap = Overlap::kBackward}, 1.0f},
      {"keep_on_gpu", {.overlap = Overlap::kBackward}, 2.0f},
      {"keep_on_gpu", {.overlap = Overlap::kBackward, .undo_on_gpu = true}, 1.0f},
      {"keep_on_gpu", {.overlap = Overlap::kBackward, .undo_on_gpu = true}, 2.0f},
  };
  struct Outcome {
    std::map<std::string, Bytes> end;
    std::int64_t calls = 0;
    int failed_calls = 0;
    bool partial = false;
    std::vector<std::string> problems;
  };
  auto run = [&](const Setup& setup, std::optional<Site> site, std::int64_t k) {
    Outcome out;
    AdamRig rig = make_adam_rig(setup.policy, setup.config, kSeed, kAdamLayers, kNumel);
    std::unique_ptr<Runtime>& rt = rig.rt;
    FaultInjectingDevice* faults = rig.faults;
    std::unique_ptr<optim::Adam>& adam = rig.adam;
    auto scale = std::make_shared<float>(1.0f);
    // Repeats a call that failed once the fault is gone; `retry` false: only checks the error.
    auto attempt = [&](const std::string& what, const std::function<absl::Status()>& fn,
                       bool retry = true) {
      absl::Status s = fn();
      if (s.ok()) return;
      ++out.failed_calls;
      if (std::getenv("STRATA_FAULT_VERBOSE") != nullptr) {
        std::fprintf(stderr, "  %s failed: %s\n", what.c_str(), s.ToString().c_str());
      }
      if (s.message().find("restore a checkpoint") != std::string_view::npos) out.partial = true;
      if (s.message().find("injected failure") == std::string_view::npos) {
        out.problems.push_back(str_cat(what, ": error without its cause: ", s.ToString()));
      }
      faults->disarm();
      if (!retry) return;
      if (absl::Status r = fn(); !r.ok()) {
        if (r.message().find("restore a checkpoint") != std::string_view::npos) out.partial = true;
        out.problems.push_back(str_cat(what, " repeated: ", r.ToString()));
      }
    };
    auto step = [&](float true_scale) {
      attempt("begin_step", [&] { return rt->begin_step(); });
      for (int l = 0; l < kAdamLayers; ++l) {
        attempt(str_cat("before_forward ", l), [&] { return rt->before_forward(l); });
      }
      for (int l = kAdamLayers - 1; l >= 0; --l) {
        attempt(str_cat("after_backward ", l), [&] { return rt->after_backward(l); });
        attempt(
            str_cat("step_layer ", l), [&] { return adam->step_layer(l); }, false);
      }
      *scale = true_scale;
      attempt("finish_step", [&] { return adam->finish_step(scale.get()).status(); });
      attempt("end_step", [&] { return rt->end_step(); });
    };
    step(1.0f);
    const DeviceCall counted = site ? site->call : DeviceCall::kCopy;
    const std::int64_t before = rig.arm(site, k);
    step(setup.true_scale);
    out.calls = faults->calls(counted) - before;
    faults->disarm();
    if (absl::Status w = rt->wait_all(); !w.ok()) out.problems.push_back(w.ToString());
    for (TensorHandle h : rt->tensors()) {
      const TensorInfo i = *rt->info(h);
      if (i.holds != 0 || i.staged) {
        out.problems.push_back(
            str_cat("'", i.spec.name, "' left ", i.holds, " holds, staged ", i.staged));
      }
    }
    if (rt->undo_tensors() != 0) out.problems.push_back("tensors still kept for an undo");
    step(1.0f);
    if (absl::Status w = rt->wait_all(); !w.ok()) out.problems.push_back(w.ToString());
    for (TensorHandle h : rt->tensors()) out.end[rt->info(h)->spec.name] = read_all(*rt, h);
    return out;
  };

  const std::vector<Site> sites = device_sites();
  int injections = 0, failed_calls = 0, partial = 0, failures = 0;
  for (const Setup& setup : setups) {
    const Outcome reference = run(setup, std::nullopt, 0);
    ASSERT_TRUE(reference.problems.empty()) << setup.policy << ": " << reference.problems.front();
    ASSERT_EQ(reference.failed_calls, 0);
    for (const Site& site : sites) {
      const std::int64_t n = run(setup, site, 0).calls;
      for (std::int64_t k = 1; k <= n; ++k) {
        Outcome o = run(setup, site, k);
        ++injections;
        failed_calls += o.failed_calls;
        std::vector<std::string> problems = o.problems;
        if (o.partial) {
          ++partial;
        } else if (o.end != reference.end) {
          problems.push_back("bytes differ from the fault-free run");
        }
        if (!problems.empty()) {
          ++failures;
          ADD_FAILURE() << setup.policy << " (true scale " << setup.true_scale << "), " << site.name
                        << " call " << k << " of " << n << ": " << problems.front();
        }
      }
    }
  }
  std::printf(
      "overlapped step faults: %d injections, %d failed calls, %d runs with a step taken part way, "
      "failures: %d\n",
      injections, failed_calls, partial, failures);
}

}  // namespace
}  // namespace strata::rt
