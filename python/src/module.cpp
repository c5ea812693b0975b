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
//   rt = _strata.Runtime(policy="layer_prefetch", gpu_budget=None, prefetch_depth=1,
//                        roles="optimizer_states", device="auto", pinned_budget=None,
//                        overlap="none", undo_on_gpu=False, hybrid_fraction=None)
//   rt.register(p, "w", 0, "parameter", None); rt.register(p.grad, "w.grad", 0, "gradient", None)
//   adam = _strata.Adam(rt, [([(p, p.grad)], {"lr": 1e-3, ...})], 0, "float32", "adam")
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
#include "allocator/upstream.h"
#include "base/units.h"
#include "bridge/fingerprints.h"
#include "bridge/grad_stats.h"
#include "bridge/model_hooks.h"
#include "bridge/scalar_reader.h"
#include "bridge/status.h"
#include "bridge/torch_runtime.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "python/src/adam_binding.h"
#include "python/src/runtime_binding.h"
#include "runtime/runtime.h"
#include "runtime/setup.h"

namespace py = pybind11;

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

// One table of bindings, a .def a line, longer than a screen on purpose: what Python sees of the
// engine reads in one place.
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

  // See Note [Gradient fingerprints] in optim/fingerprint.h.
  m.def("fingerprints", &strata::bridge::fingerprints, py::arg("tensors"));

  // Bytes from a size such as "8GiB" or "1.5GB", as strata-train's flags read them (one parser for
  // both); a size it cannot read raises ValueError.
  m.def(
      "parse_bytes",
      [](const std::string& text) {
        return static_cast<std::uint64_t>(strata::bridge::unwrap(strata::parse_bytes(text)));
      },
      py::arg("text"));

  // CUDA devices strata sees: 0 when it was built without CUDA, whatever torch sees.
  m.def("cuda_device_count", [] { return strata::alloc::cuda_device_count(); });

  // The policy a runtime made with `policy` would run, and where the name came from ("argument",
  // "STRATA_POLICY", "default"): strata.optim chooses its overlap from it before it makes one.
  m.def(
      "choose_policy",
      [](const std::optional<std::string>& policy) {
        const strata::rt::PolicyChoice c = strata::rt::choose_policy_name(policy, "argument");
        return std::make_pair(c.name, c.source);
      },
      py::arg("policy"));

  py::class_<Runtime, std::shared_ptr<Runtime>>(m, "Runtime")
      .def(py::init<const std::optional<std::string>&, const std::optional<std::int64_t>&, int,
                    const std::string&, const std::string&, const std::optional<std::int64_t>&,
                    const std::string&, bool, const std::optional<double>&>(),
           py::kw_only(), py::arg("policy"), py::arg("gpu_budget"), py::arg("prefetch_depth"),
           py::arg("roles"), py::arg("device"), py::arg("pinned_budget"), py::arg("overlap"),
           py::arg("undo_on_gpu"), py::arg("hybrid_fraction"))
      .def("overlap",
           [](Runtime& r) {
             return std::string(strata::rt::overlap_name(r.rt().policy().config().overlap));
           })
      .def("policy", [](Runtime& r) { return std::string(r.rt().policy().name()); })
      .def("simulated", [](Runtime& r) { return r.rt().device().is_simulated(); })
      .def("cuda_device", [](Runtime& r) { return r.rt().cuda_device(); })
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
      // See Note [Measured split] in policies/split_search.h: the policy's search runs.
      .def("wants_step_times", [](Runtime& r) { return r.rt().wants_step_times(); })
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
      // Where the undo of a tensor resting on the GPU goes (Runtime::set_undo_on_gpu: between
      // steps, with nothing kept).
      .def("undo_on_gpu", [](Runtime& r) { return r.rt().undo_on_gpu(); })
      .def("set_undo_on_gpu",
           [](Runtime& r, bool on) { strata::bridge::check(r.rt().set_undo_on_gpu(on)); })
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
                    const std::string&, const std::string&>())
      .def("step", &Adam::step)
      .def("placement", &Adam::placement)
      .def("host_layers", &Adam::host_layers)
      .def("host_threads", &Adam::host_threads)
      .def("step_rates", &Adam::step_rates)
      .def("set_step_in_backward", &Adam::set_step_in_backward)
      .def("finish_step", &Adam::finish_step)
      .def("cancel_step", &Adam::cancel_step)
      .def("drop_committed_step", &Adam::drop_committed_step)
      .def("overlapped_step_open", &Adam::overlapped_step_open)
      .def("overlapped_layers", &Adam::overlapped_layers)
      .def("set_backward_share", &Adam::set_backward_share)
      .def("backward_share", &Adam::backward_share)
      .def("backward_bytes", &Adam::backward_bytes)
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
