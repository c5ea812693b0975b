// bench/mixed_bench.cpp: the mixed-precision optimizer step (bfloat16 parameters and gradients,
// float32 master weights and Adam moments: 12 bytes of optimizer state a parameter) under strata
// and the best ways PyTorch offers, in one process on the same shapes and values.
//
// Model: 24 layers of four bfloat16 tensors (12e6, 4e6, 16e6, 16e6 elements: a width-2000
// transformer block's matrices), 1.152e9 parameters; AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8,
// weight decay 0.01. Parameters and gradients are random (torch's generator, one seed for every
// approach); the gradients stay fixed.
//
// Measures (issue "Train the way LLMs are trained", its GPU must-show):
//   BM_MixedStrataLayerPrefetch  optim::Adam, policy layer_prefetch K=1 streaming masters and
//                                moments (optimizer_states) from pinned memory; parameters and
//                                gradients on the GPU. floor = 12 B/param each way over the raw
//                                pinned bandwidth per direction with both directions running,
//                                from link passes right before each step (Note [Adjacent floor]
//                                in link_rig.h). Target: <= 1.03 x floor. Also the own-memory
//                                floor (Note [Own-memory floor]).
//   BM_MixedTorchPipeline        PyTorch's best way to stream the same state: masters and moments
//                                in pinned CPU tensors, a per-layer pipeline with one stream per
//                                direction and two GPU slots, the gradients cast to float32, the
//                                fused AdamW (at::_fused_adamw_) on the slot, the bfloat16
//                                parameters copied from the slot's masters. Same floor.
//   BM_MixedStrataResident       optim::Adam under keep_on_gpu: everything on the GPU.
//   BM_MixedTorchResident        PyTorch resident with float32 masters: gradients cast to float32
//                                (_foreach), at::_fused_adamw_ over the masters, parameters copied
//                                from them (_foreach_copy_). Target: strata resident <= 1.00 x.
// Timing: host wall from an idle device to cudaDeviceSynchronize() after the step; 2 warm-up
// steps, then 5 timed. After each benchmark the first 1024 masters of the first and last tensors
// are compared with float32 AdamW on the host over the steps taken (within 1e-5 relative: the GPU
// fuses multiply-adds), so a fast but wrong step fails the run.
//
// Run (a machine without a GPU skips every benchmark):
//   build/bin/strata_mixed_bench --benchmark_out=mixed.json --benchmark_out_format=json
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "bench/bench_util.h"
#include "benchmark/benchmark.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

#if defined(STRATA_HAS_CUDA) && defined(STRATA_WITH_TORCH)
#define STRATA_MIXED_BENCH 1
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "ATen/cuda/CUDAEvent.h"
#include "bench/link_rig.h"
#endif

namespace strata {
namespace {

using bench::skip;
using bench::torch_guarded;
using Clock = std::chrono::steady_clock;

constexpr int kLayers = 24;
constexpr std::array<std::int64_t, 4> kTensorNumel = {12'000'000, 4'000'000, 16'000'000,
                                                      16'000'000};
constexpr std::int64_t kLayerNumel = 48'000'000;
constexpr int kWarmupSteps = 2;
constexpr std::uint64_t kSeed = 20261124;
constexpr optim::AdamHyper kHyper{
    .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
constexpr std::int64_t kChecked = 1024;

double num_params() { return static_cast<double>(kLayers) * kLayerNumel; }

#ifdef STRATA_MIXED_BENCH
using bench::cuda_status;

bool have_gpu(benchmark::State& state) {
  if (alloc::cuda_device_count() > 0) return true;
  skip(state, "no GPU on this machine");
  return false;
}

// The k-th tensor's bfloat16 parameter and gradient, the same for every approach.
std::pair<at::Tensor, at::Tensor> sources(int k) {
  at::manual_seed(kSeed + static_cast<std::uint64_t>(k));
  const std::int64_t n = kTensorNumel[k % 4];
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
    const optim::AdamScalars sc = optim::adam_scalars(kHyper, s);
    for (std::int64_t i = 0; i < kChecked; ++i) {
      optim::adam_element(master[i], hg.data_ptr<float>()[i], m[i], v[i], nullptr, sc, 1.0f);
    }
  }
  return master;
}

absl::Status check_masters(std::string_view what, int k, const std::vector<float>& got,
                           std::int64_t steps) {
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

// The link right before each offloaded step, both directions at once.
bench::LinkRig* g_link = nullptr;

// Note [Own-memory floor]: the rig's passes read the link through the rig's own pinned buffers,
// and on some hosts a streamed step moves its bytes faster than they do (an H200, 2026-11-24: the
// step at 46.4 GB/s per direction, the rig at 45.6), so the rig's floor under-reads the link the
// step sees. This floor is taken over the step's own memory: right before each step, one pass
// copies every pinned state buffer to a GPU scratch buffer while, at the same time on a second
// stream, a GPU mirror of the same bytes is copied back into those buffers, tensor by tensor as the
// step copies them. The mirror is refreshed from the buffers just before (untimed), so what is
// written back is what is there. The floor is the pass's span: the bytes each way over both
// directions at once, with no compute and no dependency between them.
class OwnMemoryFloor {
 public:
  OwnMemoryFloor() = default;
  OwnMemoryFloor(const OwnMemoryFloor&) = delete;
  OwnMemoryFloor& operator=(const OwnMemoryFloor&) = delete;
  ~OwnMemoryFloor() {
    for (int d = 0; d < 2; ++d) {
      if (stream_[d] != nullptr) (void)cudaStreamSynchronize(stream_[d]);
      if (start_[d] != nullptr) (void)cudaEventDestroy(start_[d]);
      if (end_[d] != nullptr) (void)cudaEventDestroy(end_[d]);
      if (stream_[d] != nullptr) (void)cudaStreamDestroy(stream_[d]);
      if (gpu_[d] != nullptr) (void)cudaFree(gpu_[d]);
    }
  }

  absl::Status init(std::size_t bytes) {
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

  // One pass over `buffers` (pinned host memory, bytes); its span in ms.
  absl::StatusOr<double> pass_ms(const std::vector<std::pair<void*, std::size_t>>& buffers) {
    std::size_t offset = 0;
    for (const auto& [ptr, n] : buffers) {
      if (offset + n > bytes_) return absl::InternalError("own-memory floor: buffers outgrew it");
      STRATA_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(static_cast<char*>(gpu_[1]) + offset, ptr,
                                                         n, cudaMemcpyHostToDevice, stream_[1]),
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
    float first = 0, last = 0, other_start = 0, other_end = 0;
    STRATA_RETURN_IF_ERROR(cuda_status(cudaEventElapsedTime(&last, start_[0], end_[0]), "elapsed"));
    STRATA_RETURN_IF_ERROR(
        cuda_status(cudaEventElapsedTime(&other_start, start_[0], start_[1]), "elapsed"));
    STRATA_RETURN_IF_ERROR(
        cuda_status(cudaEventElapsedTime(&other_end, start_[0], end_[1]), "elapsed"));
    first = std::min(0.0f, other_start);
    return static_cast<double>(std::max(last, other_end) - first);
  }

 private:
  std::size_t bytes_ = 0;
  std::array<void*, 2> gpu_{};  // 0: the H2D destination; 1: the mirror the D2H reads
  std::array<cudaStream_t, 2> stream_{};
  std::array<cudaEvent_t, 2> start_{};
  std::array<cudaEvent_t, 2> end_{};
};

// The pinned buffers a floor pass covers, listed before each pass.
using BufferList = std::function<absl::StatusOr<std::vector<std::pair<void*, std::size_t>>>()>;

absl::StatusOr<double> time_to_idle(const std::function<absl::Status()>& fn) {
  STRATA_RETURN_IF_ERROR(cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  const Clock::time_point t0 = Clock::now();
  STRATA_RETURN_IF_ERROR(fn());
  STRATA_RETURN_IF_ERROR(cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  return bench::seconds_between(t0, Clock::now()) * 1e3;
}

// Warm-up, then timed steps; with `link`, a link sample before every step and each step's
// ratio to its floor; with `own`, also a pass of the own-memory floor over own_buffers() before
// every step. Reports step_ms (mean), ratio median/min/max.
void run_steps(benchmark::State& state, const std::function<absl::Status()>& step,
               bench::AdjacentLink* link, double bytes_each_way, std::int64_t& steps_taken,
               OwnMemoryFloor* own = nullptr, const BufferList& own_buffers = {}) {
  for (int i = 0; i < kWarmupSteps; ++i) {
    if (absl::Status s = step(); !s.ok()) return skip(state, "warm-up step", s);
    ++steps_taken;
  }
  std::vector<double> ms, ratio, own_ratio;
  double own_bytes = 0, own_ms = 0;
  for (auto _ : state) {
    double floor_ms = 0, own_floor_ms = 0;
    if (link != nullptr) {
      if (absl::Status s = link->sample(); !s.ok()) return skip(state, "link sample", s);
      floor_ms = bytes_each_way / (link->span_gbps() * 1e9) * 1e3;
    }
    if (own != nullptr) {
      auto buffers = own_buffers();
      if (!buffers.ok()) return skip(state, "own-memory buffers", buffers.status());
      absl::StatusOr<double> pass = own->pass_ms(*buffers);
      if (!pass.ok()) return skip(state, "own-memory floor", pass.status());
      for (const auto& b : *buffers) own_bytes += static_cast<double>(b.second);
      own_ms += *pass;
      own_floor_ms = *pass;
    }
    absl::StatusOr<double> t = time_to_idle(step);
    if (!t.ok()) return skip(state, "step", t.status());
    ++steps_taken;
    ms.push_back(*t);
    if (floor_ms > 0) ratio.push_back(*t / floor_ms);
    if (own_floor_ms > 0) own_ratio.push_back(*t / own_floor_ms);
    state.SetIterationTime(*t / 1e3);
  }
  std::sort(ms.begin(), ms.end());
  state.counters["step_ms_median"] = ms[ms.size() / 2];
  state.counters["step_ms_min"] = ms.front();
  state.counters["step_ms_max"] = ms.back();
  if (!ratio.empty()) {
    std::sort(ratio.begin(), ratio.end());
    state.counters["ratio_to_floor_median"] = ratio[ratio.size() / 2];
    state.counters["ratio_to_floor_min"] = ratio.front();
    state.counters["ratio_to_floor_max"] = ratio.back();
    state.counters["link_per_direction_gbps"] = link->span_gbps();
  }
  if (!own_ratio.empty()) {
    std::sort(own_ratio.begin(), own_ratio.end());
    state.counters["ratio_to_own_floor_median"] = own_ratio[own_ratio.size() / 2];
    state.counters["ratio_to_own_floor_min"] = own_ratio.front();
    state.counters["ratio_to_own_floor_max"] = own_ratio.back();
    state.counters["own_floor_per_direction_gbps"] = own_bytes / (own_ms * 1e6);
  }
}

// --- strata ---

void strata_bench(benchmark::State& state, const std::string& policy, int depth = 1) {
  if (!have_gpu(state)) return;
  rt::RuntimeOptions options;
  options.device = rt::DeviceKind::kCuda;
  options.policy = policy;
  options.policy_config.prefetch_depth = depth;
  options.policy_config.roles = rt::RoleSet::optimizer_states();
  absl::StatusOr<std::unique_ptr<rt::Runtime>> runtime =
      rt::Runtime::create(std::move(options), policy::builtin_policies());
  if (!runtime.ok()) return skip(state, "runtime", runtime.status());
  rt::Runtime& r = **runtime;
  optim::AdamOptions o;
  o.groups.push_back({.params = {}, .hyper = kHyper});
  std::vector<rt::TensorHandle> params;
  for (int k = 0; k < kLayers * 4; ++k) {
    auto [p, g] = sources(k);
    const rt::TensorSpec ps{str_cat("t", k),      k / 4,       rt::Role::kParameter,
                            rt::DType::kBFloat16, {p.numel()}, rt::Tier::kGpu};
    rt::TensorSpec gs = ps;
    gs.name = str_cat("t", k, ".grad");
    gs.role = rt::Role::kGradient;
    absl::StatusOr<rt::TensorHandle> ph = r.register_tensor(ps, p.data_ptr());
    absl::StatusOr<rt::TensorHandle> gh = r.register_tensor(gs, g.data_ptr());
    if (!ph.ok() || !gh.ok()) return skip(state, "register", ph.ok() ? gh.status() : ph.status());
    o.groups[0].params.push_back({*ph, *gh});
    params.push_back(*ph);
  }
  c10::cuda::CUDACachingAllocator::emptyCache();  // the sources, copied into strata's memory
  absl::StatusOr<std::unique_ptr<optim::Adam>> adam = optim::Adam::create(r, o);
  if (!adam.ok()) return skip(state, "Adam", adam.status());
  const bool streamed = policy == "layer_prefetch";
  if (streamed && g_link == nullptr) return skip(state, "no link rig for the floor");
  std::unique_ptr<bench::AdjacentLink> link;
  OwnMemoryFloor own;
  if (streamed) {
    link = std::make_unique<bench::AdjacentLink>(*g_link, true, true);
    if (absl::Status s = own.init(static_cast<std::size_t>(num_params() * 12)); !s.ok()) {
      return skip(state, "own-memory floor", s);
    }
  }
  // The states where they rest between steps: pinned host memory under layer_prefetch.
  const BufferList states = [&]() -> absl::StatusOr<std::vector<std::pair<void*, std::size_t>>> {
    STRATA_RETURN_IF_ERROR(r.wait_all());
    std::vector<std::pair<void*, std::size_t>> out;
    for (rt::TensorHandle p : params) {
      STRATA_ASSIGN_OR_RETURN(std::vector<rt::TensorHandle> st, (*adam)->state(p));
      for (rt::TensorHandle h : st) {
        STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, r.info(h));
        if (info.tier != rt::Tier::kPinnedHost || info.in_flight) {
          return absl::InternalError(str_cat(info.spec.name, " is not at rest in pinned memory"));
        }
        out.emplace_back(info.data, info.bytes);
      }
    }
    return out;
  };
  std::int64_t steps = 0;
  run_steps(
      state, [&] { return (*adam)->step(); }, link.get(), num_params() * 12, steps,
      streamed ? &own : nullptr, states);
  if (state.error_occurred()) return;
  for (int k : {0, kLayers * 4 - 1}) {
    absl::StatusOr<std::vector<rt::TensorHandle>> st = (*adam)->state(params[k]);
    std::vector<float> master(static_cast<std::size_t>(kTensorNumel[k % 4]));
    if (!st.ok()) return skip(state, "state", st.status());
    if (absl::Status s = r.read(st->back(), master.data()); !s.ok()) return skip(state, "read", s);
    if (absl::Status s = check_masters(policy, k, master, steps); !s.ok()) {
      return skip(state, "result check", s);
    }
  }
  state.counters["staging_bytes"] = bench::bytes_counter(r.stats().staging_bytes);
  state.SetLabel(
      str_cat("optim::Adam, bfloat16 params and grads on the GPU, float32 masters and "
              "moments ",
              streamed ? str_cat("in pinned memory, layer_prefetch K=", depth) : "on the GPU",
              "; 1.152e9 params"));
}

void BM_MixedStrataLayerPrefetch(benchmark::State& state) { strata_bench(state, "layer_prefetch"); }
// Two layers ahead: the H2D stream need not wait for the D2H copies that free the slot it fills.
void BM_MixedStrataLayerPrefetchK2(benchmark::State& state) {
  strata_bench(state, "layer_prefetch", 2);
}
void BM_MixedStrataResident(benchmark::State& state) { strata_bench(state, "keep_on_gpu"); }

// --- PyTorch ---

struct TorchModel {
  std::vector<at::Tensor> params, grads;  // bfloat16, on the GPU
  std::vector<at::Tensor> masters, m, v;  // float32: on the GPU, or pinned on the host
  std::vector<at::Tensor> steps;          // float32 scalars on the GPU, one per tensor
  explicit TorchModel(bool pinned) {
    for (int k = 0; k < kLayers * 4; ++k) {
      auto [p, g] = sources(k);
      at::Tensor master = p.to(at::kFloat);
      const auto where =
          pinned ? at::TensorOptions().dtype(at::kFloat).pinned_memory(true) : master.options();
      if (pinned) master = master.to(at::kCPU).pin_memory();
      params.push_back(p);
      grads.push_back(g);
      masters.push_back(master);
      m.push_back(at::zeros({p.numel()}, where));
      v.push_back(at::zeros({p.numel()}, where));
      steps.push_back(at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA)));
    }
  }
};

void fused_adamw(at::TensorList masters, at::TensorList grads, at::TensorList m, at::TensorList v,
                 at::TensorList steps) {
  at::_foreach_add_(steps, at::Scalar(1.0));
  at::_fused_adamw_(masters, grads, m, v, /*max_exp_avg_sqs=*/{}, steps, kHyper.lr, kHyper.beta1,
                    kHyper.beta2, kHyper.weight_decay, kHyper.eps, /*amsgrad=*/false,
                    /*maximize=*/false, /*grad_scale=*/std::nullopt, /*found_inf=*/std::nullopt);
}

void BM_MixedTorchResident(benchmark::State& state) {
  if (!have_gpu(state)) return;
  torch_guarded(state, [&] {
    TorchModel t(/*pinned=*/false);
    std::int64_t steps = 0;
    run_steps(
        state,
        [&] {
          std::vector<at::Tensor> g32;
          for (const at::Tensor& g : t.grads) g32.push_back(g.to(at::kFloat));
          fused_adamw(t.masters, g32, t.m, t.v, t.steps);
          at::_foreach_copy_(t.params, t.masters);
          return absl::OkStatus();
        },
        nullptr, 0, steps);
    if (state.error_occurred()) return;
    for (int k : {0, kLayers * 4 - 1}) {
      const at::Tensor h = t.masters[k].narrow(0, 0, kChecked).to(at::kCPU);
      const std::vector<float> got(h.data_ptr<float>(), h.data_ptr<float>() + kChecked);
      if (absl::Status s = check_masters("torch resident", k, got, steps); !s.ok()) {
        return skip(state, "result check", s);
      }
    }
    state.SetLabel(
        "at::_fused_adamw_ over float32 masters, gradients cast with .to(float32), parameters "
        "copied with _foreach_copy_, all on the GPU");
  });
  c10::cuda::CUDACachingAllocator::emptyCache();
}

void BM_MixedTorchPipeline(benchmark::State& state) {
  if (!have_gpu(state)) return;
  torch_guarded(state, [&] {
    TorchModel t(/*pinned=*/true);
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
    // Two slots of one layer's masters, moments and float32 gradients.
    std::array<std::array<std::vector<at::Tensor>, 3>, 2> slot;
    for (int s = 0; s < 2; ++s) {
      for (int x = 0; x < 3; ++x) {
        for (int j = 0; j < 4; ++j) slot[s][x].push_back(at::empty({kTensorNumel[j]}, f32));
      }
    }
    c10::cuda::CUDAStream h2d = c10::cuda::getStreamFromPool();
    c10::cuda::CUDAStream d2h = c10::cuda::getStreamFromPool();
    auto step = [&]() -> absl::Status {
      const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream();
      std::array<at::cuda::CUDAEvent, 2> arrived, computed, freed;
      auto host = [&](int x, int k) -> at::Tensor& {
        return x == 0 ? t.masters[k] : x == 1 ? t.m[k] : t.v[k];
      };
      auto fetch = [&](int layer, int s) {
        c10::cuda::CUDAStreamGuard guard(h2d);
        freed[s].block(h2d);
        for (int x = 0; x < 3; ++x) {
          for (int j = 0; j < 4; ++j) slot[s][x][j].copy_(host(x, layer * 4 + j), true);
        }
        arrived[s].record(h2d);
      };
      fetch(0, 0);
      for (int layer = 0; layer < kLayers; ++layer) {
        const int s = layer % 2;
        if (layer + 1 < kLayers) fetch(layer + 1, 1 - s);
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
        c10::cuda::CUDAStreamGuard guard(d2h);
        computed[s].block(d2h);
        for (int x = 0; x < 3; ++x) {
          for (int j = 0; j < 4; ++j) host(x, layer * 4 + j).copy_(slot[s][x][j], true);
        }
        freed[s].record(d2h);
      }
      d2h.synchronize();
      return absl::OkStatus();
    };
    if (g_link == nullptr) return skip(state, "no link rig for the floor");
    bench::AdjacentLink link(*g_link, true, true);
    OwnMemoryFloor own;
    if (absl::Status s = own.init(static_cast<std::size_t>(num_params() * 12)); !s.ok()) {
      return skip(state, "own-memory floor", s);
    }
    const BufferList buffers = [&]() -> absl::StatusOr<std::vector<std::pair<void*, std::size_t>>> {
      std::vector<std::pair<void*, std::size_t>> out;
      for (int k = 0; k < kLayers * 4; ++k) {
        for (const at::Tensor* h : {&t.masters[k], &t.m[k], &t.v[k]}) {
          out.emplace_back(h->data_ptr(), h->nbytes());
        }
      }
      return out;
    };
    std::int64_t steps = 0;
    run_steps(state, step, &link, num_params() * 12, steps, &own, buffers);
    if (state.error_occurred()) return;
    for (int k : {0, kLayers * 4 - 1}) {
      const at::Tensor& h = t.masters[k];
      const std::vector<float> got(h.data_ptr<float>(), h.data_ptr<float>() + kChecked);
      if (absl::Status s = check_masters("torch pipeline", k, got, steps); !s.ok()) {
        return skip(state, "result check", s);
      }
    }
    state.SetLabel(
        "masters and moments in pinned CPU tensors, per-layer pipeline: H2D and D2H streams, 2 "
        "GPU slots, at::_fused_adamw_ on the slot, parameters copied from it");
  });
  c10::cuda::CUDACachingAllocator::emptyCache();
}
#else
void BM_MixedStrataLayerPrefetch(benchmark::State& state) {
  skip(state, "needs CUDA and LibTorch");
}
void BM_MixedStrataLayerPrefetchK2(benchmark::State& state) {
  skip(state, "needs CUDA and LibTorch");
}
void BM_MixedStrataResident(benchmark::State& state) { skip(state, "needs CUDA and LibTorch"); }
void BM_MixedTorchResident(benchmark::State& state) { skip(state, "needs CUDA and LibTorch"); }
void BM_MixedTorchPipeline(benchmark::State& state) { skip(state, "needs CUDA and LibTorch"); }
#endif

// Interleaved: each strata approach next to its PyTorch peer.
BENCHMARK(BM_MixedStrataLayerPrefetch)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MixedTorchPipeline)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MixedStrataLayerPrefetchK2)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MixedStrataResident)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MixedTorchResident)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("gpu", strata::alloc::cuda_device_name(0));
  benchmark::AddCustomContext("params", "1152000000");
#ifdef STRATA_MIXED_BENCH
  strata::bench::LinkRig link;
  if (strata::alloc::cuda_device_count() > 0) {
    if (absl::Status s = strata::bench::init_link_rig(link, 1); s.ok()) {
      strata::g_link = &link;
    } else {
      benchmark::AddCustomContext("link_error", s.ToString());
    }
  }
#endif
  benchmark::RunSpecifiedBenchmarks();
#ifdef STRATA_MIXED_BENCH
  strata::g_link = nullptr;
#endif
  benchmark::Shutdown();
  return 0;
}
