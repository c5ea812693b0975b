// bridge/torch_runtime.h: LibTorch tensors and modules whose storage the strata runtime owns.
//
// A TorchBinding registers torch::Tensor objects with a Runtime: one at a time, or every parameter
// (or gradient) of a torch::nn::Module, grouped into layers. The runtime copies the values into
// memory it owns and the tensor's storage is pointed at that memory, so torch ops read and write
// the runtime's copy. When the runtime moves the data (a policy at a hook, a phase switch), the
// binding points the storage at the new address: the user's tensor objects, and every view or
// alias sharing their storage (a module's parameter, its .detach(), its .data), stay valid.
//
// Note [Where a bound tensor's data pointer points]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// LibTorch cannot change a tensor's device (set_ refuses another device and the dispatch keys are
// fixed at creation), so a bound tensor keeps its device and its data pointer follows the runtime's
// authoritative copy whenever that copy is addressable from the tensor's device:
//   - a CUDA tensor: the GPU tier, and pinned host memory (device-accessible through unified
//     addressing, at the same address as on the host);
//   - a CPU tensor: pinned and pageable host memory, and the GPU tier when the runtime's GPU is
//     simulated (then it is host memory too).
// Elsewhere the data pointer is null and is_accessible() is false until the data comes back. Check
// is_accessible() before using a tensor that may be away: LibTorch has no reversible "data not
// here" state, so a torch op on it dereferences the null pointer (a crash, or on CUDA an illegal
// address, rather than stale data); typed accessors (data_ptr<float>()) throw. During a migration
// the tensor keeps reading the source (the runtime frees it only once the copy completed); the
// pointer changes inside the runtime call that completes the migration (poll, wait_all,
// offload_all, reload_all, the hooks), on the calling thread. So:
//   - do not run torch ops on bound tensors concurrently with those calls;
//   - let torch's queued work on bound CUDA tensors finish before the runtime moves them (e.g.
//     torch::cuda::synchronize() before offload_all): the runtime's copy streams do not wait for
//     torch's streams unless told through acquire()/release() with current_stream();
//   - staging (layer_prefetch's stage_layer / unstage_layer) reports the new address while the
//     copy may still be arriving, chained on the GPU: use staged tensors only between acquire()
//     and release() on current_stream();
//   - unregister through the binding, never through the runtime directly, and keep the runtime
//     alive longer than the binding.
//
// A registered tensor must be contiguous and own its whole storage (no view into a larger buffer),
// since the whole storage is handed to the runtime. Its storage is made non-resizable while bound:
// a resize would silently move the tensor off the runtime's memory.
//
// Example (a model whose parameters and gradients the bulk policy moves at phase switches):
//   strata::rt::RuntimeOptions options;
//   options.policy = "bulk";
//   options.policy_config.roles = strata::rt::RoleSet::all();
//   auto runtime = bridge::unwrap(rt::Runtime::create(std::move(options),
//                                                     policy::builtin_policies()));
//   bridge::TorchBinding binding(*runtime);
//   torch::nn::Sequential model(torch::nn::Linear(1024, 1024), torch::nn::ReLU(),
//                               torch::nn::Linear(1024, 10));
//   model->to(torch::kCUDA);
//   binding.register_module(*model);           // layers 0 and 2; "0.weight", "0.bias", ...
//   ...train a step, then binding.register_gradients(*model) once the gradients exist...
//   torch::cuda::synchronize();
//   bridge::check(runtime->offload_all());     // parameters now in pinned host memory
//   bridge::check(runtime->reload_all());      // back on the GPU; `model` works as before
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ATen/core/Tensor.h"
#include "absl/status/statusor.h"
#include "c10/core/Device.h"
#include "c10/core/ScalarType.h"
#include "runtime/runtime.h"
#include "runtime/tensor.h"
#include "torch/nn/module.h"

namespace strata::bridge {

// The runtime's dtype for a torch dtype: float32, float16, bfloat16, float64, int64, int32 and
// uint8; anything else is kInvalidArgument naming it and the supported ones.
absl::StatusOr<rt::DType> dtype_from_torch(c10::ScalarType type);
c10::ScalarType dtype_to_torch(rt::DType dtype);

// Whether a tensor on `device` can address memory of `tier`
// (See Note [Where a bound tensor's data pointer points]).
bool is_addressable(c10::Device device, rt::Tier tier, bool gpu_is_simulated);

// torch's current stream on a CUDA `device` as a runtime StreamHandle (a cudaStream_t), so that a
// CUDA runtime's acquire()/release() can order its copies with torch's work; nullptr (the legacy
// default stream) for any other device. Meaningless to a simulated runtime.
rt::StreamHandle current_stream(c10::Device device);

// One per Runtime is enough: it adds its own on_moved callback to the runtime (which keeps
// several), and removes it when destroyed. Thread-safe; see the Note for what may not run
// concurrently with the runtime. Every error is thrown as a c10::Error carrying the runtime's
// message (bridge/status.h).
class TorchBinding {
 public:
  explicit TorchBinding(rt::Runtime& runtime);
  // Removes the callback and detaches every tensor still bound: the data stays registered with
  // the runtime, but without the callback the tensor could no longer follow it, so any later use
  // of the tensor throws a c10::Error saying so.
  ~TorchBinding();
  TorchBinding(const TorchBinding&) = delete;
  TorchBinding& operator=(const TorchBinding&) = delete;

  // Hands t's values to the runtime (placed by the policy) and points t's storage at the runtime's
  // copy. `home` defaults to kGpu for a CUDA tensor and kPinnedHost for a CPU tensor. Throws for
  // an undefined, non-strided, non-contiguous or view tensor, an unsupported dtype or device, a
  // CUDA tensor on a runtime whose GPU is simulated, a tensor (or an alias of one) already bound,
  // and whatever the runtime refuses (a name taken, no room). A CUDA tensor must be on the
  // runtime's CUDA device. Waits for torch's current stream on t's device before the copy.
  rt::TensorHandle register_tensor(torch::Tensor& t, const std::string& name, int layer,
                                   rt::Role role, std::optional<rt::Tier> home = {});

  // Registers m's parameters (role kParameter) by layer and returns their handles in registration
  // order. By default layer i is m's i-th top-level child (named_children() order), whose
  // parameters are registered as "<child>.<param>", the names m.named_parameters() uses; a child
  // with no parameters (an activation) leaves its layer empty; parameters held by m itself go to
  // the layer after the last child. With `grouping`, layer i is the parameters named (in full) in
  // grouping[i]; a parameter named in no group is left to torch, and an unknown or repeated name
  // throws before anything is registered. A parameter shared by two children (tied weights) is
  // registered once, where it first appears. All or nothing: if one registration fails, those
  // made by this call are undone (values back in torch memory) before the error is thrown.
  // `home` as in register_tensor, for every parameter (e.g. kGpu for CPU tensors on a runtime
  // whose GPU is simulated, so they live in its GPU tier).
  std::vector<rt::TensorHandle> register_module(
      torch::nn::Module& m, std::optional<std::vector<std::vector<std::string>>> grouping = {},
      std::optional<rt::Tier> home = {});

  // Registers each parameter's gradient (role kGradient) as "<param>.grad", in the parameter's
  // layer: the one it is registered under with this binding, else the default layer of
  // register_module. Every gradient must be defined (kFailedPrecondition otherwise, before
  // anything is registered). All or nothing, like register_module. Autograd then accumulates into
  // the bound gradients in place. Zero them in place (zero_grad(false)): with
  // zero_grad(/*set_to_none=*/true), LibTorch's default, backward makes new gradients, which the
  // binding copies into the bound ones before each optimizer step
  // (See Note [Gradients the model replaced] in gradients.cpp); a parameter left with no gradient,
  // or given new storage (set_data, module->to()), fails the step with an error naming it. `home`
  // as in register_module.
  std::vector<rt::TensorHandle> register_gradients(torch::nn::Module& m,
                                                   std::optional<rt::Tier> home = {});

  // Unregisters t (or the tensor whose storage t shares) and frees the runtime's copy. t keeps its
  // device and shape but no data: any later use (a torch op, data_ptr(), registering it again)
  // throws a c10::Error naming the tensor, instead of reading freed memory.
  void unregister(torch::Tensor& t);
  // Like unregister, but first copies the runtime's current values back into memory torch owns on
  // t's device, so t works as an ordinary tensor again. Waits on the host.
  void unregister_keeping_values(torch::Tensor& t);

  // The handle t (or any alias of its storage) is registered under; kNotFound if none.
  rt::TensorHandle handle(const torch::Tensor& t) const;
  // The same without throwing: nullopt for a tensor not bound here (or undefined).
  std::optional<rt::TensorHandle> find(const torch::Tensor& t) const;
  // Whether t's data pointer currently addresses the runtime's copy
  // (See Note [Where a bound tensor's data pointer points]); false for a tensor not bound by this
  // binding.
  bool is_accessible(const torch::Tensor& t) const;
  // Throws a c10::Error naming the tensor, the tier its data is in and how to bring it back when
  // t is bound and not accessible: what a torch op on it would otherwise do with a null pointer.
  void check_accessible(const torch::Tensor& t) const;
  // Tensors bound now.
  std::size_t size() const;

  rt::Runtime& runtime() { return runtime_; }

 private:
  struct State;

  absl::StatusOr<rt::TensorHandle> register_one(const torch::Tensor& t, const std::string& name,
                                                int layer, rt::Role role,
                                                std::optional<rt::Tier> home);
  // Registers planned tensors in order; undoes them all if one fails, then throws.
  struct Planned;
  std::vector<rt::TensorHandle> register_all(const std::vector<Planned>& plan);
  absl::Status unregister_one(const torch::Tensor& t, bool keep_values);
  absl::Status unregister_handle(rt::TensorHandle h, bool keep_values);
  int callback_id_ = 0;
  void on_moved(rt::TensorHandle h, rt::Tier tier, void* data) noexcept;
  // Before every optimizer step (gradients.cpp): the bound gradients and parameters are still the
  // model's, or the step fails naming the one that is not.
  int before_step_id_ = 0;
  absl::Status check_gradients() noexcept;
  // Drops what register_gradients kept of a parameter or gradient being unregistered (lock held).
  void forget_gradient(const c10::StorageImpl* storage);

  rt::Runtime& runtime_;
  const bool gpu_is_simulated_;
  std::unique_ptr<State> state_;
};

}  // namespace strata::bridge
