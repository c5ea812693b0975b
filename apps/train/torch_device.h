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

}  // namespace strata::apps
