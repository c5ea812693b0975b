#include "allocator/cuda_status.h"

#ifdef STRATA_HAS_CUDA
#include <cuda.h>
#include <cudaTypedefs.h>
#endif

#include "allocator/upstream.h"
#include "base/status.h"
#include "base/strings.h"

namespace strata::alloc {

#ifdef STRATA_HAS_CUDA

std::string cuda_error_text(cudaError_t err) {
  return str_cat(cudaGetErrorName(err), ": ", cudaGetErrorString(err));
}

absl::Status cuda_status(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  return absl::InternalError(str_cat(what, " failed: ", cuda_error_text(err)));
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

std::string cuda_device_name(int device) {
  if (cuda_device_count() <= device) return "none";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return "unknown";
  return prop.name;
}

absl::Status require_cuda_device(int device) {
  const int count = cuda_device_count();
  if (count == 0) return absl::UnavailableError("no CUDA device is visible");
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        str_cat("CUDA device ", device, " does not exist; ", count, " visible"));
  }
  return absl::OkStatus();
}

namespace {

// The driver's calls for the thread's current context, through the runtime (no link to libcuda).
struct ContextApi {
  PFN_cuCtxGetCurrent_v4000 get = nullptr;
  PFN_cuCtxSetCurrent_v4000 set = nullptr;

  // Never destroyed: a guard may run during static destruction.
  static const ContextApi& instance() {
    static const ContextApi* api = new ContextApi(load());
    return *api;
  }

 private:
  template <typename Fn>
  static void entry(const char* symbol, Fn* fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion(symbol, &p, 4000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      p = nullptr;
    }
    *fn = reinterpret_cast<Fn>(p);
  }
  static ContextApi load() {
    ContextApi a;
    entry("cuCtxGetCurrent", &a.get);
    entry("cuCtxSetCurrent", &a.set);
    if (a.get == nullptr || a.set == nullptr) return ContextApi{};
    return a;
  }
};

}  // namespace

DeviceGuard::DeviceGuard(int device) {
  if (cudaGetDevice(&saved_device_) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (saved_device_ == device) return;
  const ContextApi& api = ContextApi::instance();
  CUcontext current = nullptr;
  context_saved_ = api.get != nullptr && api.get(&current) == CUDA_SUCCESS;
  saved_context_ = current;
  if (cudaSetDevice(device) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  restore_ = true;
}

DeviceGuard::~DeviceGuard() {
  if (!restore_) return;
  if (context_saved_) {
    (void)ContextApi::instance().set(static_cast<CUcontext>(saved_context_));
  } else if (cudaSetDevice(saved_device_) != cudaSuccess) {
    (void)cudaGetLastError();
  }
}

absl::StatusOr<int> current_cuda_device() {
  if (cuda_device_count() == 0) return absl::UnavailableError("no CUDA device is visible");
  int device = 0;
  STRATA_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&device), "cudaGetDevice"));
  return device;
}

#else  // !STRATA_HAS_CUDA

int cuda_device_count() { return 0; }
absl::StatusOr<int> current_cuda_device() { return no_cuda(); }
std::string cuda_device_name(int /*device*/) { return "none"; }

#endif  // STRATA_HAS_CUDA

absl::Status no_cuda() {
  return absl::UnavailableError("strata was built without CUDA (STRATA_WITH_CUDA=OFF)");
}

}  // namespace strata::alloc
