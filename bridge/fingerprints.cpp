#include "bridge/fingerprints.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include "base/strings.h"
#include "bridge/torch_runtime.h"
#include "optim/fingerprint.h"

namespace strata::bridge {

at::Tensor fingerprints(const std::vector<at::Tensor>& tensors) {
  const c10::Device device = tensors.empty() ? c10::Device(c10::kCPU) : tensors[0].device();
  c10::OptionalDeviceGuard guard;
  if (device.is_cuda()) guard.reset_device(device);  // the launch on the tensors' device
  at::Tensor out = at::zeros({static_cast<std::int64_t>(tensors.size()), 2},
                             at::TensorOptions().dtype(at::kLong).device(device));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const auto bytes = static_cast<int>(t.element_size());
    TORCH_CHECK_VALUE(t.device() == device && t.is_contiguous() && (bytes == 2 || bytes == 4) &&
                          t.numel() < optim::kMaxFingerprintElements,
                      "fingerprints: tensor ", i, " (", t.scalar_type(), ", ", t.numel(),
                      " elements, on ", t.device(),
                      ") is not a contiguous tensor of 2- or 4-byte "
                      "elements below 2^32 elements on ",
                      device);
    std::int64_t* row = out.data_ptr<std::int64_t>() + 2 * static_cast<std::int64_t>(i);
    if (!device.is_cuda()) {
      optim::fingerprint_cpu(t.const_data_ptr(), t.numel(), bytes, row);
      continue;
    }
#ifdef STRATA_HAS_CUDA
    const cudaError_t err =
        optim::fingerprint_cuda(t.const_data_ptr(), t.numel(), bytes, row,
                                static_cast<cudaStream_t>(current_stream(device)));
    TORCH_CHECK(err == cudaSuccess, "fingerprints: ", cudaGetErrorString(err));
#else
    TORCH_CHECK(false, "fingerprints: strata was built without CUDA");
#endif
  }
  return out;
}

}  // namespace strata::bridge
