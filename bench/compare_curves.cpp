// bench/compare_curves.cpp: strata_optim_compare's scaling curves (bench/compare_parts.h):
// layer_prefetch K=1 against the bytes it offloads (part bytes: 2 .. 32 layers of the full model's
// layer), against the number of layers one model is cut into (part layers: 128e6 parameters in 8
// .. 512 layers), and over 10^4 small tensors against the same layers as one tensor each, next to
// the LibTorch pipeline (part tensors).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/strings.h"
#include "bench/bench_util.h"
#include "bench/compare_parts.h"
#include "bench/compare_rounds.h"
#include "bench/optim_common.h"
#include "bench/optim_torch.h"

namespace strata::bench {

#ifdef STRATA_HAS_CUDA
namespace {

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

}  // namespace

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
      torch_rigs.push_back(must(make_torch_offload_rig(*m), "torch tensors rig"));
      if (torch_rigs.back() == nullptr) return;
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

}  // namespace strata::bench
