// tests/optim/overlap_model.h: the small model of the overlapped-step tests (overlap_test.cpp on
// the simulated device, overlap_gpu_test.cpp on a GPU): kLayers layers of kTensorsPerLayer
// parameters in two Adam groups, the cases they run, and what a run ends with (every tensor's bytes
// and each group's step count), so that an overlapped run and a sequential one compare bitwise.
//
// Example:
//   std::unique_ptr<LoopModel> m = make_loop_model(runtime, DType::kBFloat16, 1024);
//   ... m->addr[p.id] is where p is now; m->adam->step_layer(l) ...
//   const Bytes got = collect(runtime, *m->adam);
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "optim/adam.h"
#include "optim/adam_math.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::optim::overlap {

using Bytes = std::map<std::string, std::vector<unsigned char>>;
using Pairs = std::vector<std::pair<rt::TensorHandle, rt::TensorHandle>>;

inline constexpr int kLayers = 4;
inline constexpr int kTensorsPerLayer = 2;
inline constexpr int kInfStep = 7;  // the float16 step whose gradients hold inf

struct Case {
  std::string policy;
  rt::PolicyConfig config;
  rt::DType dtype = rt::DType::kFloat32;
  int micro_batches = 1;
  std::size_t gpu_budget = alloc::kNoBudget;
  std::size_t numel = 1024;                 // elements of each parameter
  StateType state_dtype = StateType::kF32;  // See Note [Compressed moments] in state_codec.h
  std::string rule = "adam";  // the step rule (See Note [Step rules] in optim/step_rule.h)
  std::optional<rt::StepRates> step_rates;  // given to the hybrid's cost model; none: measured
};

// keep_on_gpu, bulk, layer_prefetch with every role and with the states only, in every dtype; then
// gradient accumulation (only the last micro-batch overlaps).
inline std::vector<Case> basic_cases() {
  std::vector<Case> out;
  const rt::PolicyConfig all{.prefetch_depth = 1, .roles = rt::RoleSet::all()};
  const rt::PolicyConfig states{.prefetch_depth = 1, .roles = rt::RoleSet::optimizer_states()};
  rt::PolicyConfig bulk_all = all;
  bulk_all.offload_after_step = true;
  for (rt::DType d : {rt::DType::kFloat32, rt::DType::kBFloat16, rt::DType::kFloat16}) {
    out.push_back({"keep_on_gpu", {}, d});
    out.push_back({"bulk", bulk_all, d});
    out.push_back({"layer_prefetch", all, d});
    out.push_back({"layer_prefetch", states, d});
  }
  out.push_back({"layer_prefetch", all, rt::DType::kBFloat16, 2});
  out.push_back({"layer_prefetch", states, rt::DType::kFloat32, 3});
  // The undo of what rests on the GPU kept on the GPU (See Note [Undo log]).
  rt::PolicyConfig keep_gpu_undo;
  keep_gpu_undo.undo_on_gpu = true;
  rt::PolicyConfig states_gpu_undo = states;
  states_gpu_undo.undo_on_gpu = true;
  rt::PolicyConfig bulk_gpu_undo = bulk_all;
  bulk_gpu_undo.undo_on_gpu = true;
  out.push_back({"keep_on_gpu", keep_gpu_undo, rt::DType::kFloat32});
  out.push_back({"bulk", bulk_gpu_undo, rt::DType::kBFloat16});
  out.push_back({"layer_prefetch", states_gpu_undo, rt::DType::kFloat32});
  out.push_back({"layer_prefetch", states_gpu_undo, rt::DType::kBFloat16});
  return out;
}

// hybrid (See Note [Hybrid placement] in policies/hybrid.cpp) in every dtype, with half
// the parameters stepped on the host, all of them, and the cost model's choice; each against
// layer_prefetch streaming the same states (its reference()); with Adam, then with Lion (See Note
// [Step rules] in optim/step_rule.h).
inline std::vector<Case> hybrid_cases() {
  std::vector<Case> out;
  for (const char* rule : {"adam", "lion"}) {
    for (rt::DType d : {rt::DType::kFloat32, rt::DType::kBFloat16, rt::DType::kFloat16}) {
      for (std::optional<double> f :
           {std::optional<double>(0.5), std::optional<double>(0.0), std::optional<double>()}) {
        rt::PolicyConfig c{.prefetch_depth = 1, .roles = rt::RoleSet::optimizer_states()};
        c.hybrid_fraction = f;
        out.push_back({"hybrid", c, d});
        out.back().rule = rule;
      }
    }
  }
  return out;
}

// Lion, the second step rule, through the same machinery: the overlapped step under keep_on_gpu,
// bulk and layer_prefetch (its hybrid cases are among hybrid_cases()).
inline std::vector<Case> lion_cases() {
  std::vector<Case> out;
  const rt::PolicyConfig all{.prefetch_depth = 1, .roles = rt::RoleSet::all()};
  const rt::PolicyConfig states{.prefetch_depth = 1, .roles = rt::RoleSet::optimizer_states()};
  rt::PolicyConfig bulk_all = all;
  bulk_all.offload_after_step = true;
  out.push_back({"keep_on_gpu", {}, rt::DType::kFloat32});
  out.push_back({"bulk", bulk_all, rt::DType::kBFloat16});
  out.push_back({"layer_prefetch", all, rt::DType::kFloat16});
  out.push_back({"layer_prefetch", states, rt::DType::kBFloat16});
  for (Case& c : out) c.rule = "lion";
  return out;
}

// The layer_prefetch run a hybrid case must match.
inline Case reference(Case c) {
  c.policy = "layer_prefetch";
  c.config.hybrid_fraction.reset();
  return c;
}

// A hybrid run against layer_prefetch's: every tensor bitwise the same, and each master copy that
// only the hybrid run has (a float32 parameter stepped on the host: See Note [Host-stepped layers]
// in optim/adam_host_step.cpp) bitwise its parameter. Returns how many such masters there were.
inline int expect_same_tensors(const Bytes& want, const Bytes& got) {
  EXPECT_FALSE(want.empty());
  int masters = 0;
  for (const auto& [name, bytes] : got) {
    if (want.count(name) != 0) {
      EXPECT_TRUE(want.at(name) == bytes) << name;
      continue;
    }
    EXPECT_TRUE(name.ends_with(".master")) << name << " is in the hybrid run only";
    const std::string param = name.substr(0, name.size() - std::string(".master").size());
    EXPECT_TRUE(got.count(param) != 0 && got.at(param) == bytes) << name;
    ++masters;
  }
  for (const auto& [name, bytes] : want) EXPECT_EQ(got.count(name), 1u) << name;
  return masters;
}

inline std::string describe(const Case& c) {
  return str_cat(
      c.rule, " ", c.policy, " roles ", c.config.roles.to_string(), " ", rt::dtype_name(c.dtype),
      " micro-batches ", c.micro_batches, c.gpu_budget == alloc::kNoBudget ? "" : " with a budget",
      c.config.undo_on_gpu ? " undo on the GPU" : "",
      c.config.hybrid_fraction ? str_cat(" hybrid_fraction ", *c.config.hybrid_fraction) : "",
      " moments ", state_dtype_name(c.state_dtype));
}

inline ElemType elem(rt::DType d) {
  return d == rt::DType::kBFloat16 ? ElemType::kBF16
                                   : (d == rt::DType::kFloat16 ? ElemType::kF16 : ElemType::kF32);
}

// About three times the gradients' norm on most steps, a third of it on steps whose gradients are
// ten times larger: the clip triggers there only.
inline float max_norm(const Case& c) {
  return 3.0f * std::sqrt(static_cast<float>(c.numel) / 1024.0f) *
         static_cast<float>(c.micro_batches);
}

struct Outcomes {
  int speculation = 0;
  int redone = 0;
  int sequential = 0;
  std::int64_t undo_peak_bytes = 0;    // kept at most (See Note [Undo log] in runtime/undo_log.cpp)
  std::int64_t undo_copied_bytes = 0;  // of which copied off the GPU
  std::int64_t h2d_bytes = 0;          // moved to the GPU over the run
  std::int64_t d2h_bytes = 0;          // moved off it
  // Layers stepped on the host during backward, over the run (See Note [Host steps in backward]
  // in optim/adam_host_speculation.cpp).
  int host_in_backward = 0;
  // The hybrid's measured split (See Note [Measured split] in policies/split_search.h): steps after
  // which the host layers changed, and the optimizer's placement line at the end.
  int moves = 0;
  std::string placement;

  void count(Adam::StepOutcome o) {
    if (o == Adam::StepOutcome::kSpeculation) ++speculation;
    if (o == Adam::StepOutcome::kRedone) ++redone;
    if (o == Adam::StepOutcome::kSequential) ++sequential;
  }
};

// The registered model: its Adam, each layer's (parameter, gradient) pairs, and where each tensor
// is now (kept current by an on_moved callback: the model must outlive nothing of the runtime's).
struct LoopModel {
  std::unique_ptr<Adam> adam;
  std::vector<Pairs> of_layer;
  std::map<std::uint64_t, void*> addr;
};

// Registers the model in `runtime` with fixed initial values; nullptr (after a failed EXPECT) if
// anything is refused.
inline std::unique_ptr<LoopModel> make_loop_model(rt::Runtime& runtime, const Case& c) {
  auto m = std::make_unique<LoopModel>();
  const ElemType type = elem(c.dtype);
  const std::size_t esize = rt::dtype_size(c.dtype);
  AdamOptions o;
  o.state_dtype = c.state_dtype;
  o.step_rates = c.step_rates;
  absl::StatusOr<std::shared_ptr<const StepRule>> rule = make_step_rule(c.rule);
  EXPECT_TRUE(rule.ok()) << rule.status();
  if (!rule.ok()) return nullptr;
  o.rule = *rule;
  o.groups.resize(2);
  o.groups[0].hyper = {.lr = 1e-2f, .weight_decay = 0.01f, .decoupled = true};
  o.groups[1].hyper = {.lr = 5e-3f, .weight_decay = 0.0f, .decoupled = true};
  m->of_layer.resize(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    for (int t = 0; t < kTensorsPerLayer; ++t) {
      std::vector<unsigned char> init(c.numel * esize);
      for (std::size_t i = 0; i < c.numel; ++i) {
        store_elem(init.data(), type, static_cast<std::int64_t>(i),
                   0.02f * static_cast<float>((i * 7 + l * 3 + t) % 17) - 0.15f);
      }
      auto p = runtime.register_tensor(
          rt::testing::spec(str_cat("l", l, ".w", t), l, rt::Role::kParameter, c.numel, c.dtype),
          init.data());
      auto g = runtime.register_tensor(
          rt::testing::spec(str_cat("l", l, ".g", t), l, rt::Role::kGradient, c.numel));
      EXPECT_TRUE(p.ok() && g.ok());
      if (!p.ok() || !g.ok()) return nullptr;
      o.groups[static_cast<std::size_t>(t)].params.push_back({*p, *g});
      m->of_layer[static_cast<std::size_t>(l)].push_back({*p, *g});
    }
  }
  absl::StatusOr<std::unique_ptr<Adam>> adam = Adam::create(runtime, o);
  EXPECT_TRUE(adam.ok()) << adam.status();
  if (!adam.ok()) return nullptr;
  m->adam = std::move(*adam);
  for (rt::TensorHandle h : runtime.tensors()) m->addr[h.id] = runtime.info(h)->data;
  runtime.add_on_moved(
      [addr = &m->addr](rt::TensorHandle h, rt::Tier, void* p) { (*addr)[h.id] = p; });
  return m;
}

// Every tensor's bytes and each group's step count, once the runtime is idle; the undo log must
// be empty.
inline Bytes collect(rt::Runtime& runtime, Adam& adam, Outcomes* outcomes) {
  EXPECT_TRUE(runtime.wait_all().ok());
  Bytes out;
  for (rt::TensorHandle h : runtime.tensors()) {
    out[runtime.info(h)->spec.name] = rt::testing::read_all(runtime, h);
  }
  for (std::size_t g = 0; g < adam.num_groups(); ++g) {
    const std::int64_t n = adam.step_count(g);
    out[str_cat("steps of group ", g)] =
        std::vector<unsigned char>(reinterpret_cast<const unsigned char*>(&n),
                                   reinterpret_cast<const unsigned char*>(&n) + sizeof(n));
  }
  EXPECT_EQ(runtime.stats().undo_bytes, 0);
  outcomes->undo_peak_bytes = runtime.stats().undo_peak_bytes;
  outcomes->undo_copied_bytes = runtime.stats().undo_copied_bytes;
  outcomes->h2d_bytes = runtime.stats().migrated_bytes_h2d;
  outcomes->d2h_bytes = runtime.stats().migrated_bytes_d2h;
  return out;
}

// The overlapped run against the sequential one: bitwise the same, the speculation held on most
// steps and was redone where the clip triggered (every fourth step) or inf was found.
// (`steps / 2` and `steps / 4` fit Adam's runs of this model; another rule's gradients differ, so
// its runs pass `at_least` 1: some speculation held, some was redone.)
inline void expect_same(const Bytes& want, const Bytes& got, const Outcomes& seq,
                        const Outcomes& ovl, int steps, std::optional<int> at_least = {}) {
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(seq.sequential, steps);
  EXPECT_GE(ovl.speculation, at_least.value_or(steps / 2));
  EXPECT_GE(ovl.redone, at_least.value_or(steps / 4));
  EXPECT_EQ(ovl.sequential, 0);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, bytes] : want) EXPECT_TRUE(got.at(name) == bytes) << name;
}

}  // namespace strata::optim::overlap
