#include "bridge/torch_undo_memory.h"

#include <utility>

#include "base/status.h"
#include "base/strings.h"
#include "c10/core/StreamGuard.h"
#include "c10/util/Exception.h"

namespace strata::bridge {

namespace {

// `waiter` waits on the GPU for the work queued on `on` so far.
absl::Status wait_for(rt::Device& device, rt::StreamHandle waiter, rt::StreamHandle on) {
  if (waiter == on) return absl::OkStatus();
  STRATA_ASSIGN_OR_RETURN(rt::EventHandle ev, device.record(on));
  const absl::Status s = device.stream_wait(waiter, ev);
  device.release(ev);
  return s;
}

}  // namespace

TorchUndoMemory::TorchUndoMemory(rt::Device& device, c10::Stream home)
    : device_(device), home_(home) {}

rt::StreamHandle TorchUndoMemory::home_handle() const {
  return reinterpret_cast<rt::StreamHandle>(home_.native_handle());
}

absl::StatusOr<void*> TorchUndoMemory::allocate(std::size_t bytes, rt::StreamHandle stream) {
  // torch empties its whole cache before it reports out of memory: asked once a step at most.
  if (exhausted_.load()) return nullptr;
  void* ptr = nullptr;
  try {
    c10::DataPtr block;
    try {
      // torch's CUDA allocator gives blocks of the current stream: `home` for the call.
      const c10::StreamGuard on_home(home_);
      block = c10::GetAllocator(c10::DeviceType::CUDA)->allocate(bytes);
    } catch (const c10::OutOfMemoryError&) {
      exhausted_.store(true);
      return nullptr;
    }
    ptr = block.get();
    if (ptr == nullptr) return nullptr;
    const std::lock_guard<std::mutex> lock(mu_);
    blocks_.emplace(ptr, std::move(block));
  } catch (const std::exception& e) {
    return absl::InternalError(str_cat("torch's allocator, for an undo copy: ", e.what()));
  } catch (...) {
    return absl::InternalError("torch's allocator, for an undo copy: an unknown exception");
  }
  absl::Status waited = wait_for(device_, stream, home_handle());
  if (!waited.ok()) (void)free(ptr, stream);
  STRATA_RETURN_IF_ERROR(waited);
  return ptr;
}

absl::Status TorchUndoMemory::free(void* ptr, rt::StreamHandle stream) {
  absl::Status ordered = wait_for(device_, home_handle(), stream);
  // Unordered on the GPU, the block goes back only once `stream` is done with it on the host.
  if (!ordered.ok()) STRATA_RETURN_IF_ERROR(device_.stream_synchronize(stream));
  exhausted_.store(false);  // a block goes back: torch may have room again
  c10::DataPtr block;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(ptr);
    if (it == blocks_.end()) {
      return absl::InvalidArgumentError("TorchUndoMemory::free: a block it did not give");
    }
    block = std::move(it->second);
    blocks_.erase(it);
  }
  return absl::OkStatus();  // `block` goes back to torch's cache here
}

}  // namespace strata::bridge
