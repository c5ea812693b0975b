// bench/mixed_rig.cpp: the mixed-precision benchmarks' rig (bench/mixed_rig.h).
#include "bench/mixed_rig.h"

#ifdef STRATA_BENCH_TORCH
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "base/status.h"
#include "base/strings.h"
#include "policies/builtin.h"

namespace strata::bench {
namespace {

constexpr std::uint64_t kSeed = 20261124;
constexpr std::int64_t kChecked = 1024;

// The k-th tensor's bfloat16 parameter and gradient, the same for every approach.
std::pair<at::Tensor, at::Tensor> sources(int k) {
  at::manual_seed(kSeed + static_cast<std::uint64_t>(k));
  const std::int64_t n = kMixedTensorNumel[static_cast<std::size_t>(k % 4)];
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  at::Tensor p = at::randn({n}, bf16);
  at::Tensor g = at::randn({n}, bf16) * 0.01;
  return {p, g};
}

// float32 AdamW on the host over the first kChecked elements of tensor k, `steps` steps.
std::vector<float> expected_masters(int k, std::int64_t steps) {
  auto [p, g] = sources(k);
  const at::Tensor hp = p.narrow(0, 0, kChecked).to(at::kCPU).to(at::kFloat);
  const at::Tensor hg = g.narrow(0, 0, kChecked).to(at::kCPU).to(at::kFloat);
  std::vector<float> master(hp.data_ptr<float>(), hp.data_ptr<float>() + kChecked);
  std::vector<float> m(kChecked, 0), v(kChecked, 0);
  for (std::int64_t s = 1; s <= steps; ++s) {
    const optim::AdamScalars sc = optim::adam_scalars(kMixedHyper, s);
    for (std::int64_t i = 0; i < kChecked; ++i) {
      optim::adam_element(master[i], hg.data_ptr<float>()[i], m[i], v[i], nullptr, sc, 1.0f);
    }
  }
  return master;
}

// Within 1e-5 relative: the GPU fuses multiply-adds.
absl::Status check_masters(std::string_view what, int k, const float* got, std::int64_t steps) {
  const std::vector<float> want = expected_masters(k, steps);
  for (std::int64_t i = 0; i < kChecked; ++i) {
    if (std::abs(got[i] - want[i]) > 1e-5 * std::abs(want[i]) + 1e-7) {
      return absl::InternalError(str_cat(what, ": tensor ", k, " master ", i, " is ", got[i],
                                         " after ", steps, " steps; float32 AdamW gives ",
                                         want[i]));
    }
  }
  return absl::OkStatus();
}

void fused_adamw(at::TensorList masters, at::TensorList grads, at::TensorList m, at::TensorList v,
                 at::TensorList steps) {
  at::_foreach_add_(steps, at::Scalar(1.0));
  at::_fused_adamw_(masters, grads, m, v, /*max_exp_avg_sqs=*/{}, steps, kMixedHyper.lr,
                    kMixedHyper.beta1, kMixedHyper.beta2, kMixedHyper.weight_decay, kMixedHyper.eps,
                    /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt,
                    /*found_inf=*/std::nullopt);
}

absl::Status torch_error(const std::exception& e) { return absl::InternalError(e.what()); }

}  // namespace

OwnMemoryFloor::~OwnMemoryFloor() {
  for (int d = 0; d < 2; ++d) {
    if (stream_[d] != nullptr) (void)cudaStreamSynchronize(stream_[d]);
    if (start_[d] != nullptr) (void)cudaEventDestroy(start_[d]);
    if (end_[d] != nullptr) (void)cudaEventDestroy(end_[d]);
    if (stream_[d] != nullptr) (void)cudaStreamDestroy(stream_[d]);
    if (gpu_[d] != nullptr) (void)cudaFree(gpu_[d]);
  }
}

absl::Status OwnMemoryFloor::init(std::size_t bytes) {
  bytes_ = bytes;
  for (int d = 0; d < 2; ++d) {
    STRATA_RETURN_IF_ERROR(cuda_status(cudaMalloc(&gpu_[d], bytes), "cudaMalloc"));
    STRATA_RETURN_IF_ERROR(cuda_status(
        cudaStreamCreateWithFlags(&stream_[d], cudaStreamNonBlocking), "cudaStreamCreate"));
    STRATA_RETURN_IF_ERROR(cuda_status(cudaEventCreate(&start_[d]), "cudaEventCreate"));
    STRATA_RETURN_IF_ERROR(cuda_status(cudaEventCreate(&end_[d]), "cudaEventCreate"));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> OwnMemoryFloor::pass_ms(const HostBuffers& buffers) {
  std::size_t offset = 0;
  for (const auto& [ptr, n] : buffers) {
    if (offset + n > bytes_) return absl::InternalError("own-memory floor: buffers outgrew it");
    STRATA_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(static_cast<char*>(gpu_[1]) + offset, ptr, n,
                                                       cudaMemcpyHostToDevice, stream_[1]),
                                       "cudaMemcpyAsync (mirror)"));
    offset += n;
  }
  STRATA_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(stream_[1]), "sync (mirror)"));
  for (int d = 0; d < 2; ++d) {
    STRATA_RETURN_IF_ERROR(cuda_status(cudaEventRecord(start_[d], stream_[d]), "record"));
  }
  offset = 0;
  for (const auto& [ptr, n] : buffers) {
    char* const at = static_cast<char*>(gpu_[0]) + offset;
    char* const back = static_cast<char*>(gpu_[1]) + offset;
    STRATA_RETURN_IF_ERROR(cuda_status(
        cudaMemcpyAsync(at, ptr, n, cudaMemcpyHostToDevice, stream_[0]), "cudaMemcpyAsync"));
    STRATA_RETURN_IF_ERROR(cuda_status(
        cudaMemcpyAsync(ptr, back, n, cudaMemcpyDeviceToHost, stream_[1]), "cudaMemcpyAsync"));
    offset += n;
  }
  for (int d = 0; d < 2; ++d) {
    STRATA_RETURN_IF_ERROR(cuda_status(cudaEventRecord(end_[d], stream_[d]), "record"));
  }
  for (int d = 0; d < 2; ++d) {
    STRATA_RETURN_IF_ERROR(cuda_status(cudaEventSynchronize(end_[d]), "cudaEventSynchronize"));
  }
  float last = 0, other_start = 0, other_end = 0;
  STRATA_RETURN_IF_ERROR(cuda_status(cudaEventElapsedTime(&last, start_[0], end_[0]), "elapsed"));
  STRATA_RETURN_IF_ERROR(
      cuda_status(cudaEventElapsedTime(&other_start, start_[0], start_[1]), "elapsed"));
  STRATA_RETURN_IF_ERROR(
      cuda_status(cudaEventElapsedTime(&other_end, start_[0], end_[1]), "elapsed"));
  const float first = std::min(0.0f, other_start);
  return static_cast<double>(std::max(last, other_end) - first);
}

absl::StatusOr<std::unique_ptr<MixedStrataRig>> make_mixed_strata_rig(const std::string& policy,
                                                                      int depth) {
  auto r = std::make_unique<MixedStrataRig>();
  r->policy = policy;
  r->depth = depth;
  rt::RuntimeOptions options;
  options.device = rt::DeviceKind::kCuda;
  options.policy = policy;
  options.policy_config.prefetch_depth = depth;
  options.policy_config.roles = rt::RoleSet::optimizer_states();
  STRATA_ASSIGN_OR_RETURN(r->runtime,
                          rt::Runtime::create(std::move(options), policy::builtin_policies()));
  optim::AdamOptions o;
  o.groups.push_back({.params = {}, .hyper = kMixedHyper});
  try {
    for (int k = 0; k < kMixedTensors; ++k) {
      auto [p, g] = sources(k);
      const rt::TensorSpec ps{str_cat("t", k),      k / 4,       rt::Role::kParameter,
                              rt::DType::kBFloat16, {p.numel()}, rt::Tier::kGpu};
      rt::TensorSpec gs = ps;
      gs.name = str_cat("t", k, ".grad");
      gs.role = rt::Role::kGradient;
      STRATA_ASSIGN_OR_RETURN(rt::TensorHandle ph, r->runtime->register_tensor(ps, p.data_ptr()));
      STRATA_ASSIGN_OR_RETURN(rt::TensorHandle gh, r->runtime->register_tensor(gs, g.data_ptr()));
      o.groups[0].params.push_back({ph, gh});
      r->params.push_back(ph);
    }
  } catch (const std::exception& e) {
    return torch_error(e);
  }
  c10::cuda::CUDACachingAllocator::emptyCache();  // the sources, copied into strata's memory
  STRATA_ASSIGN_OR_RETURN(r->adam, optim::Adam::create(*r->runtime, o));
  return r;
}

absl::Status mixed_strata_step(MixedStrataRig& r) {
  STRATA_RETURN_IF_ERROR(r.adam->step());
  ++r.steps;
  return absl::OkStatus();
}

absl::StatusOr<HostBuffers> mixed_strata_buffers(MixedStrataRig& r) {
  STRATA_RETURN_IF_ERROR(r.runtime->wait_all());
  HostBuffers out;
  for (rt::TensorHandle p : r.params) {
    STRATA_ASSIGN_OR_RETURN(std::vector<rt::TensorHandle> st, r.adam->state(p));
    for (rt::TensorHandle h : st) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, r.runtime->info(h));
      if (info.tier != rt::Tier::kPinnedHost || info.in_flight) {
        return absl::InternalError(str_cat(info.spec.name, " is not at rest in pinned memory"));
      }
      out.emplace_back(info.data, info.bytes);
    }
  }
  return out;
}

absl::Status check_mixed_strata(MixedStrataRig& r) {
  for (int k : {0, kMixedTensors - 1}) {
    STRATA_ASSIGN_OR_RETURN(std::vector<rt::TensorHandle> st,
                            r.adam->state(r.params[static_cast<std::size_t>(k)]));
    std::vector<float> master(static_cast<std::size_t>(kMixedTensorNumel[k % 4]));
    STRATA_RETURN_IF_ERROR(r.runtime->read(st.back(), master.data()));
    STRATA_RETURN_IF_ERROR(check_masters(str_cat("strata ", r.policy), k, master.data(), r.steps));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TorchMixedModel>> make_torch_mixed_model(bool pinned) {
  try {
    auto t = std::make_unique<TorchMixedModel>();
    t->pinned = pinned;
    for (int k = 0; k < kMixedTensors; ++k) {
      auto [p, g] = sources(k);
      at::Tensor master = p.to(at::kFloat);
      const auto where =
          pinned ? at::TensorOptions().dtype(at::kFloat).pinned_memory(true) : master.options();
      if (pinned) master = master.to(at::kCPU).pin_memory();
      t->params.push_back(p);
      t->grads.push_back(g);
      t->masters.push_back(master);
      t->m.push_back(at::zeros({p.numel()}, where));
      t->v.push_back(at::zeros({p.numel()}, where));
      t->steps.push_back(at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA)));
    }
    return t;
  } catch (const std::exception& e) {
    return torch_error(e);
  }
}

absl::Status torch_mixed_resident_step(TorchMixedModel& t) {
  try {
    std::vector<at::Tensor> g32;
    for (const at::Tensor& g : t.grads) g32.push_back(g.to(at::kFloat));
    fused_adamw(t.masters, g32, t.m, t.v, t.steps);
    at::_foreach_copy_(t.params, t.masters);
  } catch (const std::exception& e) {
    return torch_error(e);
  }
  ++t.step_count;
  return absl::OkStatus();
}

absl::Status torch_mixed_pipeline_step(TorchMixedModel& t, int slots) {
  if (slots < 2) return absl::InvalidArgumentError(str_cat("pipeline slots ", slots, " < 2"));
  if (!t.pinned) return absl::FailedPreconditionError("the pipeline streams pinned states");
  try {
    const auto n = static_cast<std::size_t>(slots);
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
    // Per slot: one layer's masters, exp_avg and exp_avg_sq.
    std::vector<std::array<std::vector<at::Tensor>, 3>> slot(n);
    for (auto& s : slot) {
      for (auto& x : s) {
        for (std::int64_t numel : kMixedTensorNumel) x.push_back(at::empty({numel}, f32));
      }
    }
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream();
    std::vector<at::cuda::CUDAEvent> arrived(n), computed(n), freed(n);
    auto host = [&](int x, int k) -> at::Tensor& {
      return x == 0 ? t.masters[k] : x == 1 ? t.m[k] : t.v[k];
    };
    auto fetch = [&](int layer) {
      const auto s = static_cast<std::size_t>(layer % slots);
      c10::cuda::CUDAStreamGuard guard(t.h2d);
      freed[s].block(t.h2d);
      for (int x = 0; x < 3; ++x) {
        for (int j = 0; j < 4; ++j) slot[s][x][j].copy_(host(x, layer * 4 + j), true);
      }
      arrived[s].record(t.h2d);
    };
    for (int layer = 0; layer < std::min(slots - 1, kMixedLayers); ++layer) fetch(layer);
    for (int layer = 0; layer < kMixedLayers; ++layer) {
      const auto s = static_cast<std::size_t>(layer % slots);
      if (layer + slots - 1 < kMixedLayers) fetch(layer + slots - 1);
      arrived[s].block(compute);
      std::vector<at::Tensor> g32, p, st;
      for (int j = 0; j < 4; ++j) {
        g32.push_back(t.grads[layer * 4 + j].to(at::kFloat));
        p.push_back(t.params[layer * 4 + j]);
        st.push_back(t.steps[layer * 4 + j]);
      }
      fused_adamw(slot[s][0], g32, slot[s][1], slot[s][2], st);
      at::_foreach_copy_(p, slot[s][0]);
      computed[s].record(compute);
      c10::cuda::CUDAStreamGuard guard(t.d2h);
      computed[s].block(t.d2h);
      for (int x = 0; x < 3; ++x) {
        for (int j = 0; j < 4; ++j) host(x, layer * 4 + j).copy_(slot[s][x][j], true);
      }
      freed[s].record(t.d2h);
    }
    // The slots are used on three streams: wait for all of them before they go back to the cache.
    t.d2h.synchronize();
    compute.synchronize();
    t.h2d.synchronize();
  } catch (const std::exception& e) {
    return torch_error(e);
  }
  ++t.step_count;
  return absl::OkStatus();
}

HostBuffers torch_mixed_buffers(TorchMixedModel& t) {
  HostBuffers out;
  for (int k = 0; k < kMixedTensors; ++k) {
    for (const at::Tensor* h : {&t.masters[k], &t.m[k], &t.v[k]}) {
      out.emplace_back(h->data_ptr(), h->nbytes());
    }
  }
  return out;
}

absl::Status check_mixed_torch(std::string_view what, TorchMixedModel& t) {
  try {
    for (int k : {0, kMixedTensors - 1}) {
      const at::Tensor h = t.masters[k].narrow(0, 0, kChecked).to(at::kCPU).contiguous();
      STRATA_RETURN_IF_ERROR(check_masters(what, k, h.data_ptr<float>(), t.step_count));
    }
  } catch (const std::exception& e) {
    return torch_error(e);
  }
  return absl::OkStatus();
}

}  // namespace strata::bench

#endif  // STRATA_BENCH_TORCH
