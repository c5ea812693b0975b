// allocator/cuda_stream_ops.cpp: StreamOps on CUDA events, recycled so that steady state creates
// none. Built with the CUDA runtime when STRATA_HAS_CUDA is defined; otherwise the factory reports
// kUnavailable.
//
// Example:
//   STRATA_ASSIGN_OR_RETURN(std::shared_ptr<StreamOps> ops, make_cuda_stream_ops(/*device=*/0));
//   STRATA_ASSIGN_OR_RETURN(EventHandle done, ops->record(stream));
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "allocator/cuda_status.h"
#include "allocator/stream_ops.h"
#include "base/status.h"
#include "base/strings.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::alloc {

#ifdef STRATA_HAS_CUDA
namespace {

// Events are created once (timing disabled: cheaper to record and query) and recycled, so steady
// state makes no cudaEventCreate calls.
class CudaStreamOps final : public StreamOps {
 public:
  explicit CudaStreamOps(int device) : device_(device) {}
  ~CudaStreamOps() override {
    // See Note [Stream ordering], rule 5: tolerate a runtime that is unloading at exit.
    for (cudaEvent_t e : free_) (void)cudaEventDestroy(e);
  }

  absl::StatusOr<EventHandle> record(StreamHandle stream) override {
    cudaEvent_t event = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        event = free_.back();
        free_.pop_back();
      }
    }
    // An event belongs to the device current when it is made, and is recorded on a stream of it.
    const DeviceGuard on(device_);
    if (event == nullptr) {
      STRATA_RETURN_IF_ERROR(
          cuda_status(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate"));
    }
    const cudaError_t err = cudaEventRecord(event, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      release(event);
      return absl::InternalError(
          str_cat("cudaEventRecord on stream ", stream, " failed: ", cuda_error_text(err)));
    }
    return static_cast<EventHandle>(event);
  }

  absl::StatusOr<bool> query(EventHandle event) override {
    const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (err == cudaSuccess) return true;
    (void)cudaGetLastError();
    if (err == cudaErrorNotReady) return false;
    return absl::InternalError(str_cat("cudaEventQuery failed: ", cuda_error_text(err)));
  }

  absl::Status synchronize(EventHandle event) override {
    return cuda_status(cudaEventSynchronize(static_cast<cudaEvent_t>(event)),
                       "cudaEventSynchronize");
  }

  void release(EventHandle event) override {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(static_cast<cudaEvent_t>(event));
  }

 private:
  const int device_;
  std::mutex mu_;
  std::vector<cudaEvent_t> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::shared_ptr<StreamOps>> make_cuda_stream_ops(int device) {
  if (absl::Status s = require_cuda_device(device); !s.ok()) return s;
  return std::shared_ptr<StreamOps>(new CudaStreamOps(device));
}

#else  // !STRATA_HAS_CUDA

absl::StatusOr<std::shared_ptr<StreamOps>> make_cuda_stream_ops(int /*device*/) {
  return no_cuda();
}

#endif  // STRATA_HAS_CUDA

}  // namespace strata::alloc
