// bridge/gradients.cpp: a module's gradients bound to the runtime, and the check before each
// optimizer step that they, and their parameters, are still the tensors strata holds.
//
// Note [Gradients the model replaced]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// strata's optimizer steps the gradients and parameters it holds, so a model that stops using them
// would silently stop learning. Before every optimizer step (Runtime::add_before_optimizer_step)
// the binding looks at each parameter whose gradient it bound:
//   - the parameter's gradient is a new tensor: zero_grad(set_to_none=true) dropped the bound one
//     (LibTorch's default) and backward made another. Its values go into the gradient strata holds,
//     which becomes the parameter's gradient again, so the next backward accumulates into it:
//     training stays correct, at the cost of one copy that step;
//   - the parameter has no gradient at all (cleared, and backward gave it none): strata steps every
//     parameter it holds, where torch would skip this one, so the step fails naming it;
//   - the parameter no longer uses the storage bound for it (set_data, module->to()): the model
//     computes with a copy strata never steps, so the step fails naming it.
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "base/status.h"
#include "bridge/binding_state.h"
#include "bridge/status.h"

namespace strata::bridge {

using internal::storage_key;

std::vector<rt::TensorHandle> TorchBinding::register_gradients(torch::nn::Module& m,
                                                               std::optional<rt::Tier> home) {
  std::vector<Planned> plan;
  std::vector<std::pair<std::string, torch::Tensor>> params;  // by plan entry
  absl::flat_hash_set<const c10::StorageImpl*> seen;
  for (auto& [name, tensor_layer] : internal::default_layers(m)) {
    const torch::Tensor& param = tensor_layer.first;
    const torch::Tensor& grad = param.grad();
    if (!grad.defined()) {
      check(absl::FailedPreconditionError(
          str_cat("register_gradients: parameter '", name,
                  "' has no gradient; run a backward pass (or set its .grad()) first")));
    }
    int layer = tensor_layer.second;
    {
      const std::lock_guard<std::mutex> lock(state_->mu);
      if (auto it = state_->by_storage.find(storage_key(param)); it != state_->by_storage.end()) {
        layer = state_->bound.at(it->second).layer;
      }
    }
    const c10::StorageImpl* key = storage_key(grad);
    if (key != nullptr && !seen.insert(key).second) continue;
    plan.push_back({grad, str_cat(name, ".grad"), layer, rt::Role::kGradient, home});
    params.emplace_back(name, param);
  }
  std::vector<rt::TensorHandle> handles = register_all(plan);
  const std::lock_guard<std::mutex> lock(state_->mu);
  for (std::size_t i = 0; i < handles.size(); ++i) {
    state_->gradients.push_back({.parameter = params[i].first,
                                 .param = params[i].second,
                                 .param_storage = storage_key(params[i].second),
                                 .bound = plan[i].tensor,
                                 .handle = handles[i]});
  }
  return handles;
}

absl::Status TorchBinding::check_gradients() noexcept {
  const std::lock_guard<std::mutex> lock(state_->mu);
  for (State::Gradient& g : state_->gradients) {
    if (storage_key(g.param) != g.param_storage) {
      return absl::FailedPreconditionError(str_cat(
          "parameter '", g.parameter,
          "' no longer uses the memory strata holds for it (set_data or module->to() gave it new "
          "storage), so the model computes with a copy the optimizer never steps; register the "
          "module with strata again"));
    }
    const at::Tensor& grad = g.param.grad();
    if (grad.defined() && storage_key(grad) == storage_key(g.bound)) continue;
    if (!grad.defined()) {
      return absl::FailedPreconditionError(str_cat(
          "parameter '", g.parameter,
          "' has no gradient: zero_grad(set_to_none=true) dropped the one strata holds and "
          "backward gave it none; strata steps every parameter it holds (torch would skip this "
          "one), so zero gradients in place (zero_grad(false)) or leave the parameter out of the "
          "optimizer"));
    }
    const auto bound = state_->bound.find(g.handle);
    if (bound == state_->bound.end() || !bound->second.accessible) {
      return absl::FailedPreconditionError(str_cat(
          "parameter '", g.parameter,
          "' has a new gradient (zero_grad(set_to_none=true) dropped the one strata holds), and "
          "the one strata holds is where this device cannot write it now; zero gradients in "
          "place (zero_grad(false))"));
    }
    STRATA_RETURN_IF_ERROR(capture_exceptions([&] {
      g.bound.copy_(grad);
      g.param.mutable_grad() = g.bound;
    }));
  }
  return absl::OkStatus();
}

void TorchBinding::forget_gradient(const c10::StorageImpl* storage) {
  std::erase_if(state_->gradients, [&](const State::Gradient& g) {
    return g.param_storage == storage || storage_key(g.bound) == storage;
  });
}

}  // namespace strata::bridge
