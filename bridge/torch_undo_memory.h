// bridge/torch_undo_memory.h: the copies an overlapped step keeps on the GPU for its redo, taken
// from torch's caching allocator, so that they reuse the blocks backward frees as it goes
// (See Note [The undo in the framework's memory] in runtime/undo_log.cpp). TorchBinding sets one
// on a runtime with a real GPU; the runtime owns it.
//
//   const c10::Stream torch_stream = ...;   // the stream torch computes on
//   check(runtime.set_undo_memory(std::make_shared<TorchUndoMemory>(runtime.device(),
//                                                                    torch_stream)));
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "c10/core/Allocator.h"
#include "c10/core/Stream.h"
#include "runtime/device.h"
#include "runtime/undo_memory.h"

namespace strata::bridge {

class TorchUndoMemory final : public rt::UndoMemory {
 public:
  // `home`: the CUDA stream torch computes on (backward's), whose freed blocks the copies take.
  // `device` is the runtime's, which owns this object and so outlives it.
  TorchUndoMemory(rt::Device& device, c10::Stream home);

  // A block of torch's on `home`; `stream` (the step's) waits for the work queued on `home` so
  // far, which may still read what the block held. nullptr when torch is out of memory, and from
  // then on until a block goes back (torch empties its cache before it says so). Throws nothing.
  absl::StatusOr<void*> allocate(std::size_t bytes, rt::StreamHandle stream) override;
  // `home` waits for `stream`'s work so far, then the block goes back to torch's cache.
  absl::Status free(void* ptr, rt::StreamHandle stream) override;

 private:
  rt::StreamHandle home_handle() const;

  rt::Device& device_;
  const c10::Stream home_;
  std::atomic<bool> exhausted_ = false;
  std::mutex mu_;
  absl::flat_hash_map<void*, c10::DataPtr> blocks_;
};

}  // namespace strata::bridge
