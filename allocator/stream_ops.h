// allocator/stream_ops.h: the events the pool uses to know when a stream is done with a block.
//
// A block freed while a stream other than its allocation stream may still use it (the caller said
// so with record_stream) becomes reusable only after an event recorded on each such stream at free
// time has completed (See Note [Stream ordering] in block_pool.h; its rules are numbered in
// docs/design.md, section 6). StreamOps is the seam between that rule and CUDA: CudaStreamOps
// records real cudaEvents; SimulatedStreamOps stands in on machines without a GPU and lets tests
// hold events incomplete on purpose.
//
// Example:
//   SimulatedStreamOps ops;
//   ops.hold();                                   // events recorded from now on stay pending
//   EventHandle e = *ops.record(stream);
//   assert(!*ops.query(e));
//   ops.complete_all();                           // the "stream" caught up
//   assert(*ops.query(e));
//   ops.release(e);
#pragma once

#include <cstdint>
#include <memory>

#include <mutex>
#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace strata::alloc {

// A cudaStream_t on the CUDA backend; nullptr is the legacy default stream.
using StreamHandle = void*;
// A cudaEvent_t on the CUDA backend; an opaque id on the simulated one.
using EventHandle = void*;

class StreamOps {
 public:
  virtual ~StreamOps() = default;
  // Records an event that completes when all work queued on `stream` so far has finished.
  [[nodiscard]] virtual absl::StatusOr<EventHandle> record(StreamHandle stream) = 0;
  // True once the event completed. An error means "unknown": callers treat it as not complete.
  [[nodiscard]] virtual absl::StatusOr<bool> query(EventHandle event) = 0;
  // Blocks the host until the event completed.
  [[nodiscard]] virtual absl::Status synchronize(EventHandle event) = 0;
  // Returns the event for reuse. The event must not be used afterwards.
  virtual void release(EventHandle event) = 0;
};

// Events on real CUDA streams of `device`, pooled (created once with cudaEventDisableTiming, reused
// forever). kUnavailable when strata was built without CUDA, kInvalidArgument when `device` does
// not exist.
absl::StatusOr<std::shared_ptr<StreamOps>> make_cuda_stream_ops(int device);

// Host-only stand-in. By default every event is complete when recorded (simulated streams run
// synchronously). After hold(), new events stay pending until complete_all() or complete(event).
class SimulatedStreamOps final : public StreamOps {
 public:
  absl::StatusOr<EventHandle> record(StreamHandle stream) override;
  absl::StatusOr<bool> query(EventHandle event) override;
  absl::Status synchronize(EventHandle event) override;
  void release(EventHandle event) override;

  void hold();
  void complete(EventHandle event);
  void complete_all();
  // Number of events recorded and not yet released.
  std::int64_t live_events() const;
  // When set, synchronize() completes the event it waits on (a stream that eventually finishes);
  // when cleared, synchronize() on a pending event returns kDeadlineExceeded (a stuck stream).
  void set_synchronize_completes(bool value);

 private:
  mutable std::mutex mu_;
  bool holding_ ABSL_GUARDED_BY(mu_) = false;
  bool synchronize_completes_ ABSL_GUARDED_BY(mu_) = true;
  std::uintptr_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<std::uintptr_t, bool> done_ ABSL_GUARDED_BY(mu_);
};

}  // namespace strata::alloc
