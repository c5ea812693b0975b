// bridge/scalar_reader.h: reads the values of scalar tensors (a loss, a gradient norm, a loss
// scale, a found_inf flag) on the host without a copy engine.
//
// .item() on a CUDA tensor is a 4-byte copy to the host, and copies queue on the GPU's copy
// engines: behind the write-backs a strata step leaves running (an overlapped step's last layers,
// layer_prefetch's staging ring), such a copy waits for all of them (tens of milliseconds; the
// README has the figures), although the value was ready long before. A ScalarReader instead has a
// kernel on torch's current stream write the values into pinned host memory (mapped into the GPU's
// address space), and waits for that stream only (See Note [Reading the step's scalars] in
// optim/adam_overlap.cpp does the same inside Adam). CPU tensors are read with .item().
//
// Example:
//   bridge::ScalarReader reader;  // keep one: its pinned buffer is reused
//   std::vector<double> v = reader.read({loss, grad_norm});
//   std::printf("loss %.6f norm %.4f\n", v[0], v[1]);
#pragma once

#include <vector>

#include "ATen/core/Tensor.h"

namespace strata::bridge {

class ScalarReader {
 public:
  // The values of one-element tensors, as double (exact for every float dtype, and for integers
  // up to 2^53; a bool reads 0 or 1). An undefined tensor reads NaN. CUDA tensors must be on one
  // device; they are read after the work queued before on torch's current stream of that device.
  // Throws (c10::Error) for a tensor of more than one element, or CUDA tensors on two devices.
  // The first read of CUDA scalars (and one of more of them than before) allocates the pinned
  // buffer, which may wait for the whole device once.
  std::vector<double> read(const std::vector<at::Tensor>& scalars);

 private:
  at::Tensor host_;    // pinned, float64, reused while large enough
  at::Tensor on_gpu_;  // host_'s memory as a CUDA tensor (unified addressing)
  at::Tensor one_;     // 1.0 on on_gpu_'s device
};

}  // namespace strata::bridge
