// bridge/binding_state.h (internal to bridge/): what a TorchBinding keeps of the tensors it bound,
// shared by torch_runtime.cpp (registering, moving, unregistering) and gradients.cpp (a module's
// gradients and the check before each optimizer step).
//
// Example (inside the binding):
//   const std::lock_guard<std::mutex> lock(state_->mu);
//   auto it = state_->by_storage.find(internal::storage_key(t));
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "bridge/torch_runtime.h"
#include "c10/core/Storage.h"
#include "c10/core/StorageImpl.h"

namespace strata::bridge {
namespace internal {

// The storage a tensor uses (the key of everything bound), or null for one without.
const c10::StorageImpl* storage_key(const at::Tensor& t);
// Every parameter of m with its default layer (see register_module), in named_parameters() order
// within each layer; aliases are kept (they carry the names).
std::vector<std::pair<std::string, std::pair<torch::Tensor, int>>> default_layers(
    const torch::nn::Module& m);

}  // namespace internal

struct TorchBinding::State {
  struct Bound {
    // Holding the storage keeps it (and so the key below) alive even when the user drops every
    // tensor that uses it: the runtime still holds the data and may still report moves.
    c10::Storage storage;
    c10::Device device;
    std::string name;
    int layer = 0;
    bool was_resizable = false;
    bool accessible = false;
    // Moves reported since the binding learned the handle; see register_one.
    std::uint64_t moves = 0;
  };

  // A parameter whose gradient register_gradients bound (See Note [Gradients the model replaced] in
  // gradients.cpp).
  struct Gradient {
    std::string parameter;  // its name
    torch::Tensor param;    // the module's parameter; its .grad() is read before each step
    const c10::StorageImpl* param_storage = nullptr;  // the storage bound for it
    torch::Tensor bound;  // the gradient strata holds (an alias of its bound storage)
    rt::TensorHandle handle;
  };

  // Points b's storage at the runtime's copy, or at nothing where b's device cannot address it.
  void point_at(Bound& b, rt::Tier tier, void* data, bool gpu_is_simulated);

  // Never held across a call into the runtime: the runtime calls on_moved with its own lock held,
  // so holding this one while waiting for the runtime's would deadlock.
  mutable std::mutex mu;
  absl::flat_hash_map<rt::TensorHandle, Bound> bound;
  // Keyed by storage, not by tensor: every alias of a registered tensor (views, .detach(), a
  // module's parameter and the tensor the user holds) shares it.
  absl::flat_hash_map<const c10::StorageImpl*, rt::TensorHandle> by_storage;
  std::vector<Gradient> gradients;
};

struct TorchBinding::Planned {
  torch::Tensor tensor;
  std::string name;
  int layer = 0;
  rt::Role role = rt::Role::kOther;
  std::optional<rt::Tier> home;
};

}  // namespace strata::bridge
