// bench/optim_compare.cpp: strata's optimizer step and its peers in alternation, and how its cost
// grows. Where strata_optim_bench runs one approach after another (Google Benchmark), this runs
// the approaches of each comparison in rounds, A B A B ... (the order reversed every other round),
// each step with its own reference sampled right before it: raw pinned link passes for offloaded
// steps (See Note [Adjacent floor] in bench/link_rig.h), a 2 GiB device-to-device copy for resident
// ones. tools/gpu/summarize_compare.py turns the samples into median, min and max, a verdict per
// comparison (PASS / FAIL / WITHIN NOISE: only a difference larger than the spread of the rounds
// is a verdict), fits and SVG plots.
//
// Parts (--parts=a,b,...; all by default):
//   resident    strata keep_on_gpu against at::_fused_adamw_, everything on the GPU (full model);
//               the fraction of HBM bandwidth each reaches.
//   streamed    layer_prefetch K=1 against the LibTorch per-layer pipeline with 2 GPU slots and
//               against torch's fused AdamW on the CPU over the whole model (torch.optim.AdamW(
//               fused=True) on CPU tensors); K=2 against the pipeline with 3 slots.
//   bulk        bulk (reload_all, step, offload_all) against the PyTorch .to() round trip, with
//               offload_all giving the GPU memory back to the driver (the default) and keeping it
//               cached; offload_all + reload_all alone, with expandable and with fixed segments;
//               the GPU tier's mapping and unmapping time in each sample.
//   bytes       layer_prefetch K=1 over 2, 4, 8, 16, 32 layers of the full model's layer (0.77 to
//               12.3 GB of moments each way).
//   layers      layer_prefetch K=1 over 128e6 parameters in 8, 32, 128, 512 layers of one tensor.
//   tensors     layer_prefetch K=1 and the LibTorch pipeline over 100 layers of 100 tensors of
//               4 KiB .. 1 MiB (10^4 tensors) and over the same layers as one tensor each.
//   mixed       bfloat16 parameters with float32 masters and moments (bench/compare_mixed.cpp):
//               strata keep_on_gpu against PyTorch's fused AdamW over float32 masters;
//               layer_prefetch K=1 and K=2 streaming masters and moments against PyTorch's
//               per-layer pipeline with pinned states at 2 and 3 slots, each step judged against
//               its link floor and a floor over its own pinned buffers.
//   first_step  from nothing to the end of the first step, and the host memory it took (RSS,
//               pinned reserved and held), for strata layer_prefetch K=1, the LibTorch pipeline
//               and torch's CPU AdamW, at 2 .. 32 layers.
// Every approach's result is checked against a host AdamW after its rounds (bench/optim_common.h),
// so a fast but wrong step fails the run.
//
// Run (needs a GPU; without one it writes a JSON that says so and exits 0):
//   build/bin/strata_optim_compare --out=compare.json [--rounds=7] [--parts=resident,streamed]
//   python3 tools/gpu/summarize_compare.py compare.json --svg-dir=DIR
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/tier.h"
#include "base/status.h"
#include "base/strings.h"
#include "bench/compare_rounds.h"
#include "bench/optim_common.h"
#include "bench/optim_torch.h"

#ifdef STRATA_BENCH_TORCH
#include <ATen/Parallel.h>
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace {

using namespace strata::bench;  // NOLINT: the benchmark's whole vocabulary
namespace rt = strata::rt;
using strata::str_cat;
using strata::alloc::Tier;

#ifdef STRATA_HAS_CUDA

void part_resident(int rounds) {
  const Model& model = full_model();
  const double bytes = kResidentBytesPerParam * static_cast<double>(model.params());
  std::unique_ptr<StrataRig> strata_rig =
      must(make_strata_rig(model, "keep_on_gpu", 0, rt::DeviceKind::kCuda), "resident rig");
  if (strata_rig == nullptr) return;
  std::vector<Approach> approaches;
  EventPair strata_ev;
  auto resident = [&](EventPair& ev, cudaStream_t stream,
                      const std::function<absl::Status()>& step) -> absl::StatusOr<Sample> {
    STRATA_ASSIGN_OR_RETURN(double hbm, sample_hbm());
    STRATA_ASSIGN_OR_RETURN(double ms, time_on_stream(ev, stream, step));
    Sample s;
    s.ms = ms;
    s.ref_gbps = hbm;
    s.floor_ms = ms_at(bytes, hbm);
    return s;
  };
  const auto strata_stream = static_cast<cudaStream_t>(strata_rig->runtime->compute_stream());
  approaches.push_back({"resident/strata", "strata keep_on_gpu, optim::Adam (fused kernel)", [&] {
                          return resident(strata_ev, strata_stream,
                                          [&] { return strata_rig->adam->step(); });
                        }});
#ifdef STRATA_BENCH_TORCH
  std::unique_ptr<TorchResidentRig> torch_rig;
  EventPair torch_ev;
  try {
    absl::StatusOr<std::unique_ptr<TorchResidentRig>> made = make_torch_resident_rig(model);
    if (!made.ok()) return fail("torch resident rig", made.status());
    torch_rig = std::move(*made);
    const cudaStream_t torch_stream = c10::cuda::getCurrentCUDAStream().stream();
    approaches.push_back(
        {"resident/torch", "at::_fused_adamw_ (torch.optim.AdamW fused=True)", [&, torch_stream] {
           return resident(torch_ev, torch_stream, [&] { return torch_resident_step(*torch_rig); });
         }});
  } catch (const std::exception& e) {
    return fail("torch resident rig", absl::InternalError(e.what()));
  }
#endif
  if (absl::Status s = interleave("resident", approaches, rounds); !s.ok()) {
    return fail("resident", s);
  }
  check("resident/strata", check_strata("strata resident", *strata_rig));
#ifdef STRATA_BENCH_TORCH
  check("resident/torch", check_torch_resident("torch resident", model, *torch_rig));
  add_comparison("resident step: strata / torch fused AdamW", "faster", "resident/strata",
                 "resident/torch", 1.0);
#endif
  add_comparison("resident step: strata's fraction of HBM bandwidth (28 B/param)", "fraction",
                 "resident/strata", "", 0.85);
  g_results.series["resident/strata"].info["params"] = static_cast<double>(model.params());
  strata_rig.reset();
#ifdef STRATA_BENCH_TORCH
  torch_rig.reset();
#endif
  empty_caches();
}

void part_streamed(int rounds) {
  const Model& model = full_model();
  const double moments = model.moment_bytes();
#ifndef STRATA_BENCH_TORCH
  (void)rounds;
  (void)moments;
  fail("streamed", absl::UnimplementedError("built without LibTorch: no peers to compare with"));
#else
  try {
    absl::StatusOr<std::unique_ptr<TorchOffloadRig>> made_torch = make_torch_offload_rig(model);
    if (!made_torch.ok()) return fail("torch offload rig", made_torch.status());
    std::unique_ptr<TorchOffloadRig> torch_rig = std::move(*made_torch);
    auto pipeline = [&](int slots) {
      return Approach{str_cat("streamed/torch_pipeline_", slots),
                      str_cat("LibTorch per-layer pipeline, ", slots,
                              " GPU slots, at::_fused_adamw_ per layer"),
                      [&, slots] {
                        return offloaded_sample(LinkFloor::kConcurrent, moments, [&, slots] {
                          return torch_pipeline_step(model, *torch_rig, slots);
                        });
                      }};
    };

    // K=1 against 2 slots and the CPU.
    {
      std::unique_ptr<StrataRig> k1 = must(
          make_strata_rig(model, "layer_prefetch", 1, rt::DeviceKind::kCuda), "layer_prefetch K=1");
      if (k1 == nullptr) return;
      absl::StatusOr<std::unique_ptr<TorchResidentRig>> made_cpu =
          make_torch_resident_rig(model, at::kCPU);
      if (!made_cpu.ok()) return fail("torch CPU rig", made_cpu.status());
      std::unique_ptr<TorchResidentRig> cpu = std::move(*made_cpu);
      std::vector<Approach> approaches;
      approaches.push_back(strata_streamed("streamed/strata_k1", "strata layer_prefetch K=1", *k1));
      approaches.push_back(pipeline(2));
      approaches.push_back({"streamed/torch_cpu_fused",
                            str_cat("torch AdamW fused on the CPU (at::_fused_adamw_ on CPU "
                                    "tensors), whole model, ",
                                    at::get_num_threads(), " threads; no transfers"),
                            [&]() -> absl::StatusOr<Sample> {
                              const Clock::time_point t0 = Clock::now();
                              STRATA_RETURN_IF_ERROR(torch_resident_step(*cpu));
                              Sample s;
                              s.ms = seconds_between(t0, Clock::now()) * 1e3;
                              return s;
                            }});
      if (absl::Status s = interleave("streamed K=1", approaches, rounds); !s.ok()) {
        return fail("streamed K=1", s);
      }
      check("streamed/strata_k1", check_strata("layer_prefetch K=1", *k1));
      check("streamed/torch_pipeline_2", check_torch_offload("pipeline", model, *torch_rig));
      check("streamed/torch_cpu_fused", check_torch_resident("CPU fused", model, *cpu));
      g_results.series["streamed/strata_k1"].info["staging_bytes"] =
          static_cast<double>(k1->runtime->stats().staging_bytes);
      g_results.series["streamed/strata_k1"].info["largest_layer_moment_bytes"] =
          largest_layer_moment_bytes(*k1->runtime);
    }
    empty_caches();
    // K=2 against 3 slots.
    {
      std::unique_ptr<StrataRig> k2 = must(
          make_strata_rig(model, "layer_prefetch", 2, rt::DeviceKind::kCuda), "layer_prefetch K=2");
      if (k2 == nullptr) return;
      std::vector<Approach> approaches;
      approaches.push_back(strata_streamed("streamed/strata_k2", "strata layer_prefetch K=2", *k2));
      approaches.push_back(pipeline(3));
      if (absl::Status s = interleave("streamed K=2", approaches, rounds); !s.ok()) {
        return fail("streamed K=2", s);
      }
      check("streamed/strata_k2", check_strata("layer_prefetch K=2", *k2));
      check("streamed/torch_pipeline_3", check_torch_offload("pipeline", model, *torch_rig));
    }
    empty_caches();
  } catch (const std::exception& e) {
    return fail("streamed (LibTorch)", absl::InternalError(e.what()));
  }
  empty_caches();
  add_comparison("layer_prefetch K=1 step / its adjacent link floor", "floor", "streamed/strata_k1",
                 "", 1.03);
  add_comparison("layer_prefetch K=2 step / its adjacent link floor", "floor", "streamed/strata_k2",
                 "", 1.03);
  add_comparison("layer_prefetch K=1 / LibTorch pipeline with 2 slots", "faster",
                 "streamed/strata_k1", "streamed/torch_pipeline_2", 1.0);
  add_comparison("layer_prefetch K=2 / LibTorch pipeline with 3 slots", "faster",
                 "streamed/strata_k2", "streamed/torch_pipeline_3", 1.0);
  add_comparison("layer_prefetch K=1 (GPU, streamed) / torch fused AdamW on the CPU", "faster",
                 "streamed/strata_k1", "streamed/torch_cpu_fused", 1.0);
#endif
}

// The GPU tier's upstream work during fn: time mapping / allocating and unmapping / freeing, and
// how many of each, as a sample's extras.
absl::StatusOr<Sample> with_gpu_tier_stats(rt::Runtime& runtime,
                                           const std::function<absl::StatusOr<Sample>()>& fn) {
  const strata::alloc::TierStats a = runtime.allocator().stats(Tier::kGpu);
  STRATA_ASSIGN_OR_RETURN(Sample s, fn());
  const strata::alloc::TierStats b = runtime.allocator().stats(Tier::kGpu);
  s.extra["gpu_upstream_alloc_ms"] =
      static_cast<double>(b.upstream_alloc_ns - a.upstream_alloc_ns) / 1e6;
  s.extra["gpu_upstream_free_ms"] =
      static_cast<double>(b.upstream_free_ns - a.upstream_free_ns) / 1e6;
  s.extra["gpu_maps"] = static_cast<double>(b.num_maps - a.num_maps);
  s.extra["gpu_unmaps"] = static_cast<double>(b.num_unmaps - a.num_unmaps);
  s.extra["gpu_segment_allocs"] = static_cast<double>(b.num_segment_allocs - a.num_segment_allocs);
  return s;
}

// What the bulk policy streams and the PyTorch peer moves: the moments (offload_all's default is
// every role, parameters and gradients too).
rt::OffloadOptions moments_only() {
  rt::OffloadOptions options;
  options.roles = rt::RoleSet::optimizer_states();
  return options;
}

// bulk against the PyTorch .to() round trip, giving the emptied GPU memory back to the driver at
// every offload_all (the default: another engine may take it) and keeping it in strata's pool
// (OffloadOptions::keep_cached); offload_all + reload_all alone, with expandable and with fixed
// GPU segments.
void part_bulk(int rounds) {
  const Model& model = full_model();
  const double moments = model.moment_bytes();
#ifndef STRATA_BENCH_TORCH
  (void)rounds;
  (void)moments;
  fail("bulk", absl::UnimplementedError("built without LibTorch: no peers to compare with"));
#else
  try {
    absl::StatusOr<std::unique_ptr<TorchOffloadRig>> made_torch = make_torch_offload_rig(model);
    if (!made_torch.ok()) return fail("torch offload rig", made_torch.status());
    std::unique_ptr<TorchOffloadRig> torch_rig = std::move(*made_torch);
    const Approach torch_bulk{
        "bulk/torch_bulk_to", "PyTorch bulk: .to(cuda) all, fused step, copy_ back, synchronize",
        [&] {
          return offloaded_sample(LinkFloor::kSequential, moments,
                                  [&] { return torch_bulk_step(*torch_rig); });
        }};
    auto bulk_rig = [&](strata::alloc::GpuSegments segments) {
      return must(make_strata_rig(model, "bulk", 0, rt::DeviceKind::kCuda, segments), "bulk");
    };
    // A bulk step (reload_all, step, offload_all) or the moves alone, timed with the tier's work;
    // each half's time and the bytes each direction moved go into the sample, and a sample whose
    // bytes are not the floor's is an error (offload_all's default role set once moved parameters
    // and gradients too, unnoticed).
    auto bulk = [&](std::string id, std::string label, StrataRig& r, bool step, bool keep) {
      return Approach{
          std::move(id), std::move(label), [&r, step, keep, moments]() -> absl::StatusOr<Sample> {
            const rt::RuntimeStats before = r.runtime->stats();
            double reload_ms = 0;
            double offload_ms = 0;
            STRATA_ASSIGN_OR_RETURN(Sample s, with_gpu_tier_stats(*r.runtime, [&] {
                                      return offloaded_sample(
                                          LinkFloor::kSequential, moments, [&]() -> absl::Status {
                                            const Clock::time_point t0 = Clock::now();
                                            STRATA_RETURN_IF_ERROR(r.runtime->reload_all());
                                            const Clock::time_point t1 = Clock::now();
                                            if (step) STRATA_RETURN_IF_ERROR(r.adam->step());
                                            rt::OffloadOptions options = moments_only();
                                            options.keep_cached = keep;
                                            const Clock::time_point t2 = Clock::now();
                                            STRATA_RETURN_IF_ERROR(r.runtime->offload_all(options));
                                            reload_ms = seconds_between(t0, t1) * 1e3;
                                            offload_ms = seconds_between(t2, Clock::now()) * 1e3;
                                            return absl::OkStatus();
                                          });
                                    }));
            STRATA_RETURN_IF_ERROR(check_moved(before, r.runtime->stats(), moments));
            s.extra["reload_ms"] = reload_ms;
            s.extra["offload_ms"] = offload_ms;
            return s;
          }};
    };
    {
      std::unique_ptr<StrataRig> expandable = bulk_rig(strata::alloc::GpuSegments::kExpandable);
      std::unique_ptr<StrataRig> fixed = bulk_rig(strata::alloc::GpuSegments::kFixed);
      if (expandable == nullptr || fixed == nullptr) return;
      for (StrataRig* r : {expandable.get(), fixed.get()}) {
        if (absl::Status s = r->runtime->offload_all(moments_only()); !s.ok()) {
          return fail("offload_all", s);
        }
      }
      std::vector<Approach> approaches;
      approaches.push_back(bulk("bulk/strata_step",
                                "strata bulk: reload_all, step, offload_all "
                                "(GPU memory back to the driver)",
                                *expandable, true, false));
      approaches.push_back(torch_bulk);
      approaches.push_back(bulk("bulk/strata_moves",
                                "strata offload_all + reload_all, memory "
                                "back to the driver, expandable segments",
                                *expandable, false, false));
      approaches.push_back(bulk("bulk/strata_moves_fixed",
                                "strata offload_all + reload_all, "
                                "memory back to the driver, fixed segments",
                                *fixed, false, false));
      if (absl::Status s = interleave("bulk", approaches, rounds); !s.ok()) return fail("bulk", s);
      check("bulk/strata_step", check_strata("bulk", *expandable));
      const strata::alloc::TierStats pinned =
          expandable->runtime->allocator().stats(Tier::kPinnedHost);
      g_results.series["bulk/strata_moves"].info["pinned_reserved_per_held"] =
          static_cast<double>(pinned.reserved_bytes.current) /
          static_cast<double>(std::max<std::int64_t>(1, pinned.allocated_bytes.current));
    }
    empty_caches();
    {
      std::unique_ptr<StrataRig> cached = bulk_rig(strata::alloc::GpuSegments::kAuto);
      if (cached == nullptr) return;
      rt::OffloadOptions keep = moments_only();
      keep.keep_cached = true;
      if (absl::Status s = cached->runtime->offload_all(keep); !s.ok())
        return fail("offload_all", s);
      std::vector<Approach> approaches;
      approaches.push_back(bulk("bulk/strata_step_cached",
                                "strata bulk: reload_all, step, "
                                "offload_all(keep_cached)",
                                *cached, true, true));
      Approach torch_again = torch_bulk;
      torch_again.id = "bulk/torch_bulk_to_2";
      approaches.push_back(torch_again);
      // The same moves under keep_on_gpu, whose tensors rest on the GPU (the phase switch of a
      // run that keeps everything resident).
      std::unique_ptr<StrataRig> resident =
          must(make_strata_rig(model, "keep_on_gpu", 0, rt::DeviceKind::kCuda), "keep_on_gpu");
      if (resident == nullptr) return;
      if (absl::Status s = resident->runtime->offload_all(keep); !s.ok()) {
        return fail("keep_on_gpu offload_all", s);
      }
      approaches.push_back(bulk("bulk/keep_on_gpu_moves_cached",
                                "keep_on_gpu: offload_all(moments, keep_cached) + reload_all",
                                *resident, false, true));
      approaches.push_back(bulk("bulk/strata_moves_cached",
                                "strata offload_all(keep_cached) + "
                                "reload_all",
                                *cached, false, true));
      if (absl::Status s = interleave("bulk cached", approaches, rounds); !s.ok()) {
        return fail("bulk cached", s);
      }
      check("bulk/strata_step_cached", check_strata("bulk cached", *cached));
      check("bulk/torch_bulk_to", check_torch_offload("bulk .to()", model, *torch_rig));
    }
  } catch (const std::exception& e) {
    return fail("bulk (LibTorch)", absl::InternalError(e.what()));
  }
  empty_caches();
  add_comparison("bulk step, memory back to the driver / PyTorch bulk .to() round trip", "faster",
                 "bulk/strata_step", "bulk/torch_bulk_to", 1.0);
  add_comparison("bulk step, keep_cached / PyTorch bulk .to() round trip", "faster",
                 "bulk/strata_step_cached", "bulk/torch_bulk_to_2", 1.0);
  add_comparison("bulk offload_all + reload_all, memory back to the driver / its adjacent floor",
                 "floor", "bulk/strata_moves", "", 1.03);
  add_comparison("bulk offload_all(keep_cached) + reload_all / its adjacent floor", "floor",
                 "bulk/strata_moves_cached", "", 1.03);
  add_comparison("offload_all + reload_all: expandable / fixed segments", "faster",
                 "bulk/strata_moves", "bulk/strata_moves_fixed", 1.0);
#endif
}

// layer_prefetch K=1 over models of the given shapes, all made first and stepped in rounds.
void strata_curve(std::string_view part, const std::vector<Model>& models,
                  const std::vector<std::string>& ids, int rounds) {
  std::vector<std::unique_ptr<StrataRig>> rigs;
  std::vector<Approach> approaches;
  for (std::size_t i = 0; i < models.size(); ++i) {
    rigs.push_back(
        must(make_strata_rig(models[i], "layer_prefetch", 1, rt::DeviceKind::kCuda), ids[i]));
    if (rigs.back() == nullptr) return;
    approaches.push_back(strata_streamed(
        ids[i], str_cat("strata layer_prefetch K=1, ", models[i].describe()), *rigs.back()));
  }
  if (absl::Status s = interleave(part, approaches, rounds); !s.ok()) return fail(part, s);
  for (std::size_t i = 0; i < rigs.size(); ++i) {
    check(ids[i], check_strata(ids[i], *rigs[i]));
    Series& series = g_results.series[ids[i]];
    series.info["moment_bytes"] = models[i].moment_bytes();
    series.info["layers"] = models[i].layers;
    series.info["tensors"] = models[i].count();
  }
  rigs.clear();
  empty_caches();
}

void part_bytes(int rounds) {
  std::vector<Model> models;
  std::vector<std::string> ids;
  std::vector<double> xs;
  for (int layers : {2, 4, 8, 16, 32}) {
    models.push_back(Model{layers, full_model().tensor_numel});
    ids.push_back(str_cat("bytes/", layers, "_layers"));
    xs.push_back(models.back().moment_bytes());
  }
  strata_curve("bytes", models, ids, rounds);
  add_curve("layer_prefetch K=1 step against offloaded bytes", "moment bytes each way", ids, xs,
            "ms", "slope compared with the link: floor_ms per byte");
}

void part_layers(int rounds) {
  constexpr std::int64_t kParams = 128'000'000;
  std::vector<Model> models;
  std::vector<std::string> ids;
  std::vector<double> xs;
  for (int layers : {8, 32, 128, 512}) {
    models.push_back(Model{layers, {kParams / layers}});
    ids.push_back(str_cat("layers/", layers));
    xs.push_back(layers);
  }
  strata_curve("layers", models, ids, rounds);
  add_curve("layer_prefetch K=1 over 128e6 parameters (1.02 GB of moments each way) by layers",
            "layers", ids, xs, "ms_over_floor", "slope: per-layer overhead");
}

// 100 tensor sizes of 4 KiB .. 1 MiB of float32, log-uniform (fixed seed), multiples of 4.
std::vector<std::int64_t> small_tensor_sizes() {
  SplitMix64 rng(0x5354'5241'5441'0303);
  std::vector<std::int64_t> out;
  for (int i = 0; i < 100; ++i) {
    const double u = static_cast<double>(rng.next() >> 11) * 0x1p-53;
    const double floats = 1024.0 * std::pow(256.0, u);  // 4 KiB .. 1 MiB
    out.push_back(std::max<std::int64_t>(4, static_cast<std::int64_t>(floats) / 4 * 4));
  }
  return out;
}

void part_tensors(int rounds) {
  const std::vector<std::int64_t> sizes = small_tensor_sizes();
  const Model many{100, sizes};
  std::int64_t layer = 0;
  for (std::int64_t n : sizes) layer += n;
  const Model one{100, {layer}};
  std::vector<std::unique_ptr<StrataRig>> rigs;
  rigs.push_back(must(make_strata_rig(many, "layer_prefetch", 1, rt::DeviceKind::kCuda), "many"));
  rigs.push_back(must(make_strata_rig(one, "layer_prefetch", 1, rt::DeviceKind::kCuda), "one"));
  if (rigs[0] == nullptr || rigs[1] == nullptr) return;
  std::vector<Approach> approaches;
  approaches.push_back(strata_streamed("tensors/strata_many",
                                       "strata layer_prefetch K=1, " + many.describe(), *rigs[0]));
  approaches.push_back(strata_streamed("tensors/strata_one",
                                       "strata layer_prefetch K=1, " + one.describe(), *rigs[1]));
#ifdef STRATA_BENCH_TORCH
  std::vector<std::unique_ptr<TorchOffloadRig>> torch_rigs;
  try {
    for (const Model* m : {&many, &one}) {
      absl::StatusOr<std::unique_ptr<TorchOffloadRig>> made = make_torch_offload_rig(*m);
      if (!made.ok()) return fail("torch tensors rig", made.status());
      torch_rigs.push_back(std::move(*made));
    }
  } catch (const std::exception& e) {
    return fail("torch tensors rig", absl::InternalError(e.what()));
  }
  const std::vector<std::pair<std::string, const Model*>> torch_ids = {
      {"tensors/torch_many", &many}, {"tensors/torch_one", &one}};
  for (std::size_t i = 0; i < torch_ids.size(); ++i) {
    TorchOffloadRig& r = *torch_rigs[i];
    const Model& m = *torch_ids[i].second;
    approaches.push_back({torch_ids[i].first, "LibTorch pipeline, 2 slots, " + m.describe(), [&] {
                            return offloaded_sample(LinkFloor::kConcurrent, m.moment_bytes(),
                                                    [&] { return torch_pipeline_step(m, r, 2); });
                          }});
  }
#endif
  absl::Status s;
  try {
    s = interleave("tensors", approaches, rounds);
  } catch (const std::exception& e) {
    s = absl::InternalError(e.what());
  }
  if (!s.ok()) return fail("tensors", s);
  check("tensors/strata_many", check_strata("many", *rigs[0]));
  check("tensors/strata_one", check_strata("one", *rigs[1]));
#ifdef STRATA_BENCH_TORCH
  check("tensors/torch_many", check_torch_offload("torch many", many, *torch_rigs[0]));
  check("tensors/torch_one", check_torch_offload("torch one", one, *torch_rigs[1]));
  torch_rigs.clear();
#endif
  for (const char* id : {"tensors/strata_many", "tensors/torch_many"}) {
    g_results.series[id].info["tensors"] = many.count();
    g_results.series[id].info["moment_bytes"] = many.moment_bytes();
  }
  for (const char* id : {"tensors/strata_one", "tensors/torch_one"}) {
    g_results.series[id].info["tensors"] = one.count();
    g_results.series[id].info["moment_bytes"] = one.moment_bytes();
  }
  rigs.clear();
  empty_caches();
}

#endif  // STRATA_HAS_CUDA

std::string flag_value(std::string_view arg, std::string_view name) {
  if (arg.substr(0, name.size()) == name) return std::string(arg.substr(name.size()));
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  std::string out = "optim_compare.json";
  int rounds = 7;
  std::set<std::string> parts = {"resident", "streamed", "bulk",       "bytes",
                                 "layers",   "tensors",  "first_step", "mixed"};
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (std::string v = flag_value(arg, "--out="); !v.empty()) {
      out = v;
    } else if (std::string v = flag_value(arg, "--rounds="); !v.empty()) {
      rounds = std::atoi(v.c_str());
      if (rounds < 1) {
        std::fprintf(stderr, "--rounds must be at least 1, got %s\n", v.c_str());
        return 2;
      }
    } else if (std::string v = flag_value(arg, "--parts="); !v.empty()) {
      std::set<std::string> chosen;
      std::stringstream ss(v);
      for (std::string p; std::getline(ss, p, ',');) {
        if (parts.count(p) == 0) {
          std::fprintf(stderr,
                       "unknown part '%s' (resident, streamed, bulk, bytes, layers, "
                       "tensors, first_step, mixed)\n",
                       p.c_str());
          return 2;
        }
        chosen.insert(p);
      }
      parts = chosen;
    } else {
      std::fprintf(stderr,
                   "usage: strata_optim_compare [--out=FILE.json] [--rounds=N] "
                   "[--parts=resident,streamed,bulk,bytes,layers,tensors,first_step,mixed]\n");
      return 2;
    }
  }
  g_results.context["gpu"] = strata::alloc::cuda_device_name(0);
  g_results.context["rounds"] = std::to_string(rounds);
  g_results.context["warmup_steps"] = std::to_string(kWarmupSteps);
  g_results.context["cpu_threads"] = std::to_string(std::thread::hardware_concurrency());
  g_results.context["hyper"] = "AdamW lr=1e-3 betas=(0.9,0.999) eps=1e-8 wd=0.01";
  g_results.context["method"] =
      "approaches of a comparison in rounds (order reversed every other round), each step "
      "after its own reference sample: raw pinned link passes (16 x 256 MiB per direction) for "
      "offloaded steps, a 2 GiB device-to-device copy for resident ones";
  if (!have_gpu()) {
    g_results.context["skipped"] = "no GPU";
    std::printf("no GPU: nothing measured\n");
    return write_json(out).ok() ? 0 : 1;
  }
#ifdef STRATA_HAS_CUDA
#ifdef STRATA_BENCH_TORCH
  at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
#endif
  absl::StatusOr<Bandwidths> bw = measure_bandwidths();
  if (!bw.ok()) {
    std::fprintf(stderr, "measuring the link: %s\n", bw.status().ToString().c_str());
    return 1;
  }
  g_results.context["start_hbm_gbps"] = str_cat(bw->hbm_gbps);
  g_results.context["start_link_both_per_direction_gbps"] = str_cat(bw->both_per_direction_gbps);
  const std::vector<std::pair<std::string, void (*)(int)>> all = {
      {"resident", part_resident},     {"streamed", part_streamed}, {"bulk", part_bulk},
      {"bytes", part_bytes},           {"layers", part_layers},     {"tensors", part_tensors},
      {"first_step", part_first_step}, {"mixed", part_mixed}};
  for (const auto& [name, run] : all) {
    if (parts.count(name) == 0) continue;
    std::printf("== %s\n", name.c_str());
    std::fflush(stdout);
    const Clock::time_point t0 = Clock::now();
    run(name == "first_step" ? std::min(rounds, 3) : rounds);
    g_results.context[str_cat("seconds_", name)] = str_cat(seconds_between(t0, Clock::now()));
    if (absl::Status s = write_json(out); !s.ok()) fail("writing the results", s);
  }
  release_device_sources();
  delete g_link;
  g_link = nullptr;
#endif
  return g_results.failed ? 1 : 0;
}
