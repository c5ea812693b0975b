// runtime/device.h: the streams, events and copies the runtime drives, on CUDA or simulated.
//
// Device extends the allocator's StreamOps (so the allocator and the runtime share one event pool)
// with what the migration engine needs: non-blocking streams, asynchronous copies, stream-to-event
// waits, timing events, and host functions enqueued in stream order (the simulated device's
// "kernels"). Every host wait (event or stream synchronize) is counted: the runtime promises none
// in steady state, and tests read the counter.
//
// SimulatedDevice runs on machines without a GPU, with host memory standing in for GPU memory. In
// immediate mode (the default) each operation runs when it is enqueued. In deferred mode operations
// queue per stream and run only when the host waits (an event wait runs the streams in turn until
// the event completes, leaving later work queued), or when a test calls run_pending() /
// run_one(); that makes in-flight states observable on the CPU (a copy not yet done, a stream
// waiting on another) and lets tests delay copy streams on purpose. With random completion on top
// (set_random_completion), every enqueue and every event query also runs a few queued operations
// of streams picked at random, so copies complete in an order no test chose, while others are
// still queued, as on a GPU whose copy engines and kernels run on their own.
//
// Example:
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, make_device(DeviceKind::kAuto));
//   STRATA_ASSIGN_OR_RETURN(StreamHandle h2d, device->create_stream());
//   STRATA_RETURN_IF_ERROR(device->copy_async(gpu_dst, pinned_src, bytes, h2d));
//   STRATA_ASSIGN_OR_RETURN(EventHandle arrived, device->record(h2d));
//   STRATA_RETURN_IF_ERROR(device->stream_wait(compute, arrived));   // the host does not wait
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/stream_ops.h"

namespace strata::rt {

using alloc::EventHandle;
using alloc::StreamHandle;

class Device : public alloc::StreamOps {
 public:
  // "NVIDIA H200" or "simulated".
  virtual std::string name() const = 0;
  virtual bool is_simulated() const = 0;
  // The CUDA device's index; -1 for the simulated device.
  virtual int cuda_device() const { return -1; }

  // A stream that does not synchronize with the legacy default stream.
  [[nodiscard]] virtual absl::StatusOr<StreamHandle> create_stream() = 0;
  virtual void destroy_stream(StreamHandle stream) = 0;
  // Copies bytes in stream order; either side may be device or host memory.
  [[nodiscard]] virtual absl::Status copy_async(void* dst, const void* src, std::size_t bytes,
                                                StreamHandle stream) = 0;
  // Work enqueued on `stream` after this call waits for `event`; the host does not.
  [[nodiscard]] virtual absl::Status stream_wait(StreamHandle stream, EventHandle event) = 0;
  // Runs fn on the host in stream order (cudaLaunchHostFunc on CUDA). fn must not call the device.
  [[nodiscard]] virtual absl::Status enqueue_host(StreamHandle stream,
                                                  std::function<void()> fn) = 0;
  // Blocks the host until everything queued on the stream has run. Counted as a host sync.
  [[nodiscard]] virtual absl::Status stream_synchronize(StreamHandle stream) = 0;

  // Events that can be timed against each other (cudaEventElapsedTime). Not pooled with record().
  [[nodiscard]] virtual absl::StatusOr<EventHandle> record_timed(StreamHandle stream) = 0;
  // Milliseconds between two completed timed events; kFailedPrecondition if either is pending.
  [[nodiscard]] virtual absl::StatusOr<double> elapsed_ms(EventHandle start, EventHandle end) = 0;
  virtual void release_timed(EventHandle event) = 0;

  // Host waits so far (event and stream synchronizes made through this device).
  virtual std::int64_t host_syncs() const = 0;
};

enum class DeviceKind {
  kAuto,       // CUDA when a GPU is visible, simulated otherwise
  kCuda,       // kUnavailable without a GPU
  kSimulated,  // also on a machine with a GPU
};

// A CUDA device index meaning the calling thread's current device when the runtime is made
// (See Note [One CUDA device a runtime] in runtime.h).
inline constexpr int kCurrentCudaDevice = -1;

struct DeviceChoice {
  DeviceKind kind = DeviceKind::kAuto;
  int cuda_device = kCurrentCudaDevice;
};

// "auto", "cuda", "cuda:N" or "simulated" (a program's --device flag, strata.Runtime's device
// argument); anything else is kInvalidArgument naming the forms.
[[nodiscard]] absl::StatusOr<DeviceChoice> parse_device(std::string_view name);

// `cuda_device` kCurrentCudaDevice: the calling thread's current device.
[[nodiscard]] absl::StatusOr<std::unique_ptr<Device>> make_device(
    DeviceKind kind, int cuda_device = kCurrentCudaDevice);
[[nodiscard]] absl::StatusOr<std::unique_ptr<Device>> make_cuda_device(
    int cuda_device = kCurrentCudaDevice);

class SimulatedDevice final : public Device {
 public:
  SimulatedDevice();
  ~SimulatedDevice() override;

  std::string name() const override { return "simulated"; }
  bool is_simulated() const override { return true; }
  absl::StatusOr<StreamHandle> create_stream() override;
  void destroy_stream(StreamHandle stream) override;
  absl::Status copy_async(void* dst, const void* src, std::size_t bytes,
                          StreamHandle stream) override;
  absl::Status stream_wait(StreamHandle stream, EventHandle event) override;
  absl::Status enqueue_host(StreamHandle stream, std::function<void()> fn) override;
  absl::Status stream_synchronize(StreamHandle stream) override;
  absl::StatusOr<EventHandle> record_timed(StreamHandle stream) override;
  absl::StatusOr<double> elapsed_ms(EventHandle start, EventHandle end) override;
  void release_timed(EventHandle event) override;
  std::int64_t host_syncs() const override;

  absl::StatusOr<EventHandle> record(StreamHandle stream) override;
  absl::StatusOr<bool> query(EventHandle event) override;
  absl::Status synchronize(EventHandle event) override;
  void release(EventHandle event) override;

  // Deferred mode: operations queue until the host waits or a test runs them.
  void set_deferred(bool deferred);
  // Runs every operation that can run (a wait on an unrecorded event blocks its stream). Returns
  // how many ran.
  int run_pending();
  // Runs the first runnable operation of `stream`; false if none could run.
  bool run_one(StreamHandle stream);
  // Random completion (needs deferred mode): a seed, or nullopt to turn it off.
  void set_random_completion(std::optional<std::uint64_t> seed);
  // Operations queued and not yet run, over all streams; the copies among them.
  int pending_operations() const;
  int pending_copies() const;
  // Events recorded and not yet released; streams created and not yet destroyed.
  int live_events() const;
  int live_streams() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace strata::rt
