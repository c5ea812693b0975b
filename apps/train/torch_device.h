// apps/train/torch_device.h (internal to apps/train/): the few things every part of strata-train
// does with torch's device: wall-clock timing after a synchronize, and torch's CUDA cache.
//
// Example:
//   const Clock::time_point start = Clock::now();
//   ...; synchronize(options);
//   const double ms = ms_since(start);
#pragma once

#include <torch/torch.h>

#include <chrono>

#include "apps/train/train.h"

#ifdef STRATA_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace strata::apps {

using Clock = std::chrono::steady_clock;

inline double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

inline torch::Device device_of(const TrainOptions& o) {
  return o.cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
}

inline void synchronize(const TrainOptions& o) {
  if (o.cuda) torch::cuda::synchronize();
}

// Waits for torch's current stream only: copies on other streams may still run.
inline void synchronize_torch_stream(const TrainOptions& o) {
#ifdef STRATA_HAS_CUDA
  if (o.cuda) c10::cuda::getCurrentCUDAStream().synchronize();
#else
  (void)o;
#endif
}

// torch sets up its CUDA allocator lazily, on the first CUDA tensor; its statistics calls fail
// ("Invalid device argument") before that, so the first of them sets it up.
inline void init_torch_cuda(const TrainOptions& o) {
#ifdef STRATA_HAS_CUDA
  if (o.cuda) at::globalContext().lazyInitDevice(at::kCUDA);
#else
  (void)o;
#endif
}

// Gives torch's cached GPU memory back to the driver.
inline void release_torch_cache(const TrainOptions& o) {
  init_torch_cuda(o);
#ifdef STRATA_HAS_CUDA
  if (o.cuda) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

// Reads float scalars on the host by a kernel that writes them into pinned memory, where .item()
// would copy them through a copy engine: there such a copy queues behind the write-backs a strata
// step leaves running (Note [Step end] in train.cpp), and a step's end, or the next one, would
// wait for them. Without CUDA it is .item().
//
// Example:
//   ScalarReader reader(options);
//   std::vector<float> v = reader.read({loss, grad_norm});  // one wait for torch's stream
class ScalarReader {
 public:
  explicit ScalarReader(const TrainOptions& o) : o_(o) {}

  // The values of 0-dim tensors (an undefined one reads 0), converted to float.
  std::vector<float> read(const std::vector<torch::Tensor>& scalars) {
    std::vector<float> out(scalars.size(), 0.0f);
    if (!o_.cuda) {
      for (std::size_t i = 0; i < scalars.size(); ++i) {
        if (scalars[i].defined()) out[i] = scalars[i].item<float>();
      }
      return out;
    }
    const auto n = static_cast<std::int64_t>(scalars.size());
    if (!host_.defined() || host_.numel() < n) {
      host_ = torch::empty({n}, torch::TensorOptions().dtype(torch::kFloat).pinned_memory(true));
      // Pinned memory is mapped into the GPU's address space at the same address (unified
      // addressing): as a CUDA tensor, kernels write it directly.
      on_gpu_ = torch::from_blob(host_.data_ptr(), {n},
                                 torch::TensorOptions().dtype(torch::kFloat).device(device_of(o_)));
      one_ = torch::ones({}, torch::TensorOptions().dtype(torch::kFloat).device(device_of(o_)));
    }
    for (std::int64_t i = 0; i < n; ++i) {
      if (!scalars[i].defined()) continue;
      torch::Tensor slot = on_gpu_.select(0, i);
      at::mul_out(slot, scalars[i].to(torch::kFloat), one_);
    }
    synchronize_torch_stream(o_);
    const float* values = host_.data_ptr<float>();
    for (std::int64_t i = 0; i < n; ++i) {
      if (scalars[i].defined()) out[i] = values[i];
    }
    return out;
  }

 private:
  const TrainOptions& o_;
  torch::Tensor host_;    // pinned
  torch::Tensor on_gpu_;  // host_'s memory as a CUDA tensor
  torch::Tensor one_;
};

}  // namespace strata::apps
