#include "allocator/cuda_status.h"

#ifdef STRATA_HAS_CUDA
#include <cuda.h>
#include <cudaTypedefs.h>

#include <map>
#include <mutex>
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

absl::Status cuda_driver_entry(const char* symbol, int version, void** fn) {
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  *fn = nullptr;
  if (cudaGetDriverEntryPointByVersion(symbol, fn, version, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess || *fn == nullptr) {
    (void)cudaGetLastError();
    *fn = nullptr;
    return absl::UnavailableError(str_cat("the CUDA driver has no ", symbol));
  }
  return absl::OkStatus();
}

namespace {

// The driver's calls for the thread's current context and the devices' primary contexts, through
// the runtime (no link to libcuda).
struct ContextApi {
  PFN_cuCtxGetCurrent_v4000 get = nullptr;
  PFN_cuCtxSetCurrent_v4000 set = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDevicePrimaryCtxRetain_v7000 retain = nullptr;

  // Never destroyed: a guard may run during static destruction.
  static const ContextApi& instance() {
    static const ContextApi* api = new ContextApi(load());
    return *api;
  }

  // `device`'s primary context, retained once and kept for the process (what the runtime API
  // uses for that device); null if the driver cannot give it.
  CUcontext primary(int device) const {
    static std::mutex mu;
    static auto* retained = new std::map<int, CUcontext>();
    const std::lock_guard<std::mutex> lock(mu);
    auto [it, added] = retained->try_emplace(device, nullptr);
    if (added) {
      CUdevice dev = 0;
      if (device_get(&dev, device) != CUDA_SUCCESS || retain(&it->second, dev) != CUDA_SUCCESS) {
        it->second = nullptr;
      }
    }
    return it->second;
  }

 private:
  static ContextApi load() {
    ContextApi a;
    if (cuda_driver_entry("cuCtxGetCurrent", 4000, &a.get).ok() &&
        cuda_driver_entry("cuCtxSetCurrent", 4000, &a.set).ok() &&
        cuda_driver_entry("cuDeviceGet", 2000, &a.device_get).ok() &&
        cuda_driver_entry("cuDevicePrimaryCtxRetain", 7000, &a.retain).ok()) {
      return a;
    }
    return ContextApi{};
  }
};

}  // namespace

// The switch goes through the driver's current context only: cudaSetDevice would also change the
// runtime's per-thread device, which stays after the context is put back (a thread with no
// context would then make its next one on `device`).
DeviceGuard::DeviceGuard(int device) {
  if (cudaGetDevice(&saved_device_) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (saved_device_ == device) return;
  const ContextApi& api = ContextApi::instance();
  CUcontext current = nullptr;
  CUcontext target = nullptr;
  if (api.get != nullptr && api.get(&current) == CUDA_SUCCESS &&
      (target = api.primary(device)) != nullptr) {
    if (target == current || api.set(target) != CUDA_SUCCESS) return;
    saved_context_ = current;
    context_saved_ = true;
    restore_ = true;
    return;
  }
  if (cudaSetDevice(device) != cudaSuccess) {  // no driver entry points: the runtime's way
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
