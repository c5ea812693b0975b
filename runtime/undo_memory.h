// runtime/undo_memory.h: where the copies an overlapped step keeps on the GPU for its redo come
// from, when another allocator than strata's GPU pool should give them
// (See Note [The undo in the framework's memory] in undo_log.cpp).
//
// The runtime calls it under its own mutex, from whichever thread calls the runtime (a backward
// hook's allocate, step()'s free), one call at a time; it must not throw. The bridge's
// TorchUndoMemory takes the copies from torch's caching allocator:
//   runtime->set_undo_memory(std::make_shared<MyUndoMemory>());   // between steps
//   ... keep_for_undo of a tensor resting on the GPU, with undo_on_gpu, now calls allocate ...
#pragma once

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/device.h"

namespace strata::rt {

class UndoMemory {
 public:
  virtual ~UndoMemory() = default;
  // `bytes` of GPU memory that the work queued on `stream` from now on may write and read, or
  // nullptr when there is no room (the runtime then keeps the copy in pinned host memory).
  [[nodiscard]] virtual absl::StatusOr<void*> allocate(std::size_t bytes, StreamHandle stream) = 0;
  // Gives a block from allocate back once the work queued on `stream` so far is done with it.
  [[nodiscard]] virtual absl::Status free(void* ptr, StreamHandle stream) = 0;
};

}  // namespace strata::rt
