// allocator/pinned_upstream.cpp: page-locked host memory for the pinned tier's pool, by
// cudaHostAlloc or by mmap + cudaHostRegister (See Note [Pinned upstream]). Built with the CUDA
// runtime when STRATA_HAS_CUDA is defined; otherwise the factory reports kUnavailable.
//
// Example:
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Upstream> pinned,
//                           make_pinned_host_upstream(PinnedMethod::kCudaHostAlloc));
#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "allocator/cuda_status.h"
#include "allocator/upstream.h"
#include "base/strings.h"
#include "base/units.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::alloc {

#ifdef STRATA_HAS_CUDA
namespace {

// Note [Pinned upstream]
// ~~~~~~~~~~~~~~~~~~~~~~
// Two ways to get page-locked host memory. cudaHostAlloc asks the driver for it in one call; mmap +
// cudaHostRegister maps ordinary pages first and pins them after. Both make memory that copies at
// full link speed; they differ in how long pinning takes, which matters for the first cycle only
// because the pool keeps pinned segments forever. bench/allocator_bench measures both
// (BM_PinnedUpstream) and the default in AllocatorOptions follows the numbers.
class PinnedHostUpstream final : public Upstream {
 public:
  PinnedHostUpstream(PinnedMethod method, int device) : method_(method), device_(device) {
    name_ = str_cat("pinned_host(", pinned_method_name(method), ")");
  }
  std::string_view name() const override { return name_; }

  // Pinned in the runtime's device's context, whichever device is current (the memory is
  // portable, so every device copies at full speed; See Note [One CUDA device a runtime] in
  // runtime/runtime.h).
  absl::StatusOr<void*> allocate(std::size_t bytes) override {
    const DeviceGuard on(device_);
    if (method_ == PinnedMethod::kCudaHostAlloc) {
      void* p = nullptr;
      const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return absl::ResourceExhaustedError(
            str_cat("cudaHostAlloc of ", format_bytes(bytes), " failed: ", cuda_error_text(err)));
      }
      return p;
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      return absl::ResourceExhaustedError(
          str_cat("mmap of ", format_bytes(bytes), " for pinning failed: ", std::strerror(e)));
    }
    const cudaError_t err = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      munmap(p, bytes);
      return absl::ResourceExhaustedError(
          str_cat("cudaHostRegister of ", format_bytes(bytes), " failed: ", cuda_error_text(err)));
    }
    return p;
  }

  absl::Status deallocate(void* ptr, std::size_t bytes) override {
    const DeviceGuard on(device_);
    if (method_ == PinnedMethod::kCudaHostAlloc) {
      const cudaError_t err = cudaFreeHost(ptr);
      if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
        return absl::InternalError(
            str_cat("cudaFreeHost(", ptr, ") failed: ", cuda_error_text(err)));
      }
      return absl::OkStatus();
    }
    const cudaError_t err = cudaHostUnregister(ptr);
    if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
      return absl::InternalError(
          str_cat("cudaHostUnregister(", ptr, ") failed: ", cuda_error_text(err)));
    }
    if (munmap(ptr, bytes) != 0) {
      const int e = errno;
      return absl::InternalError(str_cat("munmap of pinned segment failed: ", std::strerror(e)));
    }
    return absl::OkStatus();
  }

 private:
  const PinnedMethod method_;
  const int device_;
  std::string name_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Upstream>> make_pinned_host_upstream(PinnedMethod method,
                                                                    int device) {
  if (absl::Status s = require_cuda_device(device); !s.ok()) return s;
  return std::unique_ptr<Upstream>(new PinnedHostUpstream(method, device));
}

#else  // !STRATA_HAS_CUDA

absl::StatusOr<std::unique_ptr<Upstream>> make_pinned_host_upstream(PinnedMethod /*method*/,
                                                                    int /*device*/) {
  return no_cuda();
}

#endif  // STRATA_HAS_CUDA

}  // namespace strata::alloc
