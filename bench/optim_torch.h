// bench/optim_torch.h: the LibTorch peers of the optimizer benchmarks, on the same model and
// values as strata's rig (bench/optim_common.h): PyTorch's fused AdamW with everything resident,
// the moments in pinned CPU tensors moved in bulk (.to) or by a per-layer pipeline with LibTorch
// streams and a given number of GPU slots, the fused AdamW on the CPU over CPU tensors, and
// torch::optim::AdamW on the CPU. STRATA_BENCH_TORCH (bench/bench_util.h) is defined when LibTorch
// and CUDA are both there; without it this header declares nothing.
//
// Example:
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<TorchOffloadRig> r, make_torch_offload_rig(model));
//   STRATA_ASSIGN_OR_RETURN(double ms,
//                           time_to_idle([&] { return torch_pipeline_step(model, *r, 2); }));
//   STRATA_RETURN_IF_ERROR(check_torch_offload("pipeline", model, *r));
#pragma once

#include "bench/optim_common.h"

#ifdef STRATA_BENCH_TORCH
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace torch::optim {
class AdamW;
}  // namespace torch::optim

namespace strata::bench {

// True once a LibTorch rig was made: the caller then empties LibTorch's caches between
// approaches.
bool torch_used();

// Parameters and gradients of `model` from the same sources as strata's, on `device`.
absl::Status make_torch_params(const Model& model, at::Device device,
                               std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads);

// One fused AdamW step (kHyper) over the lists, queued on the current stream of their device: the
// float32 step counters first, as torch.optim.AdamW(fused=True).step() does.
void torch_fused_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList steps);

std::vector<float> to_host_vector(const at::Tensor& t);

// The CUDA caching allocator's allocated bytes on device 0, now and at the peak since the last
// c10::cuda::CUDACachingAllocator::resetPeakStats.
std::int64_t torch_allocated_now();
std::int64_t torch_allocated_peak();
void torch_reset_peak();

// Everything resident on the GPU (or, with device kCPU, in CPU memory: torch.optim.AdamW(
// fused=True) on the CPU).
struct TorchResidentRig final : Rig {
  at::Device device = at::kCUDA;
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  std::int64_t step_count = 0;
};
absl::StatusOr<std::unique_ptr<TorchResidentRig>> make_torch_resident_rig(
    const Model& model, at::Device device = at::kCUDA);
absl::Status torch_resident_step(TorchResidentRig& r);
absl::Status check_torch_resident(std::string_view what, const Model& model, TorchResidentRig& r);

// Moments in pinned host tensors (LibTorch's pinned allocator), parameters and gradients on the
// GPU: the state of the bulk .to() round trip and of the per-layer pipeline.
struct TorchOffloadRig final : Rig {
  std::vector<at::Tensor> params, grads, m_host, v_host, steps;
  // Per layer, for the pipeline.
  std::vector<std::vector<at::Tensor>> layer_params, layer_grads, layer_steps;
  c10::cuda::CUDAStream h2d = c10::cuda::getStreamFromPool();
  c10::cuda::CUDAStream d2h = c10::cuda::getStreamFromPool();
  std::int64_t step_count = 0;
};
absl::StatusOr<std::unique_ptr<TorchOffloadRig>> make_torch_offload_rig(const Model& model);
absl::Status check_torch_offload(std::string_view what, const Model& model, TorchOffloadRig& r);

// The bulk round trip, PyTorch style: every moment .to(cuda, non_blocking), one fused step, every
// moment copied back into its pinned tensor (non_blocking); the caller synchronizes.
absl::Status torch_bulk_step(TorchOffloadRig& r);

// The per-layer pipeline with LibTorch streams and `slots` (>= 2) GPU slots of one layer's
// moments, allocated for the step from the caching allocator: the H2D stream fetches up to
// slots - 1 layers ahead, each into a slot once the D2H that emptied it is done; the compute
// stream (current) waits for a layer's arrival and runs the fused step on it; the D2H stream waits
// for that and copies the layer's moments back into their pinned tensors. Returns once all three
// streams are done.
absl::Status torch_pipeline_step(const Model& model, TorchOffloadRig& r, int slots = 2);

// torch::optim::AdamW (kHyper) over CPU tensors, the gradients set once: the scaled CPU peer of
// strata_optim_bench. CPU memory only, so making it leaves torch_used() as it was.
struct TorchCpuRig final : Rig {
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::AdamW> optimizer;
  std::int64_t step_count = 0;
  ~TorchCpuRig() override;
};
absl::StatusOr<std::unique_ptr<TorchCpuRig>> make_torch_cpu_rig(const Model& model);
absl::Status torch_cpu_step(TorchCpuRig& r);
// The parameters only: the optimizer's state is not read, and the parameters depend on it.
absl::Status check_torch_cpu(std::string_view what, const Model& model, TorchCpuRig& r);

}  // namespace strata::bench

#endif  // STRATA_BENCH_TORCH
