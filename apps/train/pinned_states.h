// apps/train/pinned_states.h (internal to apps/train/): the Adam states of strata-train's `.to()`
// baseline, kept as PyTorch offers at its best and as the optimizer benchmark's BM_TorchBulkTo peer
// keeps them: at rest in pinned host tensors; before a step they come to the GPU with non_blocking
// copies on a side stream that the step waits for (on the GPU, not the host), and after it they go
// back into the same pinned tensors on a second side stream that waits for the step. Without CUDA
// (the simulated runs) the states simply move with .to().
//
// Example (each step):
//   PinnedStates pinned;
//   pinned.to_gpu(optimizer.states(), device);  // nothing the first time: the step makes them
//   optimizer.step();
//   pinned.to_host(optimizer.states());
#pragma once

#include <torch/torch.h>

#include <optional>
#include <vector>

#ifdef STRATA_HAS_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace strata::apps {

class PinnedStates {
 public:
  void to_gpu(const std::vector<torch::Tensor*>& states, torch::Device device) {
    if (!device.is_cuda()) {
      for (torch::Tensor* t : states) *t = t->to(device);
      return;
    }
#ifdef STRATA_HAS_CUDA
    if (!h2d_) h2d_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(device.index());
    // The pinned tensors are read once their last write-back is done.
    if (written_back_) written_back_->block(*h2d_);
    std::vector<torch::Tensor> on_gpu;
    on_gpu.reserve(states.size());
    {
      const c10::cuda::CUDAStreamGuard guard(*h2d_);
      for (torch::Tensor* t : states) on_gpu.push_back(t->to(device, /*non_blocking=*/true));
    }
    at::cuda::CUDAEvent arrived;
    arrived.record(*h2d_);
    arrived.block(compute);
    for (std::size_t i = 0; i < states.size(); ++i) {
      // Allocated for the copy stream and used on the compute stream: the cache must not reuse
      // the memory before the compute stream is done with it.
      c10::cuda::CUDACachingAllocator::recordStream(on_gpu[i].storage().data_ptr(), compute);
      *states[i] = on_gpu[i];
    }
#endif
  }

  void to_host(const std::vector<torch::Tensor*>& states) {
    if (states.empty() || !states.front()->is_cuda()) {
      for (torch::Tensor* t : states) *t = t->to(torch::kCPU);
      return;
    }
#ifdef STRATA_HAS_CUDA
    const c10::DeviceIndex index = states.front()->device().index();
    if (!d2h_) d2h_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
    if (pinned_.size() != states.size()) {
      // Once: pinning is slow (the first step pays it), and torch would otherwise pin anew per
      // copy.
      pinned_.clear();
      for (torch::Tensor* t : states) {
        pinned_.push_back(
            torch::empty(t->sizes(), t->options().device(torch::kCPU).pinned_memory(true)));
      }
    }
    at::cuda::CUDAEvent stepped;
    stepped.record(c10::cuda::getCurrentCUDAStream(index));
    stepped.block(*d2h_);
    {
      const c10::cuda::CUDAStreamGuard guard(*d2h_);
      for (std::size_t i = 0; i < states.size(); ++i) {
        pinned_[i].copy_(*states[i], /*non_blocking=*/true);
        // Freed below on the compute stream's order: not reused before the copy has read it.
        c10::cuda::CUDACachingAllocator::recordStream(states[i]->storage().data_ptr(), *d2h_);
      }
    }
    written_back_.emplace();
    written_back_->record(*d2h_);
    for (std::size_t i = 0; i < states.size(); ++i) *states[i] = pinned_[i];
#endif
  }

 private:
  std::vector<torch::Tensor> pinned_;  // one per state, made at the first write-back
#ifdef STRATA_HAS_CUDA
  std::optional<c10::cuda::CUDAStream> h2d_;
  std::optional<c10::cuda::CUDAStream> d2h_;
  std::optional<at::cuda::CUDAEvent> written_back_;
#endif
};

}  // namespace strata::apps
