// The Adam steps of the fault sweep (F1-F5 of RELIABILITY.md, fault_sweep_test.cpp has the
// scenario): a step whose k-th device call fails, sequential
// (AFailedAdamStepLeavesEveryLayerSteppedOrNot) and taken during backward
// (AFailedOverlappedStepIsFinishedExactly), and a failed finish_step followed by cancel_step
// (AFailedFinishStepIsTakenBackWholeOrFinished), under every kind of device call failing once or
// as a sticky error, on the deferred simulated device with random completion. Each prints its
// tally ("Adam step faults: ...", "overlapped step faults: ...", "failed finish_step then
// cancel_step: ...").
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "gtest/gtest.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "tests/reliability/fault_sites.h"
#include "tests/runtime/fault_injection.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using namespace sweep;  // NOLINT: the sites the sweeps share
using Bytes = std::vector<unsigned char>;
using strata::kMiB;
using testing::read_all;
using testing::spec;

// A runtime over a fault-injecting deferred device (copies completing in a random order) with an
// Adam over `layers` parameters of `numel` elements, odd layers in bfloat16 stepped through
// float32 master copies (See Note [Mixed precision]): the rig of the Adam fault tests below.
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
                      int layers, std::size_t numel, std::size_t gpu_budget = alloc::kNoBudget,
                      optim::StateType moments = optim::StateType::kF32,
                      const std::string& rule = "adam") {
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
  o.state_dtype = moments;
  o.rule = *optim::make_step_rule(rule);  // See Note [Step rules] in optim/step_rule.h
  o.groups.push_back({.params = params, .hyper = {.lr = 1e-2f, .weight_decay = 0.01f}});
  rig.adam = *optim::Adam::create(*rig.rt, o);
  return rig;
}

// An Adam step whose k-th device call fails (every kind, once or as a sticky error, every k of one
// step, under bulk over budget, layer_prefetch and hybrid with a layer stepped on the host, the
// last two also with int8 moments (See Note [Compressed moments] in optim/state_codec.h), and
// hybrid with Lion's rule (See Note [Step rules] in optim/step_rule.h), on the deferred device
// with random completion)
// returns a typed error, leaves no tensor held or staged, and every layer's bytes are the
// fault-free run's: after the step for the layers it stepped, before it for the others (all of them
// when it rolled its counters back; See Note [A failed step] in optim/adam.cpp). The next steps
// run; a rolled-back step is retried, and that run ends bitwise equal to the fault-free one.
TEST(FaultSweepTest, AFailedAdamStepLeavesEveryLayerSteppedOrNot) {
  constexpr int kAdamLayers = 3;
  constexpr std::size_t kNumel = 100000;
  constexpr std::uint64_t kSeed = 11;
  struct Setup {
    std::string policy;
    PolicyConfig config;
    optim::StateType moments = optim::StateType::kF32;
    std::string rule = "adam";
  };
  const std::vector<Setup> policies = {
      {"bulk", {.roles = RoleSet::optimizer_states(), .offload_after_step = true}},
      {"layer_prefetch", {.prefetch_depth = 1}},
      // Layer 1 of 3 (bfloat16, with its master) stepped on the host.
      {"hybrid", {.prefetch_depth = 1, .hybrid_fraction = 0.5}},
      {"layer_prefetch", {.prefetch_depth = 1}, optim::StateType::kI8},
      {"hybrid", {.prefetch_depth = 1, .hybrid_fraction = 0.5}, optim::StateType::kI8},
      {"hybrid", {.prefetch_depth = 1, .hybrid_fraction = 0.5}, optim::StateType::kF32, "lion"},
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
  auto run = [&](const Setup& setup, std::optional<Site> site, std::int64_t k) {
    Outcome out;
    const std::string& policy = setup.policy;
    // Bulk over budget (See Note [Bulk over budget]): its states stream a layer at a time.
    AdamRig rig =
        make_adam_rig(policy, setup.config, kSeed, kAdamLayers, kNumel,
                      policy == "bulk" ? 6 * kMiB : alloc::kNoBudget, setup.moments, setup.rule);
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
  int stale_parameters = 0;
  for (const Setup& setup : policies) {
    const std::string& policy = setup.policy;
    const Outcome reference = run(setup, std::nullopt, 0);
    ASSERT_TRUE(reference.problems.empty()) << policy << ": " << reference.problems.front();
    for (const Site& site : sites) {
      const std::int64_t n = run(setup, site, 0).calls;
      for (std::int64_t k = 1; k <= n; ++k) {
        Outcome o = run(setup, site, k);
        ++injections;
        failed_steps += o.failed;
        std::vector<std::string> problems = o.problems;
        // Layer by layer: the fault-free run's bytes after the second step where this step
        // stepped the layer, after the first where it did not.
        for (const auto& [layer, tensors] : o.after_second) {
          const bool stepped =
              std::find(o.stepped.begin(), o.stepped.end(), layer) != o.stepped.end();
          const LayerBytes& want = stepped ? reference.after_second : reference.after_first;
          // See Note [Host-stepped layers] in optim/adam_host_step.cpp: a layer stepped on the
          // host whose parameter copy back could not be queued (a sticky device error, where
          // nothing else can be copied either) has its states stepped and its GPU parameter as it
          // was; the step's error says to restore a checkpoint. Exactly that, nothing else.
          const std::string param = str_cat("a", layer);
          if (policy == "hybrid" && site.kind == Site::kSticky && stepped &&
              tensors.at(param) == reference.after_first.at(layer).at(param)) {
            std::map<std::string, Bytes> expected = want.at(layer);
            expected[param] = reference.after_first.at(layer).at(param);
            if (tensors != expected) {
              problems.push_back(str_cat("layer ", layer,
                                         " (stepped on the host, its parameter "
                                         "left) differs from the fault-free run"));
            }
            ++stale_parameters;
            continue;
          }
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
          ADD_FAILURE() << policy << " (" << setup.rule << ", moments "
                        << optim::state_dtype_name(setup.moments) << "), " << site.name << " call "
                        << k << " of " << n << ": " << problems.front();
        }
      }
    }
  }
  std::printf(
      "Adam step faults: %d injections, %d failed steps (%d rolled back and retried exactly, %d "
      "partly stepped; %d host-stepped layers left their GPU parameter under a sticky error), "
      "every layer checked, failures: %d\n",
      injections, failed_steps, exact_retries, partial, stale_parameters, failures);
}

// The overlapped step under faults (See Note [Overlapped step] in optim/adam.h): the second of
// three overlapped steps (every layer stepped during backward, finish_step validating it) meets the
// k-th call of one device call kind failing, once or as a sticky error, for every k of that step,
// under layer_prefetch with every role streamed (undo by fresh home blocks; also with int8
// moments), keep_on_gpu (undo by copies, to pinned memory or on the GPU) and hybrid with half the
// layers stepped on the host during backward (with Adam, and with Lion's rule), with a true
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
    optim::StateType moments = optim::StateType::kF32;
    std::string rule = "adam";
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
      // int8 moments (See Note [Compressed moments] in optim/state_codec.h): a redo draws the
      // speculation's rounding again.
      {"layer_prefetch",
       {.prefetch_depth = 1, .roles = RoleSet::all(), .overlap = Overlap::kBackward},
       2.0f,
       optim::StateType::kI8},
      // Layers stepped on the host during backward (See Note [Host steps in backward] in
      // optim/adam_host_speculation.cpp): their states put back from host memory on a redo.
      {"hybrid",
       {.prefetch_depth = 1, .overlap = Overlap::kBackward, .hybrid_fraction = 0.5},
       1.0f},
      {"hybrid",
       {.prefetch_depth = 1, .overlap = Overlap::kBackward, .hybrid_fraction = 0.5},
       2.0f},
      // The same with Lion's rule (See Note [Step rules] in optim/step_rule.h).
      {"hybrid",
       {.prefetch_depth = 1, .overlap = Overlap::kBackward, .hybrid_fraction = 0.5},
       2.0f,
       optim::StateType::kF32,
       "lion"},
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
    AdamRig rig = make_adam_rig(setup.policy, setup.config, kSeed, kAdamLayers, kNumel,
                                alloc::kNoBudget, setup.moments, setup.rule);
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
          ADD_FAILURE() << setup.policy << " (" << setup.rule << ", true scale " << setup.true_scale
                        << ", moments " << optim::state_dtype_name(setup.moments) << "), "
                        << site.name << " call " << k << " of " << n << ": " << problems.front();
        }
      }
    }
  }
  std::printf(
      "overlapped step faults: %d injections, %d failed calls, %d runs with a step taken part way, "
      "failures: %d\n",
      injections, failed_calls, partial, failures);
}

// A finish_step that fails, and then cancel_step, as a loop's zero_grad() or close() calls it
// after a step() that raised (See Note [Overlapped step] in optim/adam.h). Before finish_step
// committed the step, cancel_step takes all of it back and a sequential step() takes it again,
// exactly. Once it committed (the speculation held, the undo dropped) and finishing the rest
// failed, cancel_step and step_layer refuse with kFailedPrecondition naming finish_step, changing
// nothing; then finish_step again finishes the step, exactly, or (every other k) a checkpoint of
// the step's start is restored, which forgets it, and the step taken again from there is exact
// even where finishing had stepped part of it. Every k-th call of every kind of device call in
// the finish_step alone, once or sticky, under layer_prefetch with half of the states stepped in
// backward (the rest after it) and hybrid with half the layers stepped on the host, each with a
// true grad_scale equal to the speculation's (it holds) and not (a redo). Exact: the run ends
// bitwise equal to the fault-free run, unless an error asked for a checkpoint.
TEST(FaultSweepTest, AFailedFinishStepIsTakenBackWholeOrFinished) {
  constexpr int kAdamLayers = 3;
  constexpr std::size_t kNumel = 20000;
  constexpr std::uint64_t kSeed = 17;
  struct Setup {
    std::string policy;
    PolicyConfig config;
    float true_scale;
    double share = 1.0;
  };
  const PolicyConfig streamed{
      .prefetch_depth = 1, .roles = RoleSet::all(), .overlap = Overlap::kBackward};
  const PolicyConfig hybrid{
      .prefetch_depth = 1, .overlap = Overlap::kBackward, .hybrid_fraction = 0.5};
  const std::vector<Setup> setups = {{"layer_prefetch", streamed, 1.0f, 0.5},
                                     {"layer_prefetch", streamed, 2.0f, 0.5},
                                     {"hybrid", hybrid, 1.0f},
                                     {"hybrid", hybrid, 2.0f}};
  struct Outcome {
    std::map<std::string, Bytes> end;
    std::int64_t calls = 0;
    bool failed = false, taken_back = false, refused = false, restored = false, partial = false;
    std::vector<std::string> problems;
  };
  auto run = [&](const Setup& setup, std::optional<Site> site, std::int64_t k) {
    Outcome out;
    AdamRig rig = make_adam_rig(setup.policy, setup.config, kSeed, kAdamLayers, kNumel);
    Runtime& rt = *rig.rt;
    optim::Adam& adam = *rig.adam;
    EXPECT_TRUE(adam.set_backward_share(setup.share).ok());
    auto scale = std::make_shared<float>(1.0f);
    auto must = [&](const std::string& what, const absl::Status& s) {
      if (!s.ok()) out.problems.push_back(str_cat(what, ": ", s.ToString()));
    };
    auto asks_checkpoint = [](const absl::Status& s) {
      return s.message().find("restore a checkpoint") != std::string_view::npos;
    };
    // Forward and backward, each layer stepped in backward as it ends.
    auto backward = [&] {
      must("begin_step", rt.begin_step());
      for (int l = 0; l < kAdamLayers; ++l) must("before_forward", rt.before_forward(l));
      for (int l = kAdamLayers - 1; l >= 0; --l) {
        must("after_backward", rt.after_backward(l));
        must("step_layer", adam.step_layer(l));
      }
    };
    backward();
    must("finish_step", adam.finish_step(scale.get()).status());
    must("end_step", rt.end_step());
    // A checkpoint of the step's start: the parameters and the optimizer's own.
    std::vector<std::pair<TensorHandle, Bytes>> params;
    for (TensorHandle h : rt.tensors()) {
      if (rt.info(h)->spec.role == Role::kParameter) params.emplace_back(h, read_all(rt, h));
    }
    std::stringstream checkpoint;
    must("save", adam.save(checkpoint));
    backward();
    *scale = setup.true_scale;
    const DeviceCall counted = site ? site->call : DeviceCall::kCopy;
    const std::int64_t before = rig.arm(site, k);
    const absl::Status finished = adam.finish_step(scale.get()).status();
    out.calls = rig.faults->calls(counted) - before;
    rig.faults->disarm();
    if (!finished.ok()) {
      out.failed = true;
      out.partial = asks_checkpoint(finished);
      if (finished.message().find("injected failure") == std::string_view::npos) {
        out.problems.push_back(str_cat("error without its cause: ", finished.ToString()));
      }
      const bool open = adam.overlapped_step_open();
      const absl::Status cancelled = adam.cancel_step();
      if (cancelled.ok()) {
        out.taken_back = open;  // else finish_step had rolled it back itself
        if (adam.overlapped_step_open()) out.problems.push_back("cancel_step left the step open");
        // The step untaken: taken again after backward, as the sequential step takes it.
        const absl::Status again = adam.step(scale.get());
        if (!again.ok()) out.problems.push_back(str_cat("step() again: ", again.ToString()));
      } else {
        out.refused = true;
        if (!open || !absl::IsFailedPrecondition(cancelled) ||
            cancelled.message().find("finish_step") == std::string_view::npos) {
          out.problems.push_back(str_cat("cancel_step: ", cancelled.ToString()));
        }
        if (!adam.overlapped_step_open()) out.problems.push_back("a refused cancel closed it");
        if (absl::IsFailedPrecondition(adam.step_layer(0)) == false) {
          out.problems.push_back("step_layer joined a committed step");
        }
        if (k % 2 == 1) {
          const absl::Status again = adam.finish_step(scale.get()).status();
          if (!again.ok() && !asks_checkpoint(again)) {
            out.problems.push_back(str_cat("finish_step again: ", again.ToString()));
          }
          out.partial = out.partial || asks_checkpoint(again);
        } else {
          // The checkpoint restored instead: the step is forgotten, and taken again from it.
          out.restored = true;
          out.partial = false;
          if (absl::Status e = rt.end_step(); !e.ok()) must("end_step again", rt.end_step());
          for (const auto& [h, bytes] : params) must("write", rt.write(h, bytes.data()));
          must("load", adam.load(checkpoint));
          if (adam.overlapped_step_open()) out.problems.push_back("load left the step open");
          *scale = setup.true_scale;
          backward();
          must("finish_step after load", adam.finish_step(scale.get()).status());
        }
      }
    }
    if (absl::Status e = rt.end_step(); !e.ok()) must("end_step again", rt.end_step());
    if (rt.undo_tensors() != 0) out.problems.push_back("tensors still kept for an undo");
    *scale = 1.0f;
    backward();
    must("finish_step", adam.finish_step(scale.get()).status());
    must("end_step", rt.end_step());
    must("wait_all", rt.wait_all());
    for (TensorHandle h : rt.tensors()) out.end[rt.info(h)->spec.name] = read_all(rt, h);
    return out;
  };

  int injections = 0, failed = 0, taken_back = 0, refused = 0, restored = 0, partial = 0;
  int failures = 0;
  for (const Setup& setup : setups) {
    const Outcome reference = run(setup, std::nullopt, 0);
    ASSERT_TRUE(reference.problems.empty()) << setup.policy << ": " << reference.problems.front();
    for (const Site& site : device_sites()) {
      const std::int64_t n = run(setup, site, 0).calls;
      for (std::int64_t k = 1; k <= n; ++k) {
        Outcome o = run(setup, site, k);
        ++injections;
        failed += o.failed ? 1 : 0;
        taken_back += o.taken_back ? 1 : 0;
        refused += o.refused ? 1 : 0;
        restored += o.restored ? 1 : 0;
        partial += o.partial ? 1 : 0;
        if (!o.partial && o.end != reference.end) {
          o.problems.push_back("bytes differ from the fault-free run");
        }
        if (!o.problems.empty()) {
          ++failures;
          ADD_FAILURE() << setup.policy << " (true scale " << setup.true_scale << "), " << site.name
                        << " call " << k << " of " << n << ": " << o.problems.front();
        }
      }
    }
  }
  std::printf(
      "failed finish_step then cancel_step: %d injections, %d failed, %d taken back, %d refused "
      "(committed; %d of them restored from a checkpoint), %d asked for a checkpoint, failures: "
      "%d\n",
      injections, failed, taken_back, refused, restored, partial, failures);
  // Both paths ran: steps taken back whole, and committed steps refused and finished.
  EXPECT_GT(taken_back, 0);
  EXPECT_GT(refused, 0);
  EXPECT_GT(restored, 0);
}

}  // namespace
}  // namespace strata::rt
