// python/src/adam_binding.h: strata._strata.Adam, optim::Adam over tensors bound to a
// strata._strata.Runtime, which it keeps alive: groups of (parameter, gradient) pairs with their
// hyperparameters, the step (sequential, or inside backward), its placement and state values for
// state dicts. strata.optim (optim.py and its parts) is its only caller.
//
// Example (Python):
//   adam = _strata.Adam(rt, [([(p, p.grad)], {"lr": 1e-3, ...})], 0, "float32", "adam")
//   rt.begin_step(); ...; adam.step(None, None); rt.end_step()
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bridge/grad_stats.h"
#include "bridge/scalar_reader.h"
#include "bridge/status.h"
#include "optim/adam.h"
#include "python/src/runtime_binding.h"

namespace strata::python {

inline optim::AdamHyper hyper_of(const py::dict& h) {
  optim::AdamHyper out;
  out.lr = h["lr"].cast<double>();
  out.beta1 = h["beta1"].cast<double>();
  out.beta2 = h["beta2"].cast<double>();
  out.eps = h["eps"].cast<double>();
  out.weight_decay = h["weight_decay"].cast<double>();
  out.decoupled = h["decoupled"].cast<bool>();
  out.amsgrad = h["amsgrad"].cast<bool>();
  out.maximize = h["maximize"].cast<bool>();
  return out;
}

// optim::Adam over bound parameters and gradients; keeps its runtime alive.
class Adam {
 public:
  // A gradient of None: given at each step (See Note [Gradients given at each step] in
  // optim/adam.h).
  using Group =
      std::pair<std::vector<std::pair<torch::Tensor, std::optional<torch::Tensor>>>, py::dict>;

  // `rule`: the step rule by name (optim::make_step_rule: "adam" or "lion").
  Adam(std::shared_ptr<Runtime> runtime, const std::vector<Group>& groups, int cpu_threads,
       const std::string& state_dtype, const std::string& rule)
      : runtime_(std::move(runtime)) {
    optim::AdamOptions o;
    if (cpu_threads > 0) o.cpu_threads = cpu_threads;
    o.state_dtype = bridge::unwrap(optim::parse_state_dtype(state_dtype));
    o.rule = bridge::unwrap(optim::make_step_rule(rule));
    for (const auto& [params, hyper] : groups) {
      optim::ParamGroup g;
      g.hyper = hyper_of(hyper);
      for (const auto& [p, grad] : params) {
        const rt::TensorHandle gh = grad ? runtime_->binding().handle(*grad) : rt::TensorHandle();
        o.gradients_given = o.gradients_given || !grad;
        g.params.push_back({runtime_->binding().handle(p), gh});
      }
      o.groups.push_back(std::move(g));
    }
    adam_ = bridge::unwrap(optim::Adam::create(runtime_->rt(), std::move(o)));
  }
  ~Adam() {
    if (stepping_in_backward_) runtime_->hooks().set_after_layer({});
  }

  // Each layer is stepped speculatively by the hooks' after_backward, once its gradients are final;
  // finish_step validates (See Note [Overlapped step] in optim/adam.h).
  void set_step_in_backward(bool on) {
    stepping_in_backward_ = on;
    if (!on) {
      runtime_->hooks().set_after_layer({});
      return;
    }
    runtime_->hooks().set_after_layer(
        [this](int layer) {
          bridge::check(adam_->step_layer(
              layer, speculative_scale_ ? speculative_scale_->data_ptr<float>() : nullptr));
        },
        bridge::ModelHooks::AfterLayerStream::kOwnStream);
  }

  // The loss scale a step taken in backward divides by (a float32 device scalar the caller keeps
  // unchanged until finish_step; None: 1). finish_step compares it with the true one.
  void set_speculative_scale(const std::optional<torch::Tensor>& scale) {
    if (scale && (scale->scalar_type() != torch::kFloat || scale->numel() != 1)) {
      bridge::check(absl::InvalidArgumentError("the speculative scale is one float32 value"));
    }
    speculative_scale_ = scale;
  }

  // See Note [Per-parameter steps] in optim/adam.h.
  void skip_parameters(const std::vector<torch::Tensor>& params) {
    std::vector<rt::TensorHandle> handles;
    for (const torch::Tensor& p : params) handles.push_back(runtime_->binding().handle(p));
    bridge::check(adam_->skip_parameters(handles));
  }
  void clear_skipped() { adam_->clear_skipped(); }
  // (bound parameter, its gradient as autograd made it); See Note [Gradients given at each step] in
  // optim/adam.h.
  void set_gradients(const std::vector<std::pair<torch::Tensor, torch::Tensor>>& grads) {
    for (const auto& [p, g] : grads) {
      if (!g.is_contiguous() || g.numel() != p.numel() || g.device() != p.device()) {
        bridge::check(absl::InvalidArgumentError(
            "a gradient given to the step must be contiguous, on its parameter's device, with "
            "as many elements"));
      }
      optim::ElemType type = optim::ElemType::kF32;
      if (g.scalar_type() == torch::kBFloat16) {
        type = optim::ElemType::kBF16;
      } else if (g.scalar_type() == torch::kHalf) {
        type = optim::ElemType::kF16;
      } else if (g.scalar_type() != torch::kFloat) {
        bridge::check(absl::InvalidArgumentError("a gradient is float32, bfloat16 or float16"));
      }
      bridge::check(adam_->set_gradient(runtime_->binding().handle(p), g.data_ptr(), type));
    }
  }
  std::int64_t step_count_of(const torch::Tensor& param) const {
    return bridge::unwrap(adam_->step_count_of(runtime_->binding().handle(param)));
  }
  void set_step_count_of(const torch::Tensor& param, std::int64_t steps) {
    bridge::check(adam_->set_step_count_of(runtime_->binding().handle(param), steps));
  }

  bool overlapped_step_open() const { return adam_->overlapped_step_open(); }
  // The layers the open (or last) step took in backward, and the share of its states it may
  // take there (See Note [A share of the step in backward] in optim/adam_overlap.cpp).
  std::vector<int> overlapped_layers() const { return adam_->overlapped_layers(); }
  void set_backward_share(double share) { bridge::check(adam_->set_backward_share(share)); }
  double backward_share() const { return adam_->backward_share(); }
  // (the bytes of states a step in backward moves over the link, those resting on the GPU that
  // its undo would copy off it): Adam::backward_bytes.
  std::pair<std::size_t, std::size_t> backward_bytes() const {
    const optim::Adam::BackwardBytes b = adam_->backward_bytes();
    return {b.link_states, b.resting};
  }

  void cancel_step() {
    py::gil_scoped_release release;
    bridge::check(adam_->cancel_step());
  }
  void drop_committed_step() {
    py::gil_scoped_release release;
    bridge::check(adam_->drop_committed_step());
  }

  // The step step_layer began (or a whole step): "sequential", "speculation" (it held) or
  // "redone" (clipping triggered or inf was found).
  std::string finish_step(const std::optional<torch::Tensor>& grad_scale,
                          const std::optional<torch::Tensor>& found_inf) {
    const float* scale = grad_scale ? grad_scale->data_ptr<float>() : nullptr;
    const float* inf = found_inf ? found_inf->data_ptr<float>() : nullptr;
    py::gil_scoped_release release;
    switch (bridge::unwrap(adam_->finish_step(scale, inf))) {
      case optim::Adam::StepOutcome::kSequential:
        return "sequential";
      case optim::Adam::StepOutcome::kSpeculation:
        return "speculation";
      case optim::Adam::StepOutcome::kRedone:
        return "redone";
    }
    return "sequential";
  }

  void step(const std::optional<torch::Tensor>& grad_scale,
            const std::optional<torch::Tensor>& found_inf) {
    const float* scale = grad_scale ? grad_scale->data_ptr<float>() : nullptr;
    const float* inf = found_inf ? found_inf->data_ptr<float>() : nullptr;
    py::gil_scoped_release release;
    bridge::check(adam_->step(scale, inf));
  }

  void set_hyper(std::size_t group, const py::dict& hyper) {
    bridge::check(adam_->set_hyper(group, hyper_of(hyper)));
  }
  std::int64_t step_count(std::size_t group) const { return adam_->step_count(group); }
  void set_step_count(std::size_t group, std::int64_t steps) {
    bridge::check(adam_->set_step_count(group, steps));
  }

  // The parameter's states as CPU float32 tensors, by the names Adam declared them under
  // ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"), read from whichever tier holds
  // them.
  // A parameter's states as float32 tensors shaped like it, compressed moments decoded (See Note
  // [Compressed moments] in optim/state_codec.h).
  py::dict read_state(const torch::Tensor& param) {
    std::vector<std::pair<std::string, std::vector<float>>> values;
    {
      py::gil_scoped_release release;
      values = bridge::unwrap(adam_->read_state_values(runtime_->binding().handle(param)));
    }
    py::dict out;
    for (auto& [name, v] : values) {
      torch::Tensor host = torch::empty(param.sizes(), torch::kFloat);
      std::memcpy(host.data_ptr(), v.data(), v.size() * sizeof(float));
      out[py::str(name)] = host;
    }
    return out;
  }

  void write_state(const torch::Tensor& param, const py::dict& values) {
    std::vector<std::pair<std::string, std::vector<float>>> in;
    for (auto [key, value] : values) {
      torch::Tensor t = value.cast<torch::Tensor>().to(torch::kFloat).contiguous().cpu();
      std::vector<float> v(static_cast<std::size_t>(t.numel()));
      std::memcpy(v.data(), t.data_ptr(), v.size() * sizeof(float));
      in.emplace_back(key.cast<std::string>(), std::move(v));
    }
    const rt::TensorHandle h = runtime_->binding().handle(param);
    // A master_param given for a parameter without a master is not an error (torch's state dicts
    // of float32 parameters never have one); any other state it does not have is.
    std::vector<std::string> have;
    for (rt::TensorHandle s : bridge::unwrap(adam_->state(h))) {
      have.push_back(bridge::unwrap(runtime_->rt().info(s)).spec.state);
    }
    std::erase_if(in, [&](const auto& kv) {
      return kv.first == "master_param" &&
             std::find(have.begin(), have.end(), kv.first) == have.end();
    });
    py::gil_scoped_release release;
    bridge::check(adam_->write_state_values(h, in));
  }

  std::size_t num_groups() const { return adam_->num_groups(); }
  // See Note [Step placement] in runtime/policy.h: the policy's line, empty when it places none.
  std::string placement() const { return adam_->placement(); }
  std::vector<int> host_layers() const { return adam_->host_layers(); }
  int host_threads() const { return adam_->host_threads(); }
  // The rates measured for the placement, as strata_step_rates names them; None without one.
  py::object step_rates() const {
    const std::optional<rt::StepRates>& r = adam_->step_rates();
    if (!r) return py::none();
    py::dict d;
    d["link_h2d_gbps"] = r->link_h2d_gbps;
    d["link_d2h_gbps"] = r->link_d2h_gbps;
    d["link_both_gbps"] = r->link_both_gbps;
    d["host_params_per_s"] = r->host_params_per_s;
    d["link_h2d_loaded_gbps"] = r->link_h2d_loaded_gbps;
    d["link_d2h_loaded_gbps"] = r->link_d2h_loaded_gbps;
    d["host_params_per_s_alone"] = r->host_params_per_s_alone;
    d["host_memory_gbps"] = r->host_memory_gbps;
    d["gpu_params_per_s"] = r->gpu_params_per_s;
    d["host_threads"] = r->host_threads;
    return d;
  }

 private:
  std::shared_ptr<Runtime> runtime_;
  std::unique_ptr<optim::Adam> adam_;
  bool stepping_in_backward_ = false;
  std::optional<torch::Tensor> speculative_scale_;
};

}  // namespace strata::python
