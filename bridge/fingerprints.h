// bridge/fingerprints.h: the fingerprints of torch tensors (See Note [Gradient fingerprints] in
// optim/fingerprint.h), on their device and, for a CUDA tensor, on torch's current stream, with
// no host wait: strata.optim takes them of the gradients a step in backward read, and again in
// step(), to tell whether the loop changed them.
//
// Example:
//   at::Tensor before = fingerprints({g1, g2});  // int64, shape [2, 2], on g1's device
//   ...the loop's clip_grad_norm_...
//   bool changed = !at::equal(before, fingerprints({g1, g2}));
#pragma once

#include <vector>

#include "ATen/core/Tensor.h"

namespace strata::bridge {

// One row a tensor: int64 [tensors.size(), 2], on the first tensor's device. Every tensor must be
// contiguous, of a 2- or 4-byte dtype, below kMaxFingerprintElements elements, and on that device;
// c10::ValueError otherwise.
at::Tensor fingerprints(const std::vector<at::Tensor>& tensors);

}  // namespace strata::bridge
