// python/src/module.cpp: strata._strata, the C++ half of the Python package (python/strata/): a
// runtime with its torch binding (bridge::TorchBinding), the model hooks of bridge::ModelHooks, and
// optim::Adam over bound tensors. The Python layer (strata.Runtime, strata.attach,
// strata.optim.AdamW) is the public API; this module is its engine and not meant to be used alone.
//
// Errors: every runtime error arrives as a c10 error from bridge::check and leaves as the Python
// exception its status code names: ValueError (kInvalidArgument), torch.OutOfMemoryError
// (kResourceExhausted), NotImplementedError (kUnimplemented), RuntimeError otherwise, with the
// runtime's message. Calls that wait on copies or run the optimizer release the GIL.
//
// Example (what strata/optim.py does):
//   rt = _strata.Runtime("layer_prefetch", None, 1, "optimizer_states", "auto", None, "none",
//                        False)
//   rt.register(p, "w", 0, "parameter", None); rt.register(p.grad, "w.grad", 0, "gradient", None)
//   adam = _strata.Adam(rt, [([(p, p.grad)], {"lr": 1e-3, ...})], 0)
//   rt.begin_step(); ...; adam.step(None, None); rt.end_step()
#include <torch/extension.h>

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "allocator/tier.h"
#include "bridge/grad_stats.h"
#include "bridge/model_hooks.h"
#include "bridge/scalar_reader.h"
#include "bridge/status.h"
#include "bridge/torch_runtime.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

namespace py = pybind11;

namespace strata::python {
namespace {

rt::Role role_of(const std::string& name) { return bridge::unwrap(rt::parse_role(name)); }

std::optional<rt::Tier> tier_of(const std::optional<std::string>& name) {
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
    rt::RuntimeOptions o;
    // A Python program's command line is not strata's, so no --strata_policy flag here: the
    // policy given, else STRATA_POLICY, else the default.
    if (policy) {
      o.policy = *policy;
    } else if (const char* env = std::getenv("STRATA_POLICY")) {
      o.policy = std::string(env);
    } else {
      o.policy = std::string(rt::kDefaultPolicy);
    }
    o.policy_config.prefetch_depth = prefetch_depth;
    o.policy_config.roles = bridge::unwrap(rt::RoleSet::parse(roles));
    o.policy_config.offload_after_step = true;
    o.policy_config.overlap = bridge::unwrap(rt::parse_overlap(overlap));
    o.policy_config.undo_on_gpu = undo_on_gpu;
    o.policy_config.hybrid_fraction = hybrid_fraction;
    if (device == "cuda") {
      o.device = rt::DeviceKind::kCuda;
    } else if (device == "simulated") {
      o.device = rt::DeviceKind::kSimulated;
    } else if (device != "auto") {
      bridge::check(absl::InvalidArgumentError(
          str_cat("unknown device '", device, "'; use 'auto', 'cuda' or 'simulated'")));
    }
    o.allocator.track_allocations = true;
    if (gpu_budget) {
      o.allocator.budgets[alloc::tier_index(rt::Tier::kGpu)] =
          static_cast<std::size_t>(*gpu_budget);
    }
    if (pinned_budget) {
      o.allocator.budgets[alloc::tier_index(rt::Tier::kPinnedHost)] =
          static_cast<std::size_t>(*pinned_budget);
    }
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
    const rt::RuntimeStats s = runtime_->stats();
    py::dict d;
    d["migrated_bytes_h2d"] = s.migrated_bytes_h2d;
    d["migrated_bytes_d2h"] = s.migrated_bytes_d2h;
    d["migrated_bytes_h2h"] = s.migrated_bytes_h2h;
    d["num_migrations"] = s.num_migrations;
    d["failed_migrations"] = s.failed_migrations;
    d["h2d_gbps"] = s.h2d_gbps();
    d["d2h_gbps"] = s.d2h_gbps();
    d["prefetch_hits"] = s.prefetch_hits;
    d["prefetch_waits"] = s.prefetch_waits;
    d["prefetch_stall_ms"] = s.prefetch_stall_ns / 1e6;
    d["host_syncs"] = s.host_syncs;
    d["staging_bytes"] = s.staging_bytes;
    d["staged_peak_bytes"] = s.staged_peak_bytes;
    d["gpu_reserved_bytes"] = s.gpu_reserved_bytes;
    d["gpu_reserved_peak_bytes"] = s.gpu_reserved_peak_bytes;
    d["gpu_upstream_alloc_ms"] = s.gpu_upstream_alloc_ns / 1e6;
    d["gpu_upstream_free_ms"] = s.gpu_upstream_free_ns / 1e6;
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

optim::AdamHyper hyper_of(const py::dict& h) {
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

  Adam(std::shared_ptr<Runtime> runtime, const std::vector<Group>& groups, int cpu_threads,
       const std::string& state_dtype)
      : runtime_(std::move(runtime)) {
    optim::AdamOptions o;
    if (cpu_threads > 0) o.cpu_threads = cpu_threads;
    o.state_dtype = bridge::unwrap(optim::parse_state_dtype(state_dtype));
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

  void cancel_step() {
    py::gil_scoped_release release;
    bridge::check(adam_->cancel_step());
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
    // Only the states this parameter has: a master_param given for one without a master is not
    // an error (torch's state dicts of float32 parameters never have one).
    std::vector<std::string> have;
    for (rt::TensorHandle s : bridge::unwrap(adam_->state(h))) {
      have.push_back(bridge::unwrap(runtime_->rt().info(s)).spec.state);
    }
    std::erase_if(in, [&](const auto& kv) {
      return std::find(have.begin(), have.end(), kv.first) == have.end();
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

}  // namespace
}  // namespace strata::python

namespace {

// STRATA_SEGV_BACKTRACE=1: a crash inside the extension prints its native frames (Python's
// faulthandler shows only Python's), for machines without a debugger.
void print_native_backtrace(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

PYBIND11_MODULE(_strata, m) {
  if (std::getenv("STRATA_SEGV_BACKTRACE") != nullptr) signal(SIGSEGV, print_native_backtrace);
  using strata::python::Adam;
  using strata::python::Runtime;
  m.doc() = "strata's C++ runtime, binding and optimizer; use the strata package instead";

  static py::object oom = py::module_::import("torch").attr("OutOfMemoryError");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::OutOfMemoryError& e) {
      PyErr_SetString(oom.ptr(), e.what_without_backtrace());
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  // One reader for the process, so its pinned buffer is reused, never destroyed (its pinned memory
  // would be freed after CUDA's teardown at exit); the mutex lets the call wait for the stream with
  // the GIL released.
  m.def(
      "read_scalars",
      [](const std::vector<std::optional<at::Tensor>>& given) {
        std::vector<at::Tensor> scalars;  // None: an undefined tensor, which reads NaN
        for (const auto& t : given) scalars.push_back(t.value_or(at::Tensor()));
        static std::mutex mu;
        static auto* reader = new strata::bridge::ScalarReader;
        const std::lock_guard<std::mutex> lock(mu);
        return reader->read(scalars);
      },
      py::arg("scalars"), py::call_guard<py::gil_scoped_release>());

  py::class_<Runtime, std::shared_ptr<Runtime>>(m, "Runtime")
      .def(py::init<const std::optional<std::string>&, const std::optional<std::int64_t>&, int,
                    const std::string&, const std::string&, const std::optional<std::int64_t>&,
                    const std::string&, bool, const std::optional<double>&>())
      .def("overlap",
           [](Runtime& r) {
             return std::string(strata::rt::overlap_name(r.rt().policy().config().overlap));
           })
      .def("policy", [](Runtime& r) { return std::string(r.rt().policy().name()); })
      .def("simulated", [](Runtime& r) { return r.rt().device().is_simulated(); })
      .def("register",
           [](Runtime& r, torch::Tensor& t, const std::string& name, int layer,
              const std::string& role, const std::optional<std::string>& home) {
             r.binding().register_tensor(t, name, layer, strata::python::role_of(role),
                                         strata::python::tier_of(home));
           })
      .def("unregister",
           [](Runtime& r, torch::Tensor& t, bool keep_values) {
             if (keep_values) {
               r.binding().unregister_keeping_values(t);
             } else {
               r.binding().unregister(t);
             }
           })
      .def("is_bound",
           [](Runtime& r, const torch::Tensor& t) { return r.binding().find(t).has_value(); })
      .def("is_accessible",
           [](Runtime& r, const torch::Tensor& t) { return r.binding().is_accessible(t); })
      .def("zero", &Runtime::zero)
      .def("begin_step", [](Runtime& r) { r.hooks().begin_step(); })
      .def("before_forward", [](Runtime& r, int layer) { r.hooks().before_forward(layer); })
      .def("before_backward",
           [](Runtime& r, int layer) {
             py::gil_scoped_release release;
             r.hooks().before_backward(layer);
           })
      .def("after_backward", &Runtime::after_backward, py::arg("layer"), py::arg("stream") = 0)
      .def("finish_backward",
           [](Runtime& r) {
             py::gil_scoped_release release;
             r.hooks().finish_backward();
           })
      .def("join_step_stream",
           [](Runtime& r) {
             py::gil_scoped_release release;
             r.hooks().join_after_layer_stream();
           })
      .def("in_step", [](Runtime& r) { return r.hooks().in_step(); })
      .def("end_step",
           [](Runtime& r) {
             py::gil_scoped_release release;
             r.hooks().end_step();
           })
      .def("set_layers",
           [](Runtime& r, const std::vector<std::vector<torch::Tensor>>& params,
              const std::vector<std::vector<torch::Tensor>>& grads) {
             r.hooks().set_layer_parameters(params, r.binding());
             r.hooks().set_layer_gradients(grads);
           })
      .def("check_accessible",
           [](Runtime& r, const torch::Tensor& t) { r.binding().check_accessible(t); })
      .def("total_norm", [](Runtime& r) { return r.hooks().stats().total_norm(); })
      .def("wait_all",
           [](Runtime& r) {
             py::gil_scoped_release release;
             strata::bridge::check(r.rt().wait_all());
           })
      .def("offload_all",
           [](Runtime& r, const std::optional<std::string>& roles, bool keep_cached) {
             strata::rt::OffloadOptions o;
             if (roles) o.roles = strata::bridge::unwrap(strata::rt::RoleSet::parse(*roles));
             o.keep_cached = keep_cached;
             py::gil_scoped_release release;
             strata::bridge::check(r.rt().offload_all(o));
           })
      .def("reload_all",
           [](Runtime& r) {
             py::gil_scoped_release release;
             strata::bridge::check(r.rt().reload_all());
           })
      .def("offloaded", [](Runtime& r) { return r.rt().offloaded(); })
      .def("stats", &Runtime::stats)
      // The GPU budget in bytes, None for none; set between steps (Runtime::set_gpu_budget).
      .def("gpu_budget",
           [](Runtime& r) -> std::optional<std::int64_t> {
             const std::size_t b = r.rt().gpu_budget();
             if (b == strata::alloc::kNoBudget) return std::nullopt;
             return static_cast<std::int64_t>(b);
           })
      .def("set_gpu_budget",
           [](Runtime& r, const std::optional<std::int64_t>& budget) {
             py::gil_scoped_release release;
             strata::bridge::check(r.rt().set_gpu_budget(budget ? static_cast<std::size_t>(*budget)
                                                                : strata::alloc::kNoBudget));
           })
      .def("memory_stats", &Runtime::memory_stats)
      .def("memory_summary", [](Runtime& r) { return r.rt().allocator().format_stats(); })
      // Every registered tensor: name, layer, role, bytes, the tier its data is in, whether it is
      // in a staging slot and whether a move is under way (memory_summary's table).
      .def("tensors",
           [](Runtime& r) {
             py::list out;
             for (strata::rt::TensorHandle h : r.rt().tensors()) {
               absl::StatusOr<strata::rt::TensorInfo> info = r.rt().info(h);
               if (!info.ok()) continue;
               py::dict d;
               d["name"] = info->spec.name;
               d["layer"] = info->spec.layer;
               d["role"] = std::string(strata::rt::role_name(info->spec.role));
               d["state"] = info->spec.state;
               d["bytes"] = info->bytes;
               d["tier"] = std::string(strata::alloc::tier_name(info->tier));
               d["staged"] = info->staged;
               d["in_flight"] = info->in_flight;
               out.append(d);
             }
             return out;
           })
      .def("leak_report", &Runtime::leak_report)
      .def("format_leak_report",
           [](Runtime& r) { return r.rt().allocator().format_leak_report(); });

  py::class_<Adam>(m, "Adam")
      .def(py::init<std::shared_ptr<Runtime>, const std::vector<Adam::Group>&, int,
                    const std::string&>())
      .def("step", &Adam::step)
      .def("placement", &Adam::placement)
      .def("host_layers", &Adam::host_layers)
      .def("host_threads", &Adam::host_threads)
      .def("step_rates", &Adam::step_rates)
      .def("set_step_in_backward", &Adam::set_step_in_backward)
      .def("finish_step", &Adam::finish_step)
      .def("cancel_step", &Adam::cancel_step)
      .def("overlapped_step_open", &Adam::overlapped_step_open)
      .def("set_hyper", &Adam::set_hyper)
      .def("step_count", &Adam::step_count)
      .def("set_step_count", &Adam::set_step_count)
      .def("step_count_of", &Adam::step_count_of)
      .def("set_step_count_of", &Adam::set_step_count_of)
      .def("skip_parameters", &Adam::skip_parameters)
      .def("clear_skipped", &Adam::clear_skipped)
      .def("set_gradients", &Adam::set_gradients)
      .def("set_speculative_scale", &Adam::set_speculative_scale)
      .def("read_state", &Adam::read_state)
      .def("write_state", &Adam::write_state)
      .def("num_groups", &Adam::num_groups);
}
