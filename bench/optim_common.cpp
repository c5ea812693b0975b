// bench/optim_common.cpp: the optimizer benchmarks' shared rig (bench/optim_common.h).
#include "bench/optim_common.h"

#include <cstdlib>
#include <fstream>
#include <utility>

#include "allocator/tier.h"
#include "policies/builtin.h"

namespace strata::bench {

using alloc::Tier;

const Model& full_model() {
  static const Model* const m = new Model{32, {12'000'000, 4'000'000, 16'000'000, 16'000'000}};
  return *m;
}
const Model& cpu_model() {
  static const Model* const m = new Model{4, full_model().tensor_numel};
  return *m;
}
const Model& tiny_model() {
  static const Model* const m = new Model{2, {64 * 1024}};
  return *m;
}

void check_fits(const Model& model) {
  STRATA_CHECK(model.count() <= kMaxTensors, "model has ", model.count(), " tensors");
  for (std::int64_t n : model.tensor_numel) {
    STRATA_CHECK(n <= kMaxTensorNumel && n % 4 == 0, "tensor of ", n, " elements");
  }
}

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

std::vector<std::int64_t> checked_indices(std::int64_t numel) {
  std::vector<std::int64_t> out;
  const std::int64_t head = std::min(kCheckedElements, numel);
  for (std::int64_t i = 0; i < head; ++i) out.push_back(i);
  for (std::int64_t i = std::max(head, numel - kCheckedElements); i < numel; ++i) out.push_back(i);
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

#ifdef STRATA_HAS_CUDA

absl::StatusOr<double> sample_hbm() {
  LinkRig& rig = *g_link;
  STRATA_RETURN_IF_ERROR(cuda_status(cudaEventRecord(rig.start[0], rig.stream[0]), "record"));
  STRATA_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(rig.gpu[0], rig.gpu[1], kHbmCopyBytes,
                                                     cudaMemcpyDeviceToDevice, rig.stream[0]),
                                     "cudaMemcpyAsync (device to device)"));
  STRATA_RETURN_IF_ERROR(cuda_status(cudaEventRecord(rig.end[0], rig.stream[0]), "record"));
  STRATA_RETURN_IF_ERROR(cuda_status(cudaEventSynchronize(rig.end[0]), "cudaEventSynchronize"));
  float ms = 0;
  STRATA_RETURN_IF_ERROR(
      cuda_status(cudaEventElapsedTime(&ms, rig.start[0], rig.end[0]), "elapsed"));
  return gb_per_s(2.0 * kHbmCopyBytes, ms / 1e3);
}

absl::StatusOr<Bandwidths> measure_bandwidths() {
  auto made = std::make_unique<LinkRig>();
  STRATA_RETURN_IF_ERROR(init_link_rig(*made, kParamSeed ^ kGradSeed));
  g_link = made.release();
  LinkRig& rig = *g_link;
  Bandwidths out;

  std::vector<double> hbm;
  for (int pass = 0; pass <= kHbmPasses; ++pass) {
    STRATA_ASSIGN_OR_RETURN(double gbps, sample_hbm());
    if (pass > 0) hbm.push_back(gbps);
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
#endif  // STRATA_HAS_CUDA

namespace {
DeviceSources g_device_sources;
}  // namespace

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
#endif  // STRATA_HAS_CUDA

absl::StatusOr<std::unique_ptr<StrataRig>> make_strata_rig(const Model& model, std::string policy,
                                                           int depth, rt::DeviceKind device,
                                                           alloc::GpuSegments segments) {
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
  options.allocator.gpu_segments = segments;
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

double largest_layer_moment_bytes(rt::Runtime& runtime) {
  std::size_t largest = 0;
  for (int layer : runtime.layers()) {
    largest = std::max(largest, runtime.layer_bytes(layer, rt::RoleSet::optimizer_states()));
  }
  return static_cast<double>(largest);
}

#ifdef STRATA_HAS_CUDA
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
#endif  // STRATA_HAS_CUDA

}  // namespace strata::bench
