// bench/mixed_rig.h: the mixed-precision optimizer benchmarks' shared rig: bfloat16 parameters and
// gradients with float32 master weights and Adam moments (12 bytes of optimizer state a
// parameter), under strata and the best ways PyTorch offers, on the same shapes and values. Used
// by strata_mixed_bench (Google Benchmark, one approach at a time) and the "mixed" part of
// strata_optim_compare (the approaches in alternation). Declares nothing without LibTorch and
// CUDA (STRATA_BENCH_TORCH, bench/optim_torch.h).
//
// Model: 24 layers of four bfloat16 tensors (12e6, 4e6, 16e6, 16e6 elements: a width-2000
// transformer block's matrices), 1.152e9 parameters; AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8,
// weight decay 0.01. Parameters and gradients are random (torch's generator, one seed for every
// approach); the gradients stay fixed.
//
// Example:
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<MixedStrataRig> r,
//                           make_mixed_strata_rig("layer_prefetch", /*depth=*/1));
//   STRATA_RETURN_IF_ERROR(mixed_strata_step(*r));
//   STRATA_RETURN_IF_ERROR(check_mixed_strata(*r));
#pragma once

#include "bench/optim_torch.h"

#ifdef STRATA_BENCH_TORCH
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "optim/adam.h"
#include "runtime/runtime.h"

namespace strata::bench {

inline constexpr int kMixedLayers = 24;
inline constexpr std::array<std::int64_t, 4> kMixedTensorNumel = {12'000'000, 4'000'000, 16'000'000,
                                                                  16'000'000};
inline constexpr std::int64_t kMixedLayerNumel = 48'000'000;
inline constexpr int kMixedTensors = kMixedLayers * 4;
// Master weights and both moments, float32: what offloading moves each way.
inline constexpr double kMixedStateBytesPerParam = 12;
inline constexpr optim::AdamHyper kMixedHyper{
    .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};

inline double mixed_params() { return static_cast<double>(kMixedLayers) * kMixedLayerNumel; }
inline double mixed_state_bytes() { return kMixedStateBytesPerParam * mixed_params(); }

// Pinned host buffers (pointer, bytes) a floor pass covers.
using HostBuffers = std::vector<std::pair<void*, std::size_t>>;

// Note [Own-memory floor]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A rig's link passes read the link through the rig's own pinned buffers, and on some hosts a
// streamed step moves its bytes faster than they do (an H200, 2026-11-24: the step at 46.4 GB/s per
// direction, the rig at 45.6), so the rig's floor under-reads the link the step sees. This floor is
// taken over the step's own memory: right before each step, one pass copies every pinned state
// buffer to a GPU scratch buffer while, at the same time on a second stream, a GPU mirror of the
// same bytes is copied back into those buffers, tensor by tensor as the step copies them. The
// mirror is refreshed from the buffers just before (untimed), so what is written back is what is
// there. The floor is the pass's span: the bytes each way over both directions at once, with no
// compute and no dependency between them.
class OwnMemoryFloor {
 public:
  OwnMemoryFloor() = default;
  OwnMemoryFloor(const OwnMemoryFloor&) = delete;
  OwnMemoryFloor& operator=(const OwnMemoryFloor&) = delete;
  ~OwnMemoryFloor();

  // Scratch for `bytes` (two GPU buffers of that size).
  absl::Status init(std::size_t bytes);
  // One pass over `buffers`; its span in ms.
  absl::StatusOr<double> pass_ms(const HostBuffers& buffers);

 private:
  std::size_t bytes_ = 0;
  std::array<void*, 2> gpu_{};  // 0: the H2D destination; 1: the mirror the D2H reads
  std::array<cudaStream_t, 2> stream_{};
  std::array<cudaEvent_t, 2> start_{};
  std::array<cudaEvent_t, 2> end_{};
};

// strata: optim::Adam over the bfloat16 model, the masters and moments placed by `policy`
// (layer_prefetch streams them, optimizer_states only, `depth` layers ahead; keep_on_gpu keeps
// them on the GPU). Parameters and gradients stay on the GPU.
struct MixedStrataRig {
  std::string policy;
  int depth = 1;
  std::unique_ptr<rt::Runtime> runtime;
  std::unique_ptr<optim::Adam> adam;
  std::vector<rt::TensorHandle> params;
  std::int64_t steps = 0;
};
absl::StatusOr<std::unique_ptr<MixedStrataRig>> make_mixed_strata_rig(const std::string& policy,
                                                                      int depth = 1);
absl::Status mixed_strata_step(MixedStrataRig& r);
// The masters and moments where they rest between steps (pinned memory under layer_prefetch).
absl::StatusOr<HostBuffers> mixed_strata_buffers(MixedStrataRig& r);
// The first checked masters of the first and last tensors against float32 AdamW on the host.
absl::Status check_mixed_strata(MixedStrataRig& r);

// PyTorch: bfloat16 parameters and gradients on the GPU, float32 masters and moments on the GPU or
// in pinned CPU tensors.
struct TorchMixedModel {
  std::vector<at::Tensor> params, grads;  // bfloat16, on the GPU
  std::vector<at::Tensor> masters, m, v;  // float32: on the GPU, or pinned on the host
  std::vector<at::Tensor> steps;          // float32 scalars on the GPU, one per tensor
  bool pinned = false;
  std::int64_t step_count = 0;
  c10::cuda::CUDAStream h2d = c10::cuda::getStreamFromPool();
  c10::cuda::CUDAStream d2h = c10::cuda::getStreamFromPool();
};
absl::StatusOr<std::unique_ptr<TorchMixedModel>> make_torch_mixed_model(bool pinned);
// Resident: gradients cast to float32, at::_fused_adamw_ over the masters, parameters copied from
// them (_foreach_copy_).
absl::Status torch_mixed_resident_step(TorchMixedModel& t);
// PyTorch's best way to stream the same state: a per-layer pipeline with one stream per direction
// and `slots` (>= 2) GPU slots, the gradients cast to float32, at::_fused_adamw_ on the slot, the
// bfloat16 parameters copied from the slot's masters. Returns once every stream is done.
absl::Status torch_mixed_pipeline_step(TorchMixedModel& t, int slots = 2);
HostBuffers torch_mixed_buffers(TorchMixedModel& t);
absl::Status check_mixed_torch(std::string_view what, TorchMixedModel& t);

}  // namespace strata::bench

#endif  // STRATA_BENCH_TORCH
