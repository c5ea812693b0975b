// optim/adam_slot.h: AdamSlot, what the optimizer (optim/adam.h) keeps for each of its parameters:
// the parameter's and gradient's handles, the states its rule declared (See Note [Declared states]
// in state_decl.h), its group, layer, element types and its own step count (See Note
// [Per-parameter steps] in adam.h). Adam holds one a parameter, by index; the host-stepped layers'
// buffers and the overlapped step's state are Adam's own. Internal to Adam: installed because
// adam.h includes it, not an interface of its own.
//
//   const AdamSlot& s = ...;   // one of Adam's
//   for (rt::TensorHandle h : s.kernel_tensors()) {...}   // parameter, gradient, then the states
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "optim/adam_math.h"
#include "optim/step_tensor.h"
#include "runtime/tensor.h"

namespace strata::optim {

struct AdamSlot {
  rt::TensorHandle param, grad;
  // The declared states (the rule's states()), in declaration order, which is checkpoint order;
  // invalid past the last. `master` is the one declared from the parameter, if any.
  std::array<rt::TensorHandle, kMaxStates> declared;
  std::array<std::string, kMaxStates> suffixes;  // for messages
  rt::TensorHandle master;
  int master_at = -1;  // its index in `declared`
  std::size_t group = 0;
  int layer = 0;
  std::int64_t numel = 0;
  ElemType param_type = ElemType::kF32;
  ElemType grad_type = ElemType::kF32;
  std::string param_name, grad_name;  // for messages: handles outlive their tensors
  // Steps queued for this parameter, skipped ones included (See Note [Per-parameter steps] in
  // adam.h).
  std::int64_t steps = 0;
  // This step's gradient, when grad is not registered (See Note [Gradients given at each step] in
  // adam.h).
  const void* given_grad = nullptr;
  // The key of its compressed moments' rounding (state_seed of the parameter's name).
  std::uint32_t seed = 0;
  // Whether `h` is a float32 parameter's master, which checkpoints and state dicts leave out
  // (See Note [Float32 masters follow the split] in adam_placement.cpp).
  bool float32_master(rt::TensorHandle h) const {
    return param_type == ElemType::kF32 && master.valid() && h.id == master.id;
  }
  // The optimizer's state tensors of this parameter, valid or not, in checkpoint order.
  const std::array<rt::TensorHandle, kMaxStates>& states() const { return declared; }
  // Every tensor the kernel takes, valid or not: the parameter, the gradient, then the states.
  std::array<rt::TensorHandle, 2 + kMaxStates> kernel_tensors() const {
    std::array<rt::TensorHandle, 2 + kMaxStates> out = {param, grad};
    for (int j = 0; j < kMaxStates; ++j) out[2 + j] = declared[j];
    return out;
  }
};

}  // namespace strata::optim
