// bench/optim_common.h: the optimizer benchmarks' shared rig: the 1.5B-parameter model (and
// smaller ones for the scaling curves), its pseudo-random values, the host AdamW that checks every
// approach's result, the link and HBM bandwidths the floors divide by, timing helpers, and strata's
// runtime + Adam over a model. Used by strata_optim_bench (Google Benchmark, one approach at a
// time) and strata_optim_compare (approaches interleaved, scaling curves).
//
// Example:
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<StrataRig> r,
//                           make_strata_rig(full_model(), "layer_prefetch", 1,
//                           rt::DeviceKind::kCuda));
//   LinkFloor link(LinkFloor::kConcurrent);
//   STRATA_RETURN_IF_ERROR(link.sample());
//   STRATA_ASSIGN_OR_RETURN(double ms, time_to_idle([&] { return r->adam->step(); }));
//   STRATA_RETURN_IF_ERROR(check_strata("layer_prefetch", *r));
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/tiered_allocator.h"
#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "bench/bench_util.h"
#include "bench/link_rig.h"
#include "optim/adam.h"
#include "optim/adam_math.h"
#include "runtime/copy_trace.h"
#include "runtime/device.h"
#include "runtime/runtime.h"

namespace strata::bench {

using Clock = std::chrono::steady_clock;

inline constexpr int kWarmupSteps = 2;

// AdamW as every approach runs it.
inline constexpr optim::AdamHyper kHyper{.lr = 1e-3f,
                                         .beta1 = 0.9f,
                                         .beta2 = 0.999f,
                                         .eps = 1e-8f,
                                         .weight_decay = 0.01f,
                                         .decoupled = true};

// Bytes per parameter a resident step moves through HBM: reads p, g, m, v; writes p, m, v.
inline constexpr double kResidentBytesPerParam = 28;
// Bytes per parameter of Adam's moments (fp32 exp_avg + exp_avg_sq): what offloading moves each
// way.
inline constexpr double kMomentBytesPerParam = 8;

// Milliseconds to move `bytes` at `gbps` decimal GB/s.
inline double ms_at(double bytes, double gbps) { return gbps > 0 ? bytes / (gbps * 1e9) * 1e3 : 0; }

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
const Model& full_model();
// 1/8 of it, for the scaled CPU peer of strata_optim_bench.
const Model& cpu_model();
inline constexpr int kCpuScale = 8;
// The simulated run: 2 layers x 64K.
const Model& tiny_model();

// ---------------------------------------------------------------------------------------------
// Values: every tensor k reads a window of one fixed pseudo-random buffer starting kSourceShift * k
// floats in, so tensors differ and the buffers stay small (64 MB each).

inline constexpr std::int64_t kMaxTensorNumel = 16'000'000;
inline constexpr int kMaxTensors = 16384;
inline constexpr std::int64_t kSourceShift = 97;
inline constexpr std::int64_t kSourceFloats = kMaxTensorNumel + kMaxTensors * kSourceShift;
inline constexpr std::uint64_t kParamSeed = 0x5354'5241'5441'0101;  // "STRATA" ...
inline constexpr std::uint64_t kGradSeed = 0x5354'5241'5441'0202;

inline std::int64_t source_offset(int k) { return k * kSourceShift; }

// Fails (STRATA_CHECK) unless every tensor of `model` has a window in the sources.
void check_fits(const Model& model);

struct HostSources {
  std::vector<float> params;  // uniform in [-1, 1)
  std::vector<float> grads;   // uniform in [-0.01, 0.01)
};
const HostSources& host_sources();

// ---------------------------------------------------------------------------------------------
// Checking results against a host AdamW.

inline constexpr std::int64_t kCheckedElements = 1024;  // at each end of a checked tensor
inline constexpr float kCheckAtol = 1e-5f;
inline constexpr float kCheckRtol = 1e-4f;  // one step more or less changes a parameter by ~1e-3

// The element indices of tensor k that are checked.
std::vector<std::int64_t> checked_indices(std::int64_t numel);

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
inline Bandwidths g_bw;

inline constexpr std::size_t kHbmCopyBytes = 2 * kGiB;
inline constexpr int kLinkPasses = 3;
inline constexpr int kHbmPasses = 5;

double median(std::vector<double> v);

#ifdef STRATA_HAS_CUDA

// The raw copy buffers: made by measure_bandwidths before any rig, kept for the passes next to each
// offloaded step; the caller deletes it at the end of main (no CUDA call in static destructors).
inline LinkRig* g_link = nullptr;

// HBM: a 2 GiB device-to-device cudaMemcpyAsync (read + write = 2 x bytes), median of 5 after a
// warm-up. Pinned: each direction alone and both at once, median of 3 passes after a warm-up.
absl::StatusOr<Bandwidths> measure_bandwidths();

// HBM bandwidth from one 2 GiB device-to-device copy (read + write counted), on g_link's buffers.
absl::StatusOr<double> sample_hbm();

// An offloaded approach's floor from raw passes right before each of its steps, outside the
// step's clock (See Note [Adjacent floor] in bench/link_rig.h). kConcurrent: both directions at
// once, as layer_prefetch and the per-layer pipeline move their bytes (floor = bytes each way over
// the span); kSequential: each direction alone, as bulk moves everything in and then everything out
// (floor = bytes over the H2D rate + bytes over the D2H rate). Needs g_link.
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
  Kind kind() const { return kind_; }
  // The floor's denominators over every sample so far (decimal GB/s).
  double per_direction_gbps() const { return both_.span_gbps(); }
  double h2d_gbps() const { return h2d_.h2d_gbps(); }
  double d2h_gbps() const { return d2h_.d2h_gbps(); }

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

// ---------------------------------------------------------------------------------------------
// Rigs: one approach's state (model tensors, runtime, optimizer), freed with the object.

struct Rig {
  virtual ~Rig() = default;
};

// GPU copies of the value sources, for registering and cloning without host round trips; made on
// first use, freed by release_device_sources (call it before main returns).
struct DeviceSources {
  float* params = nullptr;
  float* grads = nullptr;
};
void release_device_sources();

#ifdef STRATA_HAS_CUDA
absl::StatusOr<DeviceSources> device_sources();

// cudaMemGetInfo's total less free, or -1.
std::int64_t device_used_bytes();

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

// Host wall milliseconds through fn: for steps that are done when fn returns (on the CPU, or on the
// simulated device, which runs each operation when it is enqueued).
template <typename Fn>
absl::StatusOr<double> time_on_host(Fn fn) {
  const Clock::time_point t0 = Clock::now();
  STRATA_RETURN_IF_ERROR(fn());
  return seconds_between(t0, Clock::now()) * 1e3;
}

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

// The model's tensors registered as parameters and gradients (layer by layer, values from the
// sources), an Adam over them with kHyper, policy `policy` with prefetch depth `depth`, roles
// optimizer states. CUDA rigs trace their copies on demand (traced_step).
absl::StatusOr<std::unique_ptr<StrataRig>> make_strata_rig(
    const Model& model, std::string policy, int depth, rt::DeviceKind device,
    alloc::GpuSegments segments = alloc::GpuSegments::kAuto);

// Parameters and exp_avg read back through the runtime (host waits, outside every timed region).
absl::Status check_strata(std::string_view what, StrataRig& r);

// The largest layer's bytes of optimizer states, from the runtime's registry.
double largest_layer_moment_bytes(rt::Runtime& runtime);

#ifdef STRATA_HAS_CUDA
// One more step from an idle device, outside the clock, with its copies traced: how the step used
// each direction of the link (runtime/copy_trace.h). With STRATA_TRACE_DIR set, the copies are also
// written to $STRATA_TRACE_DIR/<name>.csv (direction, bytes, start and end in ms).
absl::StatusOr<rt::LinkUse> traced_step(StrataRig& r, const std::string& name);
#endif

}  // namespace strata::bench
