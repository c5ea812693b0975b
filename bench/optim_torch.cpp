// bench/optim_torch.cpp: the LibTorch peers of the optimizer benchmarks (bench/optim_torch.h).
#include "bench/optim_torch.h"

#ifdef STRATA_BENCH_TORCH
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_fused_adamw.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/optim/adamw.h>

#include <utility>

namespace strata::bench {
namespace {

constexpr std::size_t kTorchAggregate = 0;  // StatType::AGGREGATE
constexpr c10::DeviceIndex kTorchDevice = 0;
bool g_torch_used = false;

at::TensorOptions f32(at::Device device) {
  return at::TensorOptions().dtype(at::kFloat).device(device);
}

// Float32 step counters, one per parameter, as torch.optim's fused AdamW keeps them.
std::vector<at::Tensor> make_step_counters(const Model& model, at::Device device) {
  std::vector<at::Tensor> out;
  for (int k = 0; k < model.count(); ++k) out.push_back(at::zeros({}, f32(device)));
  return out;
}

}  // namespace

bool torch_used() { return g_torch_used; }

absl::Status make_torch_params(const Model& model, at::Device device,
                               std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads) {
  check_fits(model);
  float* param_src = const_cast<float*>(host_sources().params.data());
  float* grad_src = const_cast<float*>(host_sources().grads.data());
  if (device.is_cuda()) {
    STRATA_ASSIGN_OR_RETURN(DeviceSources d, device_sources());
    param_src = d.params;
    grad_src = d.grads;
  }
  const at::Tensor p_all = at::from_blob(param_src, {kSourceFloats}, f32(device));
  const at::Tensor g_all = at::from_blob(grad_src, {kSourceFloats}, f32(device));
  for (int k = 0; k < model.count(); ++k) {
    params.push_back(p_all.narrow(0, source_offset(k), model.numel(k)).clone());
    grads.push_back(g_all.narrow(0, source_offset(k), model.numel(k)).clone());
  }
  return absl::OkStatus();
}

void torch_fused_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList steps) {
  at::_foreach_add_(steps, at::Scalar(1.0));
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps,
                    /*lr=*/kHyper.lr, /*beta1=*/kHyper.beta1, /*beta2=*/kHyper.beta2,
                    /*weight_decay=*/kHyper.weight_decay, /*eps=*/kHyper.eps, /*amsgrad=*/false,
                    /*maximize=*/false, /*grad_scale=*/std::nullopt, /*found_inf=*/std::nullopt);
}

std::vector<float> to_host_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU).contiguous();
  const float* p = c.data_ptr<float>();
  return std::vector<float>(p, p + c.numel());
}

std::int64_t torch_allocated_now() {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(kTorchDevice)
      .allocated_bytes[kTorchAggregate]
      .current;
}
std::int64_t torch_allocated_peak() {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(kTorchDevice)
      .allocated_bytes[kTorchAggregate]
      .peak;
}
void torch_reset_peak() { c10::cuda::CUDACachingAllocator::resetPeakStats(kTorchDevice); }

absl::StatusOr<std::unique_ptr<TorchResidentRig>> make_torch_resident_rig(const Model& model,
                                                                          at::Device device) {
  g_torch_used = true;
  auto r = std::make_unique<TorchResidentRig>();
  r->device = device;
  STRATA_RETURN_IF_ERROR(make_torch_params(model, device, r->params, r->grads));
  for (const at::Tensor& p : r->params) {
    r->exp_avgs.push_back(at::zeros_like(p));
    r->exp_avg_sqs.push_back(at::zeros_like(p));
  }
  r->steps = make_step_counters(model, device);
  return r;
}

absl::Status torch_resident_step(TorchResidentRig& r) {
  torch_fused_step(r.params, r.grads, r.exp_avgs, r.exp_avg_sqs, r.steps);
  ++r.step_count;
  return absl::OkStatus();
}

absl::Status check_torch_resident(std::string_view what, const Model& model, TorchResidentRig& r) {
  return check_ends(what, model, r.step_count,
                    [&](int k, std::vector<float>& p, std::vector<float>& m) -> absl::Status {
                      p = to_host_vector(r.params[k]);
                      m = to_host_vector(r.exp_avgs[k]);
                      return absl::OkStatus();
                    });
}

absl::StatusOr<std::unique_ptr<TorchOffloadRig>> make_torch_offload_rig(const Model& model) {
  g_torch_used = true;
  auto r = std::make_unique<TorchOffloadRig>();
  STRATA_RETURN_IF_ERROR(make_torch_params(model, at::kCUDA, r->params, r->grads));
  const at::TensorOptions pinned = f32(at::kCPU).pinned_memory(true);
  for (int k = 0; k < model.count(); ++k) {
    r->m_host.push_back(at::empty({model.numel(k)}, pinned).zero_());
    r->v_host.push_back(at::empty({model.numel(k)}, pinned).zero_());
  }
  r->steps = make_step_counters(model, at::kCUDA);
  const auto per = static_cast<std::size_t>(model.per_layer());
  for (int l = 0; l < model.layers; ++l) {
    const std::size_t b = static_cast<std::size_t>(l) * per;
    r->layer_params.emplace_back(r->params.begin() + b, r->params.begin() + b + per);
    r->layer_grads.emplace_back(r->grads.begin() + b, r->grads.begin() + b + per);
    r->layer_steps.emplace_back(r->steps.begin() + b, r->steps.begin() + b + per);
  }
  return r;
}

absl::Status check_torch_offload(std::string_view what, const Model& model, TorchOffloadRig& r) {
  return check_ends(what, model, r.step_count,
                    [&](int k, std::vector<float>& p, std::vector<float>& m) -> absl::Status {
                      p = to_host_vector(r.params[k]);
                      m = to_host_vector(r.m_host[k]);
                      return absl::OkStatus();
                    });
}

absl::Status torch_bulk_step(TorchOffloadRig& r) {
  std::vector<at::Tensor> m_gpu;
  std::vector<at::Tensor> v_gpu;
  m_gpu.reserve(r.m_host.size());
  v_gpu.reserve(r.v_host.size());
  const at::TensorOptions to_cuda = at::TensorOptions().device(at::kCUDA);
  for (std::size_t k = 0; k < r.m_host.size(); ++k) {
    m_gpu.push_back(r.m_host[k].to(to_cuda, /*non_blocking=*/true));
    v_gpu.push_back(r.v_host[k].to(to_cuda, /*non_blocking=*/true));
  }
  torch_fused_step(r.params, r.grads, m_gpu, v_gpu, r.steps);
  for (std::size_t k = 0; k < r.m_host.size(); ++k) {
    r.m_host[k].copy_(m_gpu[k], /*non_blocking=*/true);
    r.v_host[k].copy_(v_gpu[k], /*non_blocking=*/true);
  }
  ++r.step_count;
  return absl::OkStatus();  // m_gpu / v_gpu go back to the cache; the stream still orders them
}

absl::Status torch_pipeline_step(const Model& model, TorchOffloadRig& r, int slots) {
  if (slots < 2) return absl::InvalidArgumentError(str_cat("pipeline slots ", slots, " < 2"));
  const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream();
  const int per = model.per_layer();
  const auto n = static_cast<std::size_t>(slots);
  std::vector<at::Tensor> slot(n);
  std::vector<std::vector<at::Tensor>> slot_m(n);
  std::vector<std::vector<at::Tensor>> slot_v(n);
  for (std::size_t s = 0; s < n; ++s) {
    slot[s] = at::empty({2 * model.layer_numel()}, f32(at::kCUDA));
    for (int j = 0; j < per; ++j) {
      slot_m[s].push_back(slot[s].narrow(0, model.offset_in_layer(j), model.tensor_numel[j]));
      slot_v[s].push_back(
          slot[s].narrow(0, model.layer_numel() + model.offset_in_layer(j), model.tensor_numel[j]));
    }
  }
  std::vector<c10::cuda::CUDAEvent> arrived(n);
  std::vector<c10::cuda::CUDAEvent> computed(n);
  std::vector<c10::cuda::CUDAEvent> freed(n);  // not yet recorded: block() is a no-op

  auto fetch = [&](int layer) {
    const auto s = static_cast<std::size_t>(layer % slots);
    c10::cuda::CUDAStreamGuard guard(r.h2d);
    freed[s].block(r.h2d);
    for (int j = 0; j < per; ++j) {
      const std::size_t k = static_cast<std::size_t>(layer * per + j);
      slot_m[s][j].copy_(r.m_host[k], /*non_blocking=*/true);
      slot_v[s][j].copy_(r.v_host[k], /*non_blocking=*/true);
    }
    arrived[s].record(r.h2d);
  };
  for (int layer = 0; layer < std::min(slots - 1, model.layers); ++layer) fetch(layer);
  for (int layer = 0; layer < model.layers; ++layer) {
    const auto s = static_cast<std::size_t>(layer % slots);
    if (layer + slots - 1 < model.layers) fetch(layer + slots - 1);
    arrived[s].block(compute);
    torch_fused_step(r.layer_params[layer], r.layer_grads[layer], slot_m[s], slot_v[s],
                     r.layer_steps[layer]);
    computed[s].record(compute);
    c10::cuda::CUDAStreamGuard guard(r.d2h);
    computed[s].block(r.d2h);
    for (int j = 0; j < per; ++j) {
      const std::size_t k = static_cast<std::size_t>(layer * per + j);
      r.m_host[k].copy_(slot_m[s][j], /*non_blocking=*/true);
      r.v_host[k].copy_(slot_v[s][j], /*non_blocking=*/true);
    }
    freed[s].record(r.d2h);
  }
  ++r.step_count;
  // The slots are used on three streams: wait for all of them before they go back to the cache.
  r.d2h.synchronize();
  compute.synchronize();
  r.h2d.synchronize();
  return absl::OkStatus();
}

TorchCpuRig::~TorchCpuRig() = default;

absl::StatusOr<std::unique_ptr<TorchCpuRig>> make_torch_cpu_rig(const Model& model) {
  auto r = std::make_unique<TorchCpuRig>();
  std::vector<at::Tensor> grads;
  STRATA_RETURN_IF_ERROR(make_torch_params(model, at::kCPU, r->params, grads));
  for (std::size_t k = 0; k < r->params.size(); ++k) {
    r->params[k].requires_grad_(true);
    r->params[k].mutable_grad() = grads[k];
  }
  r->optimizer = std::make_unique<torch::optim::AdamW>(
      r->params, torch::optim::AdamWOptions(kHyper.lr)
                     .betas(std::make_tuple(static_cast<double>(kHyper.beta1),
                                            static_cast<double>(kHyper.beta2)))
                     .eps(kHyper.eps)
                     .weight_decay(kHyper.weight_decay));
  return r;
}

absl::Status torch_cpu_step(TorchCpuRig& r) {
  r.optimizer->step();
  ++r.step_count;
  return absl::OkStatus();
}

absl::Status check_torch_cpu(std::string_view what, const Model& model, TorchCpuRig& r) {
  return check_ends(what, model, r.step_count,
                    [&](int k, std::vector<float>& p, std::vector<float>& m) -> absl::Status {
                      p = to_host_vector(r.params[k].detach());
                      m.clear();
                      return absl::OkStatus();
                    });
}

}  // namespace strata::bench

#endif  // STRATA_BENCH_TORCH
