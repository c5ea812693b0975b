// bench/optim_bench.cpp: the optimizer step of a 1.5B-parameter model under each strata policy,
// next to the PyTorch ways of doing the same step, all in one process on the same shapes.
//
// Model: 1.536e9 fp32 parameters in 32 layers of 48e6 (four tensors per layer, 12e6 + 4e6 + 16e6
// + 16e6: the qkv, output, fc1 and fc2 weights of a width-2000 transformer block), AdamW with
// lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01. Parameters and gradients are
// pseudo-random (never zeros), filled once; the gradients stay fixed. Moments: 8 B per parameter,
// 12.288e9 B (PERF.md's "12.3 GB").
//
// Measures (targets in /work/shared/PERF.md and issue 4, "Must show"):
//   BM_StrataResident          optim::Adam over a keep_on_gpu runtime: everything on the GPU.
//                              CUDA events on the compute stream. floor_ms = 28 B/param over the
//                              HBM bandwidth measured in this run (a 2 GiB device-to-device copy,
//                              read + write counted).
//   BM_TorchFusedAdamW         at::_fused_adamw_ over the same shapes, all resident (with the
//                              _foreach_add_ of the step counters, as torch.optim.AdamW does).
//                              CUDA events on the current stream. Target: strata resident <= 1.00x.
//   BM_StrataBulk              policy bulk, roles optimizer states: reload_all(), step(),
//                              offload_all() per step. floor = 12.3 GB over the raw pinned H2D
//                              bandwidth + 12.3 GB over the raw D2H bandwidth (each alone).
//   BM_TorchBulkTo             moments in pinned CPU tensors: .to(cuda, non_blocking) for all,
//                              fused step, copy_(non_blocking) back into the pinned tensors,
//                              synchronize. Peak extra GPU memory from the caching allocator.
//   BM_TorchPerLayerPipeline   the per-layer pipeline written with LibTorch streams: an H2D and a
//                              D2H stream from the pool, compute on the current stream, 2 staging
//                              slots of one layer's moments, events between the three.
//   BM_StrataLayerPrefetch/K   policy layer_prefetch with prefetch depth K (1, 2): moments in
//                              pinned host memory, parameters and gradients on the GPU. floor =
//                              12.3 GB each way over the raw per-direction pinned bandwidth with
//                              both directions running at once. Targets: step <= 1.03 x floor and
//                              faster than BM_TorchPerLayerPipeline; peak extra GPU memory (the
//                              staging ring) <= (K + 1) x the largest layer's moments + 1%.
//                              After the timed steps, one more step with its copies traced
//                              (runtime/copy_trace.h): trace_* counters say how long each
//                              direction of the link copied alone, with the other, or not at
//                              all; STRATA_TRACE_DIR=DIR also writes the copies as CSV.
//   BM_TorchCpuAdamW           torch::optim::AdamW on CPU tensors, 1/8 of the model (4 layers);
//                              ms_scaled = time x 8; transfers not counted.
//   BM_SimulatedLayerPrefetch  layer_prefetch K=1 on the simulated device, 2 layers x 64K params:
//                              the one benchmark that runs without a GPU.
// Floors of the offloaded approaches: the raw pinned bandwidth comes from passes of the link rig
// (16 x 256 MiB each way) right before each step, outside its clock, warm-up steps included, so
// each step is judged against the link as it was then (Note [Adjacent floor] in link_rig.h);
// main's start-of-run figures stay in the JSON context for reference.
// Timing: the resident approaches with CUDA events around the step on the stream that computes;
// the offloaded ones with host wall time from an idle device to cudaDeviceSynchronize() after the
// step (the write-back of the last layer is part of the step). Warm-up: 2 steps per repetition.
// After every benchmark the first and last tensors' first and last 1024 elements (parameters, and
// exp_avg where it can be read) are compared with a host AdamW over the same number of steps, so a
// fast but wrong step fails the run.
//
// Memory: one approach's state at a time (a rig, kept across the repetitions of a benchmark and
// freed before the next approach starts, LibTorch's caches emptied): at most ~25 GB of GPU memory
// (resident: parameters, gradients and both moments) and ~14 GB of pinned host memory, plus the
// link rig's 8 GiB of GPU and 8 GiB of pinned memory, made in main before any rig (where the HBM
// and start-of-run link bandwidths are measured) and kept to the end.
//
// Run (on a machine without a GPU everything but the simulated benchmark reports "no GPU"):
//   build/bin/strata_optim_bench --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true
//       --benchmark_out=optim_bench.json --benchmark_out_format=json   (one command line)
//   python3 tools/gpu/summarize_optim.py optim_bench.json
// The JSON context carries the GPU name, the model's sizes, and the measured HBM and pinned
// bandwidths.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

// The LibTorch peers run on the GPU, so they need CUDA as well.
#if defined(STRATA_WITH_TORCH) && defined(STRATA_HAS_CUDA)
#define STRATA_BENCH_TORCH 1
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_fused_adamw.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/version.h>
#endif

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/stats.h"
#include "allocator/tier.h"
#include "allocator/tiered_allocator.h"
#include "allocator/upstream.h"
#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "bench/bench_util.h"
#include "bench/link_rig.h"
#include "optim/adam.h"
#include "optim/adam_math.h"
#include "policies/builtin.h"
#include "runtime/copy_trace.h"
#include "runtime/device.h"
#include "runtime/runtime.h"
#include "runtime/tensor.h"

namespace {

namespace rt = strata::rt;
namespace optim = strata::optim;
using strata::kGiB;
using strata::kMiB;
using strata::str_cat;
using strata::alloc::Tier;
using Clock = std::chrono::steady_clock;

using strata::bench::bytes_counter;
using strata::bench::gb_per_s;
using strata::bench::have_gpu;
using strata::bench::kBytesPerDirection;
using strata::bench::kPieceBytes;
using strata::bench::kPieces;
using strata::bench::require_gpu;
using strata::bench::seconds_between;
using strata::bench::skip;
using strata::bench::torch_guarded;
#ifdef STRATA_HAS_CUDA
using strata::bench::AdjacentLink;
using strata::bench::cuda_status;
using strata::bench::init_link_rig;
using strata::bench::LinkRig;
using strata::bench::LinkTiming;
using strata::bench::piece;
using strata::bench::run_link;
#endif

constexpr int kWarmupSteps = 2;

// AdamW as every approach runs it.
constexpr optim::AdamHyper kHyper{.lr = 1e-3f,
                                  .beta1 = 0.9f,
                                  .beta2 = 0.999f,
                                  .eps = 1e-8f,
                                  .weight_decay = 0.01f,
                                  .decoupled = true};

// Bytes per parameter a resident step moves through HBM: reads p, g, m, v; writes p, m, v.
constexpr double kResidentBytesPerParam = 28;
// Bytes per parameter of Adam's moments (fp32 exp_avg + exp_avg_sq): what offloading moves each
// way.
constexpr double kMomentBytesPerParam = 8;

// Milliseconds to move `bytes` at `gbps` decimal GB/s.
[[maybe_unused]] double ms_at(double bytes, double gbps) {
  return gbps > 0 ? bytes / (gbps * 1e9) * 1e3 : 0;
}

// ---------------------------------------------------------------------------------------------
// The model.

struct Model {
  int layers = 0;
  std::vector<std::int64_t> tensor_numel;  // the tensors of one layer; every layer is the same

  int per_layer() const { return static_cast<int>(tensor_numel.size()); }
  int count() const { return layers * per_layer(); }
  int layer_of(int k) const { return k / per_layer(); }
  std::int64_t numel(int k) const {
    return tensor_numel[static_cast<std::size_t>(k % per_layer())];
  }
  std::int64_t layer_numel() const {
    return std::accumulate(tensor_numel.begin(), tensor_numel.end(), std::int64_t{0});
  }
  std::int64_t params() const { return layers * layer_numel(); }
  std::int64_t offset_in_layer(int j) const {
    return std::accumulate(tensor_numel.begin(), tensor_numel.begin() + j, std::int64_t{0});
  }
  double moment_bytes() const { return kMomentBytesPerParam * static_cast<double>(params()); }
  std::string describe() const {
    std::string sizes;
    for (std::size_t j = 0; j < tensor_numel.size(); ++j) {
      strata::str_append(&sizes, j == 0 ? "" : "+", tensor_numel[j]);
    }
    return str_cat(layers, " layers x (", sizes, ") fp32");
  }
};

// 32 x 48e6 = 1.536e9 parameters.
const Model& full_model() {
  static const Model* const m = new Model{32, {12'000'000, 4'000'000, 16'000'000, 16'000'000}};
  return *m;
}
// 1/8 of it, for the CPU peer.
[[maybe_unused]] const Model& cpu_model() {
  static const Model* const m = new Model{4, full_model().tensor_numel};
  return *m;
}
constexpr int kCpuScale = 8;
// The simulated run: 2 layers x 64K.
const Model& tiny_model() {
  static const Model* const m = new Model{2, {64 * 1024}};
  return *m;
}

// ---------------------------------------------------------------------------------------------
// Values: every tensor k reads a window of one fixed pseudo-random buffer starting kSourceShift * k
// floats in, so tensors differ and the buffers stay small (64 MB each).

constexpr std::int64_t kMaxTensorNumel = 16'000'000;
constexpr int kMaxTensors = 128;
constexpr std::int64_t kSourceShift = 97;
constexpr std::int64_t kSourceFloats = kMaxTensorNumel + kMaxTensors * kSourceShift;
constexpr std::uint64_t kParamSeed = 0x5354'5241'5441'0101;  // "STRATA" ...
constexpr std::uint64_t kGradSeed = 0x5354'5241'5441'0202;

std::int64_t source_offset(int k) { return k * kSourceShift; }

void check_fits(const Model& model) {
  STRATA_CHECK(model.count() <= kMaxTensors, "model has ", model.count(), " tensors");
  for (std::int64_t n : model.tensor_numel) {
    STRATA_CHECK(n <= kMaxTensorNumel && n % 4 == 0, "tensor of ", n, " elements");
  }
}

using strata::bench::SplitMix64;

struct HostSources {
  std::vector<float> params;  // uniform in [-1, 1)
  std::vector<float> grads;   // uniform in [-0.01, 0.01)
};

const HostSources& host_sources() {
  static const HostSources* const s = [] {
    auto* out = new HostSources;
    out->params.resize(kSourceFloats);
    out->grads.resize(kSourceFloats);
    SplitMix64 p(kParamSeed);
    SplitMix64 g(kGradSeed);
    for (float& x : out->params) x = p.symmetric();
    for (float& x : out->grads) x = 0.01f * g.symmetric();
    return out;
  }();
  return *s;
}

// ---------------------------------------------------------------------------------------------
// Checking results against a host AdamW.

constexpr std::int64_t kCheckedElements = 1024;  // at each end of a checked tensor
constexpr float kCheckAtol = 1e-5f;
constexpr float kCheckRtol = 1e-4f;  // one step more or less changes a parameter by ~1e-3

// The element indices of tensor k that are checked.
std::vector<std::int64_t> checked_indices(std::int64_t numel) {
  std::vector<std::int64_t> out;
  const std::int64_t head = std::min(kCheckedElements, numel);
  for (std::int64_t i = 0; i < head; ++i) out.push_back(i);
  for (std::int64_t i = std::max(head, numel - kCheckedElements); i < numel; ++i) out.push_back(i);
  return out;
}

// got_p / got_m: element i of tensor k's parameter / exp_avg after `steps` steps (got_m may be
// empty). Both see the whole tensor's indices.
template <typename GetP, typename GetM>
absl::Status check_tensor(std::string_view what, const Model& model, int k, std::int64_t steps,
                          GetP got_p, GetM got_m, bool check_m) {
  const HostSources& src = host_sources();
  std::vector<optim::AdamScalars> scalars;
  for (std::int64_t t = 1; t <= steps; ++t) scalars.push_back(optim::adam_scalars(kHyper, t));
  const std::int64_t base = source_offset(k);
  for (std::int64_t i : checked_indices(model.numel(k))) {
    float p = src.params[static_cast<std::size_t>(base + i)];
    const float g = src.grads[static_cast<std::size_t>(base + i)];
    float m = 0;
    float v = 0;
    for (const optim::AdamScalars& s : scalars) optim::adam_element(p, g, m, v, nullptr, s, 1.0f);
    const float gp = got_p(i);
    if (!(std::abs(gp - p) <= kCheckAtol + kCheckRtol * std::abs(p))) {
      return absl::DataLossError(str_cat(what, ": tensor ", k, " parameter element ", i, " is ",
                                         static_cast<double>(gp), ", a host AdamW over ", steps,
                                         " steps gives ", static_cast<double>(p)));
    }
    if (check_m) {
      const float gm = got_m(i);
      if (!(std::abs(gm - m) <= kCheckAtol + kCheckRtol * std::abs(m))) {
        return absl::DataLossError(str_cat(what, ": tensor ", k, " exp_avg element ", i, " is ",
                                           static_cast<double>(gm), ", a host AdamW over ", steps,
                                           " steps gives ", static_cast<double>(m)));
      }
    }
  }
  return absl::OkStatus();
}

// The first and the last tensor of the model, from whole-tensor host copies.
template <typename Fetch>
absl::Status check_ends(std::string_view what, const Model& model, std::int64_t steps,
                        Fetch fetch) {
  for (int k : {0, model.count() - 1}) {
    std::vector<float> p;
    std::vector<float> m;
    STRATA_RETURN_IF_ERROR(fetch(k, p, m));
    const bool check_m = !m.empty();
    STRATA_RETURN_IF_ERROR(check_tensor(
        what, model, k, steps, [&](std::int64_t i) { return p[static_cast<std::size_t>(i)]; },
        [&](std::int64_t i) { return m[static_cast<std::size_t>(i)]; }, check_m));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Bandwidths measured once in main: HBM for the resident floor, and the link for reference; the
// offloaded floors divide by the link measured next to each step (LinkFloor below).

struct Bandwidths {
  bool measured = false;
  std::string error = "not measured (no GPU)";
  double hbm_gbps = 0;                 // device-to-device copy, read + write counted
  double h2d_gbps = 0;                 // pinned -> GPU alone
  double d2h_gbps = 0;                 // GPU -> pinned alone
  double both_per_direction_gbps = 0;  // bytes each way / span, both directions at once
  double both_h2d_gbps = 0;            // each direction's own rate while both run
  double both_d2h_gbps = 0;
};
Bandwidths g_bw;

constexpr std::size_t kHbmCopyBytes = 2 * kGiB;
constexpr int kLinkPasses = 3;
constexpr int kHbmPasses = 5;

#ifdef STRATA_HAS_CUDA

// The raw copy buffers: made in main before any rig, kept for the passes next to each offloaded
// step, freed at the end of main (no CUDA call in static destructors).
LinkRig* g_link = nullptr;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// HBM: a 2 GiB device-to-device cudaMemcpyAsync (read + write = 2 x bytes), median of 5 after a
// warm-up. Pinned: each direction alone and both at once, median of 3 passes after a warm-up.
absl::StatusOr<Bandwidths> measure_bandwidths() {
  auto made = std::make_unique<LinkRig>();
  STRATA_RETURN_IF_ERROR(init_link_rig(*made, kParamSeed ^ kGradSeed));
  g_link = made.release();
  LinkRig& rig = *g_link;
  Bandwidths out;

  std::vector<double> hbm;
  for (int pass = 0; pass <= kHbmPasses; ++pass) {
    STRATA_RETURN_IF_ERROR(cuda_status(cudaEventRecord(rig.start[0], rig.stream[0]), "record"));
    STRATA_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(rig.gpu[0], rig.gpu[1], kHbmCopyBytes,
                                                       cudaMemcpyDeviceToDevice, rig.stream[0]),
                                       "cudaMemcpyAsync (device to device)"));
    STRATA_RETURN_IF_ERROR(cuda_status(cudaEventRecord(rig.end[0], rig.stream[0]), "record"));
    STRATA_RETURN_IF_ERROR(cuda_status(cudaEventSynchronize(rig.end[0]), "cudaEventSynchronize"));
    float ms = 0;
    STRATA_RETURN_IF_ERROR(
        cuda_status(cudaEventElapsedTime(&ms, rig.start[0], rig.end[0]), "elapsed"));
    if (pass > 0) hbm.push_back(gb_per_s(2.0 * kHbmCopyBytes, ms / 1e3));
  }
  out.hbm_gbps = median(hbm);

  const double bytes = static_cast<double>(kBytesPerDirection);
  for (int dir = 0; dir < 2; ++dir) {
    STRATA_RETURN_IF_ERROR(run_link(rig, dir == 0, dir == 1).status());
    std::vector<double> gbps;
    for (int pass = 0; pass < kLinkPasses; ++pass) {
      STRATA_ASSIGN_OR_RETURN(LinkTiming t, run_link(rig, dir == 0, dir == 1));
      gbps.push_back(gb_per_s(bytes, t.span_ms / 1e3));
    }
    (dir == 0 ? out.h2d_gbps : out.d2h_gbps) = median(gbps);
  }

  STRATA_RETURN_IF_ERROR(run_link(rig, true, true).status());
  std::vector<double> span;
  std::vector<double> h2d;
  std::vector<double> d2h;
  for (int pass = 0; pass < kLinkPasses; ++pass) {
    STRATA_ASSIGN_OR_RETURN(LinkTiming t, run_link(rig, true, true));
    span.push_back(gb_per_s(bytes, t.span_ms / 1e3));
    h2d.push_back(gb_per_s(bytes, t.h2d_ms / 1e3));
    d2h.push_back(gb_per_s(bytes, t.d2h_ms / 1e3));
  }
  out.both_per_direction_gbps = median(span);
  out.both_h2d_gbps = median(h2d);
  out.both_d2h_gbps = median(d2h);
  out.measured = true;
  out.error.clear();
  return out;
}

// An offloaded approach's floor from raw passes right before each of its steps, outside the
// step's clock (Note [Adjacent floor] in bench/link_rig.h). kConcurrent: both directions at once,
// as layer_prefetch and the per-layer pipeline move their bytes (floor = bytes each way over the
// span); kSequential: each direction alone, as bulk moves everything in and then everything out
// (floor = bytes over the H2D rate + bytes over the D2H rate).
class LinkFloor {
 public:
  enum Kind { kConcurrent, kSequential };
  explicit LinkFloor(Kind kind)
      : kind_(kind),
        both_(*g_link, true, true),
        h2d_(*g_link, true, false),
        d2h_(*g_link, false, true) {}

  absl::Status sample() {
    if (kind_ == kConcurrent) return both_.sample();
    STRATA_RETURN_IF_ERROR(h2d_.sample());
    return d2h_.sample();
  }
  double floor_ms(double bytes_each_way) const {
    if (kind_ == kConcurrent) return ms_at(bytes_each_way, both_.span_gbps());
    return ms_at(bytes_each_way, h2d_.h2d_gbps()) + ms_at(bytes_each_way, d2h_.d2h_gbps());
  }
  // The floor's denominator(s), as counters.
  void report(benchmark::State& state) const {
    if (kind_ == kConcurrent) {
      state.counters["link_per_direction_gbps"] = both_.span_gbps();
    } else {
      state.counters["link_h2d_gbps"] = h2d_.h2d_gbps();
      state.counters["link_d2h_gbps"] = d2h_.d2h_gbps();
    }
  }

 private:
  Kind kind_;
  AdjacentLink both_;
  AdjacentLink h2d_;
  AdjacentLink d2h_;
};

// `step` with a link sample before it: what the offloaded benchmarks time.
template <typename Step>
auto sampled(LinkFloor& floor, Step step) {
  return [&floor, step]() -> absl::StatusOr<double> {
    STRATA_RETURN_IF_ERROR(floor.sample());
    return step();
  };
}
#endif  // STRATA_HAS_CUDA

[[maybe_unused]] bool require_bandwidths(benchmark::State& state) {
  if (g_bw.measured) return true;
  skip(state, str_cat("bandwidths for the floor: ", g_bw.error));
  return false;
}

// ---------------------------------------------------------------------------------------------
// Rigs: one approach's state at a time, kept across the repetitions of its benchmark.

struct Rig {
  virtual ~Rig() = default;
};

std::unique_ptr<Rig> g_rig;
std::string g_rig_key;
[[maybe_unused]] bool g_torch_used = false;

// Frees the current rig and whatever the libraries cached for it, so the next approach starts
// with the GPU (and pinned memory) as the first one found it.
void release_rig() {
#ifdef STRATA_HAS_CUDA
  if (have_gpu()) (void)cudaDeviceSynchronize();
#endif
  g_rig.reset();
  g_rig_key.clear();
#ifdef STRATA_BENCH_TORCH
  if (g_torch_used) {
    (void)cudaDeviceSynchronize();
    c10::cuda::CUDACachingAllocator::emptyCache();
    at::getHostAllocator(at::kCUDA)->empty_cache();
  }
#endif
}

// The rig named `key`, made by `make` (a StatusOr<unique_ptr<R>>) unless it is the current one.
template <typename R, typename Make>
absl::StatusOr<R*> rig(std::string_view key, Make make) {
  if (g_rig != nullptr && g_rig_key == key) return static_cast<R*>(g_rig.get());
  release_rig();
  absl::StatusOr<std::unique_ptr<R>> made = make();
  if (!made.ok()) {
    release_rig();
    return made.status();
  }
  R* out = made->get();
  g_rig = std::move(*made);
  g_rig_key = std::string(key);
  return out;
}

// GPU copies of the value sources, for registering and cloning without host round trips.
struct DeviceSources {
  float* params = nullptr;
  float* grads = nullptr;
};
DeviceSources g_device_sources;

void release_device_sources() {
#ifdef STRATA_HAS_CUDA
  if (g_device_sources.params != nullptr) (void)cudaFree(g_device_sources.params);
  if (g_device_sources.grads != nullptr) (void)cudaFree(g_device_sources.grads);
#endif
  g_device_sources = {};
}

#ifdef STRATA_HAS_CUDA
absl::StatusOr<DeviceSources> device_sources() {
  if (g_device_sources.params != nullptr) return g_device_sources;
  const HostSources& host = host_sources();
  const std::size_t bytes = kSourceFloats * sizeof(float);
  DeviceSources d;
  absl::Status s =
      cuda_status(cudaMalloc(reinterpret_cast<void**>(&d.params), bytes), "cudaMalloc");
  if (s.ok()) s = cuda_status(cudaMalloc(reinterpret_cast<void**>(&d.grads), bytes), "cudaMalloc");
  if (s.ok()) {
    s = cuda_status(cudaMemcpy(d.params, host.params.data(), bytes, cudaMemcpyHostToDevice),
                    "cudaMemcpy");
  }
  if (s.ok()) {
    s = cuda_status(cudaMemcpy(d.grads, host.grads.data(), bytes, cudaMemcpyHostToDevice),
                    "cudaMemcpy");
  }
  g_device_sources = d;  // freed by release_device_sources, also after a failure
  if (!s.ok()) return s;
  return d;
}

std::int64_t device_used_bytes() {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return static_cast<std::int64_t>(total_bytes - free_bytes);
}

// Two timing events, destroyed with the scope.
struct EventPair {
  cudaEvent_t start = nullptr;
  cudaEvent_t end = nullptr;
  EventPair() {
    if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&end) != cudaSuccess) {
      (void)cudaGetLastError();
    }
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
  ~EventPair() {
    if (start != nullptr) (void)cudaEventDestroy(start);
    if (end != nullptr) (void)cudaEventDestroy(end);
  }
};

// Milliseconds from an event recorded on `stream` before fn to one recorded after it (fn enqueues
// its work on `stream`; time the host spends enqueueing shows when the GPU outruns it).
template <typename Fn>
absl::StatusOr<double> time_on_stream(EventPair& ev, cudaStream_t stream, Fn fn) {
  if (ev.start == nullptr || ev.end == nullptr)
    return absl::InternalError("cudaEventCreate failed");
  STRATA_RETURN_IF_ERROR(cuda_status(cudaEventRecord(ev.start, stream), "cudaEventRecord"));
  STRATA_RETURN_IF_ERROR(fn());
  STRATA_RETURN_IF_ERROR(cuda_status(cudaEventRecord(ev.end, stream), "cudaEventRecord"));
  STRATA_RETURN_IF_ERROR(cuda_status(cudaEventSynchronize(ev.end), "cudaEventSynchronize"));
  float ms = 0;
  STRATA_RETURN_IF_ERROR(cuda_status(cudaEventElapsedTime(&ms, ev.start, ev.end), "elapsed"));
  return static_cast<double>(ms);
}

// Host wall milliseconds from an idle device through fn to the end of everything it queued on any
// stream (cudaDeviceSynchronize): for work spread over copy streams.
template <typename Fn>
absl::StatusOr<double> time_to_idle(Fn fn) {
  STRATA_RETURN_IF_ERROR(cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  const Clock::time_point t0 = Clock::now();
  STRATA_RETURN_IF_ERROR(fn());
  STRATA_RETURN_IF_ERROR(cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  return seconds_between(t0, Clock::now()) * 1e3;
}
#endif  // STRATA_HAS_CUDA

// ---------------------------------------------------------------------------------------------
// strata: optim::Adam over a runtime with the policy under test.

struct StrataRig final : Rig {
  Model model;
  strata::rt::CopyTracer* tracer = nullptr;  // the runtime's device (CUDA rigs); idle until used
  std::unique_ptr<rt::Runtime> runtime;
  std::unique_ptr<optim::Adam> adam;  // declared after the runtime: destroyed first
  std::vector<rt::TensorHandle> params;
  std::int64_t device_used_at_create = -1;  // cudaMemGetInfo, before the first step
};

absl::StatusOr<std::unique_ptr<StrataRig>> make_strata_rig(const Model& model, std::string policy,
                                                           int depth, rt::DeviceKind device) {
  check_fits(model);
  const float* param_src = host_sources().params.data();
  const float* grad_src = host_sources().grads.data();
#ifdef STRATA_HAS_CUDA
  if (device == rt::DeviceKind::kCuda) {
    STRATA_ASSIGN_OR_RETURN(DeviceSources d, device_sources());
    param_src = d.params;
    grad_src = d.grads;
  }
#endif
  auto out = std::make_unique<StrataRig>();
  out->model = model;
  rt::RuntimeOptions options;
  options.policy = std::move(policy);
  options.policy_config.prefetch_depth = depth;
  options.policy_config.roles = rt::RoleSet::optimizer_states();
  options.device = device;
  if (device == rt::DeviceKind::kCuda) {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<rt::Device> cuda, rt::make_cuda_device());
    auto tracer = std::make_unique<strata::rt::CopyTracer>(std::move(cuda));
    out->tracer = tracer.get();
    options.device_override = std::move(tracer);
  }
  STRATA_ASSIGN_OR_RETURN(
      out->runtime, rt::Runtime::create(std::move(options), strata::policy::builtin_policies()));
  optim::ParamGroup group;
  group.hyper = kHyper;
  for (int k = 0; k < model.count(); ++k) {
    const int layer = model.layer_of(k);
    const int j = k % model.per_layer();
    rt::TensorSpec spec{.name = str_cat("layer", layer, ".w", j),
                        .layer = layer,
                        .role = rt::Role::kParameter,
                        .dtype = rt::DType::kFloat32,
                        .shape = {model.numel(k)},
                        .home = Tier::kGpu};
    STRATA_ASSIGN_OR_RETURN(rt::TensorHandle p,
                            out->runtime->register_tensor(spec, param_src + source_offset(k)));
    spec.name = str_cat(spec.name, ".grad");
    spec.role = rt::Role::kGradient;
    STRATA_ASSIGN_OR_RETURN(rt::TensorHandle g,
                            out->runtime->register_tensor(spec, grad_src + source_offset(k)));
    group.params.push_back({p, g});
    out->params.push_back(p);
  }
  optim::AdamOptions adam_options;
  adam_options.groups.push_back(std::move(group));
  STRATA_ASSIGN_OR_RETURN(out->adam, optim::Adam::create(*out->runtime, std::move(adam_options)));
#ifdef STRATA_HAS_CUDA
  if (device == rt::DeviceKind::kCuda) {
    STRATA_RETURN_IF_ERROR(out->runtime->wait_all());
    STRATA_RETURN_IF_ERROR(cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
    out->device_used_at_create = device_used_bytes();
  }
#endif
  return out;
}

absl::StatusOr<StrataRig*> strata_rig(const Model& model, std::string policy, int depth,
                                      rt::DeviceKind device) {
  const std::string key =
      str_cat("strata/", policy, "/", depth, device == rt::DeviceKind::kCuda ? "/cuda" : "/sim");
  return rig<StrataRig>(key, [&] { return make_strata_rig(model, policy, depth, device); });
}

// Parameters and exp_avg read back through the runtime (host waits, outside every timed region).
absl::Status check_strata(std::string_view what, StrataRig& r) {
  return check_ends(what, r.model, r.adam->step_count(0),
                    [&](int k, std::vector<float>& p, std::vector<float>& m) -> absl::Status {
                      const auto n = static_cast<std::size_t>(r.model.numel(k));
                      p.resize(n);
                      m.resize(n);
                      STRATA_RETURN_IF_ERROR(r.runtime->read(r.params[k], p.data()));
                      STRATA_ASSIGN_OR_RETURN(std::vector<rt::TensorHandle> st,
                                              r.adam->state(r.params[k]));
                      return r.runtime->read(st.at(0), m.data());
                    });
}

// What the benchmarks read before and after the timed steps.
struct Snapshot {
  std::int64_t gpu_segment_allocs = 0;
  std::int64_t pinned_segment_allocs = 0;
  rt::RuntimeStats runtime;
};

Snapshot snapshot(rt::Runtime& runtime) {
  return {runtime.allocator().stats(Tier::kGpu).num_segment_allocs,
          runtime.allocator().stats(Tier::kPinnedHost).num_segment_allocs, runtime.stats()};
}

// Counters every strata benchmark reports: deltas over the timed steps, per step where it says so.
void report_runtime(benchmark::State& state, const Snapshot& before, const Snapshot& after) {
  const double steps = static_cast<double>(state.iterations());
  const rt::RuntimeStats& a = after.runtime;
  const rt::RuntimeStats& b = before.runtime;
  state.counters["host_syncs"] = static_cast<double>(a.host_syncs - b.host_syncs) / steps;
  // Both must be 0: no cudaMalloc or pinning once warm.
  state.counters["gpu_segment_allocs"] =
      static_cast<double>(after.gpu_segment_allocs - before.gpu_segment_allocs);
  state.counters["pinned_segment_allocs"] =
      static_cast<double>(after.pinned_segment_allocs - before.pinned_segment_allocs);
  state.counters["failed_migrations"] =
      static_cast<double>(a.failed_migrations - b.failed_migrations);
  state.counters["h2d_bytes_per_step"] =
      bytes_counter(static_cast<double>(a.migrated_bytes_h2d - b.migrated_bytes_h2d) / steps);
  state.counters["d2h_bytes_per_step"] =
      bytes_counter(static_cast<double>(a.migrated_bytes_d2h - b.migrated_bytes_d2h) / steps);
  const double h2d_ms = a.h2d_busy_ms - b.h2d_busy_ms;
  const double d2h_ms = a.d2h_busy_ms - b.d2h_busy_ms;
  if (h2d_ms > 0) {
    state.counters["engine_h2d_gbps"] =
        gb_per_s(static_cast<double>(a.timed_bytes_h2d - b.timed_bytes_h2d), h2d_ms / 1e3);
  }
  if (d2h_ms > 0) {
    state.counters["engine_d2h_gbps"] =
        gb_per_s(static_cast<double>(a.timed_bytes_d2h - b.timed_bytes_d2h), d2h_ms / 1e3);
  }
}

// The strata benchmarks' timing: warm-up steps, then one step per iteration, with the runtime's
// counters read around the timed steps. after_each (if given) runs after each timed step, for
// figures a step leaves behind. std::nullopt, with the benchmark skipped, on an error.
struct StrataTimed {
  double step_ms = 0;
  Snapshot before, after;
};
std::optional<StrataTimed> time_strata_steps(benchmark::State& state, rt::Runtime& runtime,
                                             const std::function<absl::StatusOr<double>()>& step,
                                             const std::function<void()>& after_each = {}) {
  for (int i = 0; i < kWarmupSteps; ++i) {
    if (absl::StatusOr<double> w = step(); !w.ok()) {
      skip(state, "warm-up step", w.status());
      return std::nullopt;
    }
  }
  StrataTimed out;
  out.before = snapshot(runtime);
  double total_ms = 0;
  for (auto _ : state) {
    absl::StatusOr<double> ms = step();
    if (!ms.ok()) {
      skip(state, "step", ms.status());
      break;
    }
    total_ms += *ms;
    if (after_each) after_each();
    state.SetIterationTime(*ms / 1e3);
  }
  if (state.error_occurred() || state.iterations() == 0) return std::nullopt;
  out.after = snapshot(runtime);
  out.step_ms = total_ms / static_cast<double>(state.iterations());
  return out;
}

#ifdef STRATA_HAS_CUDA
// One more step from an idle device, outside the clock, with its copies traced: how the step used
// each direction of the link (runtime/copy_trace.h). With STRATA_TRACE_DIR set, the copies are also
// written to $STRATA_TRACE_DIR/<name>.csv (direction, bytes, start and end in ms).
absl::StatusOr<strata::rt::LinkUse> traced_step(StrataRig& r, const std::string& name) {
  rt::Runtime& runtime = *r.runtime;
  STRATA_RETURN_IF_ERROR(cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  STRATA_RETURN_IF_ERROR(r.tracer->start(runtime.h2d_stream()));
  const absl::Status step = r.adam->step();
  const absl::Status idle = cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  absl::StatusOr<std::vector<strata::rt::CopySpan>> spans = r.tracer->finish();
  STRATA_RETURN_IF_ERROR(step);
  STRATA_RETURN_IF_ERROR(idle);
  if (!spans.ok()) return spans.status();
  if (const char* dir = std::getenv("STRATA_TRACE_DIR"); dir != nullptr && *dir != '\0') {
    std::ofstream csv(str_cat(dir, "/", name, ".csv"));
    csv << "direction,bytes,start_ms,end_ms\n";
    for (const strata::rt::CopySpan& c : *spans) {
      csv << (c.stream == runtime.h2d_stream() ? "h2d" : "d2h") << ',' << c.bytes << ','
          << c.start_ms << ',' << c.end_ms << '\n';
    }
    if (!csv) return absl::InternalError(str_cat("writing the trace into ", dir, " failed"));
  }
  return strata::rt::link_use(*spans, runtime.h2d_stream(), runtime.d2h_stream());
}
#endif

// The largest layer's bytes of optimizer states, from the runtime's registry.
double largest_layer_moment_bytes(rt::Runtime& runtime) {
  std::size_t largest = 0;
  for (int layer : runtime.layers()) {
    largest = std::max(largest, runtime.layer_bytes(layer, rt::RoleSet::optimizer_states()));
  }
  return static_cast<double>(largest);
}

void BM_StrataResident(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifdef STRATA_HAS_CUDA
  if (!require_bandwidths(state)) return;
  const Model& model = full_model();
  absl::StatusOr<StrataRig*> made = strata_rig(model, "keep_on_gpu", 0, rt::DeviceKind::kCuda);
  if (!made.ok()) return skip(state, "keep_on_gpu runtime with the model", made.status());
  StrataRig& r = **made;
  rt::Runtime& runtime = *r.runtime;
  const auto stream = static_cast<cudaStream_t>(runtime.compute_stream());
  EventPair ev;
  auto step = [&] { return time_on_stream(ev, stream, [&] { return r.adam->step(); }); };
  const std::optional<StrataTimed> timed = time_strata_steps(state, runtime, step);
  if (!timed) return;
  const Snapshot& before = timed->before;
  const Snapshot& after = timed->after;
  if (absl::Status s = check_strata("strata resident", r); !s.ok()) {
    return skip(state, "result check", s);
  }
  const double step_ms = timed->step_ms;
  const double bytes = kResidentBytesPerParam * static_cast<double>(model.params());
  const double floor_ms = ms_at(bytes, g_bw.hbm_gbps);
  state.counters["step_ms"] = step_ms;
  state.counters["floor_ms"] = floor_ms;
  state.counters["ratio_to_floor"] = floor_ms > 0 ? step_ms / floor_ms : 0;
  state.counters["hbm_gbps"] = g_bw.hbm_gbps;
  state.counters["achieved_gbps"] = gb_per_s(bytes, step_ms / 1e3);
  state.counters["hbm_fraction"] =
      g_bw.hbm_gbps > 0 ? gb_per_s(bytes, step_ms / 1e3) / g_bw.hbm_gbps : 0;
  state.counters["peak_extra_gpu_bytes"] = bytes_counter(0);
  state.counters["params"] = static_cast<double>(model.params());
  report_runtime(state, before, after);
  state.SetLabel(str_cat("optim::Adam (AdamW), policy keep_on_gpu, ", model.describe(),
                         ", CUDA events on the compute stream; floor 28 B/param over HBM"));
#endif
}
BENCHMARK(BM_StrataResident)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);

void BM_StrataBulk(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifdef STRATA_HAS_CUDA
  if (!require_bandwidths(state)) return;
  const Model& model = full_model();
  absl::StatusOr<StrataRig*> made = strata_rig(model, "bulk", 0, rt::DeviceKind::kCuda);
  if (!made.ok()) return skip(state, "bulk runtime with the model", made.status());
  StrataRig& r = **made;
  rt::Runtime& runtime = *r.runtime;

  // Steps start with the moments offloaded, as after the previous step of a bulk loop.
  double reload_ms = 0;
  LinkFloor link(LinkFloor::kSequential);
  auto step = sampled(link, [&]() -> absl::StatusOr<double> {
    return time_to_idle([&]() -> absl::Status {
      const Clock::time_point t0 = Clock::now();
      STRATA_RETURN_IF_ERROR(runtime.reload_all());
      reload_ms = seconds_between(t0, Clock::now()) * 1e3;
      STRATA_RETURN_IF_ERROR(r.adam->step());
      return runtime.offload_all();
    });
  });
  if (absl::Status s = runtime.offload_all(); !s.ok()) return skip(state, "first offload_all", s);
  // Extra GPU memory during the step: the allocator's GPU bytes with the moments reloaded, less
  // with them offloaded (measured in the warm-up, outside the clock).
  // wait_all() makes sure the sources of the completed moves are freed before the reading.
  double peak_extra = 0;
  {
    absl::Status s = runtime.wait_all();
    const std::int64_t offloaded = runtime.allocator().stats(Tier::kGpu).allocated_bytes.current;
    if (s.ok()) s = runtime.reload_all();
    if (s.ok()) s = runtime.wait_all();
    const std::int64_t loaded = runtime.allocator().stats(Tier::kGpu).allocated_bytes.current;
    peak_extra = static_cast<double>(loaded - offloaded);
    if (s.ok()) s = runtime.offload_all();
    if (s.ok()) s = runtime.wait_all();
    if (!s.ok()) return skip(state, "reload_all / offload_all before the steps", s);
  }
  double total_reload_ms = 0;
  const std::optional<StrataTimed> timed =
      time_strata_steps(state, runtime, step, [&] { total_reload_ms += reload_ms; });
  if (!timed) return;
  const Snapshot& before = timed->before;
  const Snapshot& after = timed->after;
  if (absl::Status s = check_strata("strata bulk", r); !s.ok()) {
    return skip(state, "result check", s);
  }
  const double steps = static_cast<double>(state.iterations());
  const double step_ms = timed->step_ms;
  const double moments = model.moment_bytes();
  // Out and back are two phases one after the other, each over one direction of the link.
  const double floor_ms = link.floor_ms(moments);
  state.counters["step_ms"] = step_ms;
  state.counters["reload_ms"] = total_reload_ms / steps;
  state.counters["step_and_offload_ms"] = step_ms - total_reload_ms / steps;
  state.counters["floor_ms"] = floor_ms;
  state.counters["ratio_to_floor"] = floor_ms > 0 ? step_ms / floor_ms : 0;
  state.counters["moment_bytes"] = bytes_counter(moments);
  state.counters["peak_extra_gpu_bytes"] = bytes_counter(peak_extra);
  link.report(state);
  report_runtime(state, before, after);
  state.SetLabel(
      str_cat("reload_all + optim::Adam step + offload_all, policy bulk, roles "
              "optimizer states, ",
              model.describe(),
              ", host wall to device idle; floor: moments over raw pinned H2D + over raw "
              "pinned D2H, each alone, passes before each step"));
#endif
}

void BM_StrataLayerPrefetch(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifdef STRATA_HAS_CUDA
  if (!require_bandwidths(state)) return;
  const int depth = static_cast<int>(state.range(0));
  const Model& model = full_model();
  absl::StatusOr<StrataRig*> made =
      strata_rig(model, "layer_prefetch", depth, rt::DeviceKind::kCuda);
  if (!made.ok()) return skip(state, "layer_prefetch runtime with the model", made.status());
  StrataRig& r = **made;
  rt::Runtime& runtime = *r.runtime;
  LinkFloor link(LinkFloor::kConcurrent);
  auto step = sampled(link, [&] { return time_to_idle([&] { return r.adam->step(); }); });
  const std::optional<StrataTimed> timed = time_strata_steps(state, runtime, step);
  if (!timed) return;
  const Snapshot& before = timed->before;
  const Snapshot& after = timed->after;
  const std::int64_t used_after = device_used_bytes();
  absl::StatusOr<strata::rt::LinkUse> use = traced_step(r, str_cat("layer_prefetch_k", depth));
  if (!use.ok()) return skip(state, "traced step", use.status());
  if (absl::Status s = check_strata(str_cat("strata layer_prefetch K=", depth), r); !s.ok()) {
    return skip(state, "result check", s);
  }
  const double steps = static_cast<double>(state.iterations());
  const double step_ms = timed->step_ms;
  const double moments = model.moment_bytes();
  const double floor_ms = link.floor_ms(moments);
  const double largest = largest_layer_moment_bytes(runtime);
  const double peak_extra = static_cast<double>(after.runtime.staging_bytes);
  const double bound = (depth + 1) * largest;
  state.counters["step_ms"] = step_ms;
  state.counters["floor_ms"] = floor_ms;
  state.counters["ratio_to_floor"] = floor_ms > 0 ? step_ms / floor_ms : 0;
  state.counters["prefetch_depth"] = depth;
  state.counters["moment_bytes"] = bytes_counter(moments);
  link.report(state);
  state.counters["achieved_gbps_per_direction"] = gb_per_s(moments, step_ms / 1e3);
  state.counters["peak_extra_gpu_bytes"] = bytes_counter(peak_extra);
  state.counters["staged_peak_bytes"] =
      bytes_counter(static_cast<double>(after.runtime.staged_peak_bytes));
  state.counters["largest_layer_moment_bytes"] = bytes_counter(largest);
  state.counters["extra_over_bound"] = bound > 0 ? peak_extra / bound : 0;
  // Cross-check from the driver: device memory in use now less before the first step (the ring,
  // and anything else the steps made the pools take).
  if (used_after >= 0 && r.device_used_at_create >= 0) {
    state.counters["device_used_growth_bytes"] =
        bytes_counter(static_cast<double>(used_after - r.device_used_at_create));
  }
  state.counters["prefetch_hits"] =
      static_cast<double>(after.runtime.prefetch_hits - before.runtime.prefetch_hits) / steps;
  state.counters["prefetch_waits"] =
      static_cast<double>(after.runtime.prefetch_waits - before.runtime.prefetch_waits) / steps;
  state.counters["prefetch_stall_ms"] =
      static_cast<double>(after.runtime.prefetch_stall_ns - before.runtime.prefetch_stall_ns) /
      1e6 / steps;
  // The traced step: where the link went idle in one direction or both.
  state.counters["trace_span_ms"] = use->span_ms;
  state.counters["trace_both_ms"] = use->both_ms;
  state.counters["trace_h2d_alone_ms"] = use->h2d_alone_ms;
  state.counters["trace_d2h_alone_ms"] = use->d2h_alone_ms;
  state.counters["trace_neither_ms"] = use->neither_ms;
  state.counters["trace_h2d_gbps_both"] = gb_per_s(use->h2d_bytes_both, use->both_ms / 1e3);
  state.counters["trace_d2h_gbps_both"] = gb_per_s(use->d2h_bytes_both, use->both_ms / 1e3);
  state.counters["trace_h2d_gbps_alone"] = gb_per_s(use->h2d_bytes_alone, use->h2d_alone_ms / 1e3);
  state.counters["trace_d2h_gbps_alone"] = gb_per_s(use->d2h_bytes_alone, use->d2h_alone_ms / 1e3);
  report_runtime(state, before, after);
  state.SetLabel(str_cat("optim::Adam step, policy layer_prefetch K=", depth,
                         ", moments pinned, params and grads on the GPU, ", model.describe(),
                         ", host wall to device idle; floor 8 B/param each way over raw pinned "
                         "per-direction bandwidth with both directions at once, passes before "
                         "each step"));
#endif
}

// ---------------------------------------------------------------------------------------------
// LibTorch peers.

#ifdef STRATA_BENCH_TORCH
at::TensorOptions f32(at::Device device) {
  return at::TensorOptions().dtype(at::kFloat).device(device);
}

// Parameters and gradients of `model` from the same sources as strata's, on `device`.
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

// Float32 step counters on the GPU, one per parameter, as torch.optim's fused AdamW keeps them.
std::vector<at::Tensor> make_step_counters(const Model& model) {
  std::vector<at::Tensor> out;
  for (int k = 0; k < model.count(); ++k) out.push_back(at::zeros({}, f32(at::kCUDA)));
  return out;
}

// One fused AdamW step over the lists, queued on the current stream: the step counters first, as
// torch.optim.AdamW(fused=True).step() does.
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

constexpr std::size_t kTorchAggregate = 0;  // StatType::AGGREGATE
constexpr c10::DeviceIndex kTorchDevice = 0;

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

struct TorchResidentRig final : Rig {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  std::int64_t step_count = 0;
};

absl::StatusOr<std::unique_ptr<TorchResidentRig>> make_torch_resident_rig(const Model& model) {
  g_torch_used = true;
  auto r = std::make_unique<TorchResidentRig>();
  STRATA_RETURN_IF_ERROR(make_torch_params(model, at::kCUDA, r->params, r->grads));
  for (const at::Tensor& p : r->params) {
    r->exp_avgs.push_back(at::zeros_like(p));
    r->exp_avg_sqs.push_back(at::zeros_like(p));
  }
  r->steps = make_step_counters(model);
  return r;
}

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

absl::StatusOr<std::unique_ptr<TorchOffloadRig>> make_torch_offload_rig(const Model& model) {
  g_torch_used = true;
  auto r = std::make_unique<TorchOffloadRig>();
  STRATA_RETURN_IF_ERROR(make_torch_params(model, at::kCUDA, r->params, r->grads));
  const at::TensorOptions pinned = f32(at::kCPU).pinned_memory(true);
  for (int k = 0; k < model.count(); ++k) {
    r->m_host.push_back(at::empty({model.numel(k)}, pinned).zero_());
    r->v_host.push_back(at::empty({model.numel(k)}, pinned).zero_());
  }
  r->steps = make_step_counters(model);
  const auto per = static_cast<std::size_t>(model.per_layer());
  for (int l = 0; l < model.layers; ++l) {
    const std::size_t b = static_cast<std::size_t>(l) * per;
    r->layer_params.emplace_back(r->params.begin() + b, r->params.begin() + b + per);
    r->layer_grads.emplace_back(r->grads.begin() + b, r->grads.begin() + b + per);
    r->layer_steps.emplace_back(r->steps.begin() + b, r->steps.begin() + b + per);
  }
  return r;
}

absl::StatusOr<TorchOffloadRig*> torch_offload_rig(const Model& model) {
  return rig<TorchOffloadRig>("torch/offload", [&] { return make_torch_offload_rig(model); });
}

absl::Status check_torch_offload(std::string_view what, const Model& model, TorchOffloadRig& r) {
  return check_ends(what, model, r.step_count,
                    [&](int k, std::vector<float>& p, std::vector<float>& m) -> absl::Status {
                      p = to_host_vector(r.params[k]);
                      m = to_host_vector(r.m_host[k]);
                      return absl::OkStatus();
                    });
}

// The bulk round trip, PyTorch style: every moment .to(cuda, non_blocking), one fused step, every
// moment copied back into its pinned tensor (non_blocking); the caller synchronizes.
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

// The per-layer pipeline with LibTorch streams: 2 slots of one layer's moments, allocated for the
// step from the caching allocator. For layer i in slot s = i % 2: the H2D stream fetches layer
// i + 1 into the other slot once the D2H that emptied it (layer i - 1's) is done; the compute
// stream (current) waits for layer i's arrival and runs the fused step on it; the D2H stream waits
// for that and copies layer i's moments back into their pinned tensors.
absl::Status torch_pipeline_step(const Model& model, TorchOffloadRig& r) {
  const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream();
  const int per = model.per_layer();
  std::array<at::Tensor, 2> slot;
  std::array<std::vector<at::Tensor>, 2> slot_m;
  std::array<std::vector<at::Tensor>, 2> slot_v;
  for (int s = 0; s < 2; ++s) {
    slot[s] = at::empty({2 * model.layer_numel()}, f32(at::kCUDA));
    for (int j = 0; j < per; ++j) {
      slot_m[s].push_back(slot[s].narrow(0, model.offset_in_layer(j), model.tensor_numel[j]));
      slot_v[s].push_back(
          slot[s].narrow(0, model.layer_numel() + model.offset_in_layer(j), model.tensor_numel[j]));
    }
  }
  std::array<c10::cuda::CUDAEvent, 2> arrived;
  std::array<c10::cuda::CUDAEvent, 2> computed;
  std::array<c10::cuda::CUDAEvent, 2> freed;  // not yet recorded: block() is a no-op

  auto fetch = [&](int layer, int s) {
    c10::cuda::CUDAStreamGuard guard(r.h2d);
    freed[s].block(r.h2d);
    for (int j = 0; j < per; ++j) {
      const std::size_t k = static_cast<std::size_t>(layer * per + j);
      slot_m[s][j].copy_(r.m_host[k], /*non_blocking=*/true);
      slot_v[s][j].copy_(r.v_host[k], /*non_blocking=*/true);
    }
    arrived[s].record(r.h2d);
  };
  fetch(0, 0);
  for (int layer = 0; layer < model.layers; ++layer) {
    const int s = layer % 2;
    if (layer + 1 < model.layers) fetch(layer + 1, 1 - s);
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
#endif  // STRATA_BENCH_TORCH

#ifndef STRATA_BENCH_TORCH
bool require_torch(benchmark::State& state) {
  skip(state, "built without LibTorch (STRATA_WITH_TORCH off) or without CUDA");
  return false;
}
#endif

void BM_TorchFusedAdamW(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifndef STRATA_BENCH_TORCH
  (void)require_torch(state);
#else
  if (!require_bandwidths(state)) return;
  torch_guarded(state, [&] {
    const Model& model = full_model();
    absl::StatusOr<TorchResidentRig*> made =
        rig<TorchResidentRig>("torch/resident", [&] { return make_torch_resident_rig(model); });
    if (!made.ok()) return skip(state, "LibTorch tensors of the model", made.status());
    TorchResidentRig& r = **made;
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream();
    EventPair ev;
    auto step = [&] {
      return time_on_stream(ev, compute.stream(), [&] {
        torch_fused_step(r.params, r.grads, r.exp_avgs, r.exp_avg_sqs, r.steps);
        ++r.step_count;
        return absl::OkStatus();
      });
    };
    for (int i = 0; i < kWarmupSteps; ++i) {
      if (absl::StatusOr<double> w = step(); !w.ok())
        return skip(state, "warm-up step", w.status());
    }
    c10::cuda::CUDACachingAllocator::resetPeakStats(kTorchDevice);
    const std::int64_t base = torch_allocated_now();
    double total_ms = 0;
    for (auto _ : state) {
      absl::StatusOr<double> ms = step();
      if (!ms.ok()) {
        skip(state, "step", ms.status());
        break;
      }
      total_ms += *ms;
      state.SetIterationTime(*ms / 1e3);
    }
    if (state.error_occurred() || state.iterations() == 0) return;
    const std::int64_t peak = torch_allocated_peak();
    absl::Status checked =
        check_ends("torch fused AdamW", model, r.step_count,
                   [&](int k, std::vector<float>& p, std::vector<float>& m) -> absl::Status {
                     p = to_host_vector(r.params[k]);
                     m = to_host_vector(r.exp_avgs[k]);
                     return absl::OkStatus();
                   });
    if (!checked.ok()) return skip(state, "result check", checked);
    const double step_ms = total_ms / static_cast<double>(state.iterations());
    const double bytes = kResidentBytesPerParam * static_cast<double>(model.params());
    const double floor_ms = ms_at(bytes, g_bw.hbm_gbps);
    state.counters["step_ms"] = step_ms;
    state.counters["floor_ms"] = floor_ms;
    state.counters["ratio_to_floor"] = floor_ms > 0 ? step_ms / floor_ms : 0;
    state.counters["hbm_gbps"] = g_bw.hbm_gbps;
    state.counters["achieved_gbps"] = gb_per_s(bytes, step_ms / 1e3);
    state.counters["peak_extra_gpu_bytes"] = bytes_counter(static_cast<double>(peak - base));
    state.counters["params"] = static_cast<double>(model.params());
    state.SetLabel(
        str_cat("at::_fused_adamw_ (+ _foreach_add_ of the float step counters), all "
                "resident, ",
                model.count(), " tensors in one call, ", model.describe(),
                ", CUDA events on the current stream"));
  });
#endif
}

#ifdef STRATA_BENCH_TORCH
struct TimedSteps {
  double step_ms = 0;
  double peak_extra = 0;  // the caching allocator's peak above what was allocated before a step
};

// The LibTorch offloading peers' timing: warm-up steps, then one step per iteration with the
// caching allocator's peak restarted (outside the clock) from what is allocated before it.
// std::nullopt, with the benchmark skipped, on an error.
std::optional<TimedSteps> time_torch_offload_steps(
    benchmark::State& state, const std::function<absl::StatusOr<double>()>& step) {
  for (int i = 0; i < kWarmupSteps; ++i) {
    if (absl::StatusOr<double> w = step(); !w.ok()) {
      skip(state, "warm-up step", w.status());
      return std::nullopt;
    }
  }
  double total_ms = 0;
  TimedSteps out;
  for (auto _ : state) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(kTorchDevice);
    const std::int64_t base = torch_allocated_now();
    absl::StatusOr<double> ms = step();
    if (!ms.ok()) {
      skip(state, "step", ms.status());
      break;
    }
    out.peak_extra = std::max(out.peak_extra, static_cast<double>(torch_allocated_peak() - base));
    total_ms += *ms;
    state.SetIterationTime(*ms / 1e3);
  }
  if (state.error_occurred() || state.iterations() == 0) return std::nullopt;
  out.step_ms = total_ms / static_cast<double>(state.iterations());
  return out;
}
#endif

void BM_TorchBulkTo(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifndef STRATA_BENCH_TORCH
  (void)require_torch(state);
#else
  if (!require_bandwidths(state)) return;
  torch_guarded(state, [&] {
    const Model& model = full_model();
    absl::StatusOr<TorchOffloadRig*> made = torch_offload_rig(model);
    if (!made.ok()) return skip(state, "LibTorch tensors of the model", made.status());
    TorchOffloadRig& r = **made;
    LinkFloor link(LinkFloor::kSequential);
    auto step = sampled(link, [&] { return time_to_idle([&] { return torch_bulk_step(r); }); });
    std::optional<TimedSteps> timed = time_torch_offload_steps(state, step);
    if (!timed) return;
    if (absl::Status s = check_torch_offload("torch bulk .to()", model, r); !s.ok()) {
      return skip(state, "result check", s);
    }
    const double step_ms = timed->step_ms;
    const double moments = model.moment_bytes();
    const double floor_ms = link.floor_ms(moments);
    state.counters["step_ms"] = step_ms;
    state.counters["floor_ms"] = floor_ms;
    state.counters["ratio_to_floor"] = floor_ms > 0 ? step_ms / floor_ms : 0;
    state.counters["moment_bytes"] = bytes_counter(moments);
    state.counters["peak_extra_gpu_bytes"] = bytes_counter(timed->peak_extra);
    link.report(state);
    state.SetLabel(
        str_cat("moments pinned CPU tensors: .to(cuda, non_blocking) all, "
                "at::_fused_adamw_, copy_(non_blocking) back, synchronize; ",
                model.describe(), ", host wall to device idle; floor as StrataBulk"));
  });
#endif
}

void BM_TorchPerLayerPipeline(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifndef STRATA_BENCH_TORCH
  (void)require_torch(state);
#else
  if (!require_bandwidths(state)) return;
  torch_guarded(state, [&] {
    const Model& model = full_model();
    absl::StatusOr<TorchOffloadRig*> made = torch_offload_rig(model);
    if (!made.ok()) return skip(state, "LibTorch tensors of the model", made.status());
    TorchOffloadRig& r = **made;
    LinkFloor link(LinkFloor::kConcurrent);
    auto step =
        sampled(link, [&] { return time_to_idle([&] { return torch_pipeline_step(model, r); }); });
    std::optional<TimedSteps> timed = time_torch_offload_steps(state, step);
    if (!timed) return;
    if (absl::Status s = check_torch_offload("torch per-layer pipeline", model, r); !s.ok()) {
      return skip(state, "result check", s);
    }
    const double step_ms = timed->step_ms;
    const double moments = model.moment_bytes();
    const double floor_ms = link.floor_ms(moments);
    link.report(state);
    state.counters["step_ms"] = step_ms;
    state.counters["floor_ms"] = floor_ms;
    state.counters["ratio_to_floor"] = floor_ms > 0 ? step_ms / floor_ms : 0;
    state.counters["moment_bytes"] = bytes_counter(moments);
    state.counters["achieved_gbps_per_direction"] = gb_per_s(moments, step_ms / 1e3);
    state.counters["peak_extra_gpu_bytes"] = bytes_counter(timed->peak_extra);
    state.counters["largest_layer_moment_bytes"] =
        bytes_counter(kMomentBytesPerParam * static_cast<double>(model.layer_numel()));
    state.SetLabel(
        str_cat("LibTorch streams: H2D + D2H from the pool, compute current, 2 slots "
                "of a layer's moments, CUDAEvents between them, at::_fused_adamw_ per "
                "layer; ",
                model.describe(), ", host wall to device idle; floor as StrataLayerPrefetch"));
  });
#endif
}

void BM_TorchCpuAdamW(benchmark::State& state) {
  if (!require_gpu(state)) return;
#ifndef STRATA_BENCH_TORCH
  (void)require_torch(state);
#else
  torch_guarded(state, [&] {
    const Model& model = cpu_model();
    struct CpuRig final : Rig {
      std::vector<at::Tensor> params;
      std::unique_ptr<torch::optim::AdamW> optimizer;
      std::int64_t step_count = 0;
    };
    absl::StatusOr<CpuRig*> made =
        rig<CpuRig>("torch/cpu", [&]() -> absl::StatusOr<std::unique_ptr<CpuRig>> {
          g_torch_used = true;
          auto r = std::make_unique<CpuRig>();
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
        });
    if (!made.ok()) return skip(state, "CPU tensors", made.status());
    CpuRig& r = **made;
    auto step = [&] {
      const Clock::time_point t0 = Clock::now();
      r.optimizer->step();
      ++r.step_count;
      return seconds_between(t0, Clock::now()) * 1e3;
    };
    for (int i = 0; i < kWarmupSteps; ++i) (void)step();
    double total_ms = 0;
    for (auto _ : state) {
      const double ms = step();
      total_ms += ms;
      state.SetIterationTime(ms / 1e3);
    }
    absl::Status checked = check_ends(
        "torch CPU AdamW", model, r.step_count,
        [&](int k, std::vector<float>& p, std::vector<float>& m) -> absl::Status {
          p = to_host_vector(r.params[k].detach());
          m.clear();  // the optimizer's state is not read here; the parameters depend on it
          return absl::OkStatus();
        });
    if (!checked.ok()) return skip(state, "result check", checked);
    const double step_ms = total_ms / static_cast<double>(state.iterations());
    state.counters["step_ms"] = step_ms;
    state.counters["ms_scaled"] = step_ms * kCpuScale;
    state.counters["scale"] = kCpuScale;
    state.counters["threads"] = at::get_num_threads();
    state.counters["params"] = static_cast<double>(model.params());
    state.counters["peak_extra_gpu_bytes"] = bytes_counter(0);
    state.SetLabel(str_cat("torch::optim::AdamW on CPU tensors, ", at::get_num_threads(),
                           " threads, 1/", kCpuScale, " of the model (", model.describe(),
                           "); ms_scaled = step_ms x ", kCpuScale,
                           "; scaled, transfers not counted"));
  });
#endif
}

BENCHMARK(BM_TorchFusedAdamW)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_StrataBulk)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
// The two LibTorch offload peers share one rig (pinned moments): keep them next to each other.
BENCHMARK(BM_TorchBulkTo)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TorchPerLayerPipeline)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_StrataLayerPrefetch)
    ->Arg(1)
    ->Arg(2)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TorchCpuAdamW)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);

// ---------------------------------------------------------------------------------------------
// The simulated device: layer_prefetch K=1 on a tiny model, host memcpy, not PCIe.

void BM_SimulatedLayerPrefetch(benchmark::State& state) {
  const Model& model = tiny_model();
  constexpr int kDepth = 1;
  absl::StatusOr<StrataRig*> made =
      strata_rig(model, "layer_prefetch", kDepth, rt::DeviceKind::kSimulated);
  if (!made.ok()) return skip(state, "simulated runtime with the model", made.status());
  StrataRig& r = **made;
  rt::Runtime& runtime = *r.runtime;
  // The simulated device runs each operation when it is enqueued: the step is done on return.
  auto step = [&]() -> absl::StatusOr<double> {
    const Clock::time_point t0 = Clock::now();
    STRATA_RETURN_IF_ERROR(r.adam->step());
    return seconds_between(t0, Clock::now()) * 1e3;
  };
  const std::optional<StrataTimed> timed = time_strata_steps(state, runtime, step);
  if (!timed) return;
  const Snapshot& before = timed->before;
  const Snapshot& after = timed->after;
  if (absl::Status s = runtime.wait_all(); !s.ok()) return skip(state, "wait_all", s);
  if (absl::Status s = check_strata("simulated layer_prefetch", r); !s.ok()) {
    return skip(state, "result check", s);
  }
  const double largest = largest_layer_moment_bytes(runtime);
  const double peak_extra = static_cast<double>(after.runtime.staging_bytes);
  state.counters["step_ms"] = timed->step_ms;
  state.counters["peak_extra_gpu_bytes"] = bytes_counter(peak_extra);
  state.counters["staged_peak_bytes"] =
      bytes_counter(static_cast<double>(after.runtime.staged_peak_bytes));
  state.counters["largest_layer_moment_bytes"] = bytes_counter(largest);
  state.counters["extra_over_bound"] = largest > 0 ? peak_extra / ((kDepth + 1) * largest) : 0;
  report_runtime(state, before, after);
  state.SetLabel(
      str_cat("simulated device: host memcpy and the CPU kernel, not PCIe; "
              "layer_prefetch K=",
              kDepth, ", ", model.describe()));
}
BENCHMARK(BM_SimulatedLayerPrefetch)
    ->UseManualTime()
    ->Iterations(10)
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
#ifdef STRATA_BENCH_TORCH
  at::set_num_threads(cores);  // the CPU peer uses every core
#endif
#ifdef STRATA_HAS_CUDA
  // Before any rig exists, so the measurement has the GPU and the link to itself; the raw copy
  // buffers stay for the passes next to each offloaded step.
  if (have_gpu()) {
    absl::StatusOr<Bandwidths> bw = measure_bandwidths();
    if (bw.ok()) {
      g_bw = *bw;
    } else {
      g_bw.error = bw.status().ToString();
    }
  }
#endif
  const Model& model = full_model();
  benchmark::AddCustomContext("gpu", strata::alloc::cuda_device_name(0));
  benchmark::AddCustomContext("params", std::to_string(model.params()));
  benchmark::AddCustomContext("layers", std::to_string(model.layers));
  benchmark::AddCustomContext("model", model.describe());
  benchmark::AddCustomContext("moment_bytes",
                              str_cat(static_cast<std::int64_t>(model.moment_bytes())));
  benchmark::AddCustomContext("hyper", "AdamW lr=1e-3 betas=(0.9,0.999) eps=1e-8 wd=0.01");
  if (g_bw.measured) {
    benchmark::AddCustomContext("hbm_gbps", str_cat(g_bw.hbm_gbps));
    benchmark::AddCustomContext("pinned_h2d_gbps", str_cat(g_bw.h2d_gbps));
    benchmark::AddCustomContext("pinned_d2h_gbps", str_cat(g_bw.d2h_gbps));
    benchmark::AddCustomContext("pinned_both_per_direction_gbps",
                                str_cat(g_bw.both_per_direction_gbps));
    benchmark::AddCustomContext("pinned_both_h2d_gbps", str_cat(g_bw.both_h2d_gbps));
    benchmark::AddCustomContext("pinned_both_d2h_gbps", str_cat(g_bw.both_d2h_gbps));
  } else {
    benchmark::AddCustomContext("bandwidth_error", g_bw.error);
  }
  benchmark::AddCustomContext(
      "bandwidth_method",
      str_cat("HBM: cudaMemcpyAsync device to device of 2 GiB, 2 x bytes / time, median of ",
              kHbmPasses, "; pinned: cudaMemcpyAsync cudaMalloc <-> cudaHostAlloc(portable), ",
              kPieces, " x 256 MiB per direction, non-blocking streams, CUDA events, median of ",
              kLinkPasses, "; both at once: bytes each way / span"));
  benchmark::AddCustomContext(
      "timing",
      "resident: CUDA events on the computing stream; offloaded: host wall from an idle "
      "device to cudaDeviceSynchronize after the step; warm-up 2 steps");
  benchmark::AddCustomContext("cpu_threads", std::to_string(cores));
#if defined(STRATA_BENCH_TORCH) && defined(TORCH_VERSION)
  benchmark::AddCustomContext("torch", TORCH_VERSION);
#elif defined(STRATA_BENCH_TORCH)
  benchmark::AddCustomContext("torch", "yes");
#else
  benchmark::AddCustomContext("torch", "no");
#endif
  benchmark::RunSpecifiedBenchmarks();
  release_rig();
  release_device_sources();
#ifdef STRATA_HAS_CUDA
  delete g_link;
  g_link = nullptr;
#endif
  benchmark::Shutdown();
  return 0;
}
