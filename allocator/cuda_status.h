// allocator/cuda_status.h: the CUDA runtime as every layer that calls it sees it: its errors as an
// absl::Status, written once (the allocator's upstreams and events, the runtime's device, the
// optimizer's kernels, the benchmarks), whether a device is there to use, which one is current,
// and a guard that makes one current for a scope.
//
// Example:
//   STRATA_RETURN_IF_ERROR(alloc::require_cuda_device(0));
//   alloc::DeviceGuard on(device);  // CUDA calls below act on `device`; the old one comes back
//   STRATA_RETURN_IF_ERROR(alloc::cuda_status(cudaStreamSynchronize(s), "cudaStreamSynchronize"));
//   // on failure: "cudaStreamSynchronize failed: cudaErrorIllegalAddress: an illegal memory ..."
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::alloc {

#ifdef STRATA_HAS_CUDA
// "cudaErrorName: what the runtime says of it".
std::string cuda_error_text(cudaError_t err);

// Ok for cudaSuccess; otherwise kInternal "<what> failed: <cuda_error_text>". Clears the runtime's
// last error, so that the next call does not report this one again (a sticky error, which ruins
// the context, is reported by every later call anyway).
absl::Status cuda_status(cudaError_t err, std::string_view what);

// Ok when CUDA device `device` is visible; kUnavailable when none is, kInvalidArgument when that
// one does not exist.
absl::Status require_cuda_device(int device);

// The driver's function `symbol` as of CUDA `version` (e.g. 12000), through the runtime, so that
// nothing links libcuda; kUnavailable when the driver has none.
//   PFN_cuMemCreate_v10020 create = nullptr;
//   STRATA_RETURN_IF_ERROR(cuda_driver_entry("cuMemCreate", 12000, &create));
absl::Status cuda_driver_entry(const char* symbol, int version, void** fn);
template <typename Fn>
absl::Status cuda_driver_entry(const char* symbol, int version, Fn* fn) {
  void* p = nullptr;
  absl::Status s = cuda_driver_entry(symbol, version, &p);
  if (s.ok()) *fn = reinterpret_cast<Fn>(p);
  return s;
}

// Makes `device` current for the scope (its primary context, through the driver), and puts back
// after it exactly what was current before: the context the thread had, or none, and the runtime's
// per-thread device untouched (a thread starts with no context, which cudaGetDevice reports as
// device 0; setting device 0 back would make a context there, and leaving `device` set would make
// the thread's next one there). CUDA calls that create streams, events or memory, record events,
// or use the legacy default stream (handle 0) act on the current device (See Note [One CUDA device
// a runtime] in runtime/runtime.h).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  void* saved_context_ = nullptr;  // a CUcontext, null for none
  bool context_saved_ = false;     // else cudaSetDevice switched (no driver entry points)
  int saved_device_ = 0;
  bool restore_ = false;
};
#endif

// The calling thread's current CUDA device (what torch.cuda.set_device set); kUnavailable when
// no device is visible or strata was built without CUDA.
absl::StatusOr<int> current_cuda_device();

// kUnavailable: strata was built without CUDA (what the CUDA factories return then).
absl::Status no_cuda();

}  // namespace strata::alloc
