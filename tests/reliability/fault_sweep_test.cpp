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
#include "tests/reliability/fault_sites.h"
#include "tests/runtime/fault_injection.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using strata::kMiB;
using sweep::device_sites;
using sweep::Site;
using testing::read_all;
using testing::spec;
using testing::special_payload;

constexpr int kLayers = 3;
// Per layer: sizes that share small-block segments in odd ways; four roles each.
constexpr std::size_t kBytes[kLayers] = {600001, 255, 70000};
// Two optimizer states a layer (an optimizer's moments).
const Role kRoles[] = {Role::kParameter, Role::kGradient, Role::kOptimizerState,
                       Role::kOptimizerState};
const char* const kNames[] = {"parameter", "gradient", "exp_avg", "exp_avg_sq"};
// What the policies move; a buffer of role other stays on the GPU.
constexpr RoleSet kMoved = {Role::kParameter, Role::kGradient, Role::kOptimizerState};
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
      for (int k = 0; k < 4; ++k) {
        const Role role = kRoles[k];
        const std::string name = str_cat("l", l, ".", kNames[k]);
        const Bytes payload = special_payload(kBytes[l], 100 * l + k);
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
