// bridge/scalar_reader.cpp: see scalar_reader.h.
#include "bridge/scalar_reader.h"

#include <cstdint>
#include <limits>
#include <optional>

#include "ATen/ATen.h"
#include "c10/core/impl/VirtualGuardImpl.h"
#include "c10/util/Exception.h"

namespace strata::bridge {

std::vector<double> ScalarReader::read(const std::vector<at::Tensor>& scalars) {
  std::vector<double> out(scalars.size(), std::numeric_limits<double>::quiet_NaN());
  std::vector<std::int64_t> on_cuda;
  std::optional<c10::Device> device;
  for (std::size_t i = 0; i < scalars.size(); ++i) {
    const at::Tensor& t = scalars[i];
    if (!t.defined()) continue;
    TORCH_CHECK(t.numel() == 1, "strata ScalarReader: scalar ", i, " has ", t.numel(),
                " elements; only one-element tensors can be read");
    if (!t.is_cuda()) {
      out[i] = t.item<double>();
      continue;
    }
    TORCH_CHECK(!device || *device == t.device(), "strata ScalarReader: scalars on ", device->str(),
                " and ", t.device().str(), "; read each device's scalars in a call of its own");
    device = t.device();
    on_cuda.push_back(static_cast<std::int64_t>(i));
  }
  if (on_cuda.empty()) return out;
  const auto n = static_cast<std::int64_t>(on_cuda.size());
  if (!host_.defined() || host_.numel() < n || on_gpu_.device() != *device) {
    host_ = at::empty({n}, at::TensorOptions().dtype(at::kDouble).pinned_memory(true));
    // Pinned memory is mapped into the GPU's address space at its host address (unified
    // addressing), so a kernel writes it directly, with no copy engine on the way.
    on_gpu_ = at::from_blob(host_.data_ptr(), {n},
                            at::TensorOptions().dtype(at::kDouble).device(*device));
    one_ = at::ones({}, on_gpu_.options());
  }
  for (std::int64_t k = 0; k < n; ++k) {
    // A multiplication, not copy_: a copy between tensors of one dtype is a cudaMemcpyAsync, which
    // the driver sees lands in host memory and gives to a copy engine.
    at::Tensor slot = on_gpu_.select(0, k);
    at::mul_out(slot, scalars[on_cuda[k]].detach().reshape({}).to(at::kDouble), one_);
  }
  // The kernels ran on torch's current stream of the scalars' device (ATen's device guard).
  const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  impl.getStream(*device).synchronize();
  const double* values = host_.const_data_ptr<double>();
  for (std::int64_t k = 0; k < n; ++k) out[on_cuda[k]] = values[k];
  return out;
}

}  // namespace strata::bridge
