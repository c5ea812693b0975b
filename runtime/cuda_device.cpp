// The CUDA Device: non-blocking streams, cudaMemcpyAsync, pooled events (the allocator's, shared),
// timing events, and host functions through cudaLaunchHostFunc. Without CUDA, make_cuda_device
// reports kUnavailable.
#include <atomic>
#include <vector>

#include <mutex>
#include "absl/base/thread_annotations.h"
#include "allocator/cuda_status.h"
#include "allocator/upstream.h"
#include "base/status.h"
#include "base/strings.h"
#include "runtime/device.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::rt {

#ifdef STRATA_HAS_CUDA
namespace {

using alloc::cuda_status;

#define STRATA_CUDA_OK_(expr, what)                        \
  do {                                                     \
    absl::Status strata_cuda_ = cuda_status((expr), what); \
    if (!strata_cuda_.ok()) return strata_cuda_;           \
  } while (false)

void CUDART_CB run_host_function(void* arg) {
  auto* fn = static_cast<std::function<void()>*>(arg);
  (*fn)();
  delete fn;
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int device, std::shared_ptr<alloc::StreamOps> events)
      : device_(device), events_(std::move(events)), name_(alloc::cuda_device_name(device)) {}

  ~CudaDevice() override {
    // See Note [Stream ordering], rule 5: tolerate a runtime that is unloading at exit.
    for (cudaEvent_t e : timed_free_) (void)cudaEventDestroy(e);
  }

  std::string name() const override { return name_; }
  bool is_simulated() const override { return false; }
  int cuda_device() const override { return device_; }

  // Streams, events, copies and waits go to the runtime's device, whichever is current on the
  // calling thread (the legacy default stream, handle 0, is the current device's), and what was
  // current is again after (See Note [One CUDA device a runtime] in runtime.h).
  absl::StatusOr<StreamHandle> create_stream() override {
    const alloc::DeviceGuard on(device_);
    cudaStream_t s = nullptr;
    STRATA_CUDA_OK_(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    return static_cast<StreamHandle>(s);
  }

  void destroy_stream(StreamHandle stream) override {
    (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream));
  }

  absl::Status copy_async(void* dst, const void* src, std::size_t bytes,
                          StreamHandle stream) override {
    const alloc::DeviceGuard on(device_);
    return cuda_status(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)),
        "cudaMemcpyAsync");
  }

  absl::Status stream_wait(StreamHandle stream, EventHandle event) override {
    const alloc::DeviceGuard on(device_);  // the legacy default stream (0) is the device's
    return cuda_status(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent");
  }

  absl::Status enqueue_host(StreamHandle stream, std::function<void()> fn) override {
    const alloc::DeviceGuard on(device_);
    auto* heap_fn = new std::function<void()>(std::move(fn));
    cudaError_t err =
        cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), run_host_function, heap_fn);
    if (err != cudaSuccess) delete heap_fn;
    return cuda_status(err, "cudaLaunchHostFunc");
  }

  absl::Status stream_synchronize(StreamHandle stream) override {
    const alloc::DeviceGuard on(device_);
    ++host_syncs_;
    return cuda_status(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)),
                       "cudaStreamSynchronize");
  }

  absl::StatusOr<EventHandle> record(StreamHandle stream) override {
    return events_->record(stream);
  }
  absl::StatusOr<bool> query(EventHandle event) override { return events_->query(event); }
  absl::Status synchronize(EventHandle event) override {
    ++host_syncs_;
    return events_->synchronize(event);
  }
  void release(EventHandle event) override { events_->release(event); }

  absl::StatusOr<EventHandle> record_timed(StreamHandle stream) override {
    cudaEvent_t e = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!timed_free_.empty()) {
        e = timed_free_.back();
        timed_free_.pop_back();
      }
    }
    const alloc::DeviceGuard on(device_);
    if (e == nullptr) STRATA_CUDA_OK_(cudaEventCreate(&e), "cudaEventCreate");
    absl::Status s =
        cuda_status(cudaEventRecord(e, static_cast<cudaStream_t>(stream)), "cudaEventRecord");
    if (!s.ok()) {
      release_timed(e);
      return s;
    }
    return static_cast<EventHandle>(e);
  }

  absl::StatusOr<double> elapsed_ms(EventHandle start, EventHandle end) override {
    float ms = 0;
    cudaError_t err =
        cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end));
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return absl::FailedPreconditionError("elapsed_ms of a pending event");
    }
    STRATA_CUDA_OK_(err, "cudaEventElapsedTime");
    return static_cast<double>(ms);
  }

  void release_timed(EventHandle event) override {
    std::lock_guard<std::mutex> lock(mu_);
    timed_free_.push_back(static_cast<cudaEvent_t>(event));
  }

  std::int64_t host_syncs() const override { return host_syncs_.load(); }

 private:
  const int device_;
  const std::shared_ptr<alloc::StreamOps> events_;
  const std::string name_;
  std::atomic<std::int64_t> host_syncs_{0};
  std::mutex mu_;
  std::vector<cudaEvent_t> timed_free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> make_cuda_device(int cuda_device) {
  if (cuda_device == kCurrentCudaDevice) {
    STRATA_ASSIGN_OR_RETURN(cuda_device, alloc::current_cuda_device());
  }
  absl::StatusOr<std::shared_ptr<alloc::StreamOps>> events =
      alloc::make_cuda_stream_ops(cuda_device);
  if (!events.ok()) return events.status();
  return std::unique_ptr<Device>(new CudaDevice(cuda_device, std::move(*events)));
}

#else

absl::StatusOr<std::unique_ptr<Device>> make_cuda_device(int /*cuda_device*/) {
  return absl::UnavailableError("strata was built without CUDA (STRATA_WITH_CUDA=OFF)");
}

#endif

}  // namespace strata::rt
