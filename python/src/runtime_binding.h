// python/src/runtime_binding.h: strata._strata.Runtime, a runtime and the binding that points
// torch tensors at its memory, with the model hooks (bridge::ModelHooks) made on first use. Its
// methods are what strata/runtime.py calls; errors leave as bridge::check raises them (See the
// module's header in module.cpp).
//
// Example (Python, what strata/runtime.py does):
//   rt = _strata.Runtime(policy="layer_prefetch", gpu_budget=None, prefetch_depth=1,
//                        roles="optimizer_states", device="auto", pinned_budget=None,
//                        overlap="none", undo_on_gpu=False, hybrid_fraction=None)
//   rt.register(p, "w", 0, "parameter", None)
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "allocator/tier.h"
#include "bridge/model_hooks.h"
#include "bridge/status.h"
#include "bridge/torch_runtime.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"
#include "runtime/setup.h"

namespace strata::python {

namespace py = pybind11;

inline rt::Role role_of(const std::string& name) { return bridge::unwrap(rt::parse_role(name)); }

inline std::optional<rt::Tier> tier_of(const std::optional<std::string>& name) {
  if (!name) return std::nullopt;
  return bridge::unwrap(alloc::parse_tier(*name));
}

// A runtime and the binding that points torch tensors at its memory; the binding goes first.
class Runtime {
 public:
  Runtime(const std::optional<std::string>& policy, const std::optional<std::int64_t>& gpu_budget,
          int prefetch_depth, const std::string& roles, const std::string& device,
          const std::optional<std::int64_t>& pinned_budget, const std::string& overlap,
          bool undo_on_gpu, const std::optional<double>& hybrid_fraction) {
    // A Python program's command line is not strata's, so no --strata_policy flag here: the
    // policy given, else STRATA_POLICY, else the default.
    rt::ProgramSetup setup;
    setup.policy = policy;
    const rt::DeviceChoice choice = bridge::unwrap(rt::parse_device(device));
    setup.device = choice.kind;
    setup.cuda_device = choice.cuda_device;
    setup.prefetch_depth = prefetch_depth;
    setup.roles = bridge::unwrap(rt::RoleSet::parse(roles));
    setup.overlap = bridge::unwrap(rt::parse_overlap(overlap));
    setup.undo_on_gpu = undo_on_gpu;
    setup.hybrid_fraction = hybrid_fraction;
    if (gpu_budget) setup.gpu_budget = static_cast<std::size_t>(*gpu_budget);
    if (pinned_budget) setup.pinned_budget = static_cast<std::size_t>(*pinned_budget);
    rt::RuntimeOptions o = rt::runtime_options(setup);
    runtime_ = bridge::unwrap(rt::Runtime::create(std::move(o), policy::builtin_policies()));
    binding_ = std::make_unique<bridge::TorchBinding>(*runtime_);
  }
  ~Runtime() {
    hooks_.reset();
    binding_.reset();
  }

  rt::Runtime& rt() { return *runtime_; }
  bridge::TorchBinding& binding() { return *binding_; }

  bridge::ModelHooks& hooks() {
    if (!hooks_) hooks_ = std::make_unique<bridge::ModelHooks>(*runtime_);
    return *hooks_;
  }

  // The hooks' after_backward with the runtime computing on `stream` (a cudaStream_t as an int;
  // 0: the compute stream as it is): under FSDP2 a unit's gradients are final on its
  // reduce-scatter stream, which the optimizer's step of the layer waits for
  // (See Note [Stepping in backward under FSDP2] in strata/optim.py) from a stream of its own
  // (See Note [The step stream] in bridge/model_hooks.cpp).
  void after_backward(int layer, std::uintptr_t stream) {
    py::gil_scoped_release release;
    if (stream == 0 || runtime_->device().is_simulated()) {
      hooks().after_backward(layer);
      return;
    }
    const rt::StreamHandle before = runtime_->compute_stream();
    runtime_->set_compute_stream(reinterpret_cast<rt::StreamHandle>(stream));
    try {
      hooks().after_backward(layer);
    } catch (...) {
      runtime_->set_compute_stream(before);
      throw;
    }
    runtime_->set_compute_stream(before);
  }

  py::dict stats() {
    py::dict d;
    for (const auto& [name, value] : rt::named_stats(runtime_->stats())) {
      d[py::str(std::string(name))] = std::visit([](auto v) { return py::cast(v); }, value);
    }
    return d;
  }

  // torch.cuda.memory_stats() naming, one prefix per tier: "gpu.allocated_bytes.current", ...
  py::dict memory_stats() {
    py::dict d;
    for (rt::Tier tier : alloc::kAllTiers) {
      const alloc::TierStats s = runtime_->allocator().stats(tier);
      const std::string prefix = std::string(alloc::tier_name(tier)) + ".";
      s.for_each([&](std::string_view name, alloc::StatKind kind, std::int64_t current,
                     std::int64_t peak) {
        const std::string key = prefix + std::string(name);
        if (kind == alloc::StatKind::kGauge) {
          d[py::str(key + ".current")] = current;
          d[py::str(key + ".peak")] = peak;
        } else {
          d[py::str(key)] = current;
        }
      });
      d[py::str(prefix + "fragmentation")] = s.fragmentation;
    }
    return d;
  }

  py::list leak_report() {
    py::list out;
    for (const alloc::LiveAllocation& a : runtime_->allocator().leak_report()) {
      py::dict d;
      d["tier"] = std::string(alloc::tier_name(a.tier));
      d["bytes"] = a.requested;
      d["owner"] = a.owner;
      out.append(d);
    }
    return out;
  }

  // Note [Zeroing a tensor that may be moving]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A policy may still be copying a bound tensor (layer_prefetch sends a step's gradients home
  // after the optimizer step and does not wait); its tensor reads the source until the move
  // completes, so a zero written there now would be lost when the pointer moves to the
  // destination's old values. So when one of them is in flight, every move completes first (one
  // host wait, only then: gradients that no policy moves cost none); copies queued later wait for
  // torch's stream, where the zeroing runs (the hooks fence them behind it).
  //
  // Zeroes bound tensors in place wherever their data is.
  void zero(const std::vector<torch::Tensor>& tensors) {
    bool moving = false;
    for (const torch::Tensor& t : tensors) {
      moving = moving || bridge::unwrap(runtime_->info(binding_->handle(t))).in_flight;
    }
    if (moving) {
      py::gil_scoped_release release;
      bridge::check(runtime_->wait_all());
    }
    for (const torch::Tensor& t : tensors) zero_one(t);
  }

 private:
  void zero_one(torch::Tensor t) {
    if (binding_->is_accessible(t)) {
      t.zero_();
      return;
    }
    const rt::TensorHandle h = binding_->handle(t);
    const rt::TensorInfo info = bridge::unwrap(runtime_->info(h));
    const std::vector<unsigned char> zeros(info.bytes, 0);
    bridge::check(runtime_->write(h, zeros.data()));
  }

  std::unique_ptr<rt::Runtime> runtime_;
  std::unique_ptr<bridge::TorchBinding> binding_;
  std::unique_ptr<bridge::ModelHooks> hooks_;
};

}  // namespace strata::python
