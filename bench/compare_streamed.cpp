// bench/compare_streamed.cpp: strata_optim_compare's streamed part (bench/compare_parts.h):
// layer_prefetch K=1 against the LibTorch per-layer pipeline with 2 GPU slots and against torch's
// fused AdamW on the CPU over the whole model; K=2 against the pipeline with 3 slots. Each
// offloaded step after raw link passes of both directions at once (its adjacent floor).
#include <exception>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status.h"
#include "base/strings.h"
#include "bench/compare_parts.h"
#include "bench/compare_rounds.h"
#include "bench/optim_common.h"
#include "bench/optim_torch.h"

#ifdef STRATA_BENCH_TORCH
#include <ATen/Parallel.h>
#endif

namespace strata::bench {

#ifdef STRATA_BENCH_TORCH
void part_streamed(int rounds) {
  const Model& model = full_model();
  const double moments = model.moment_bytes();
  try {
    std::unique_ptr<TorchOffloadRig> torch_rig =
        must(make_torch_offload_rig(model), "torch offload rig");
    if (torch_rig == nullptr) return;
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
      std::unique_ptr<TorchResidentRig> cpu =
          must(make_torch_resident_rig(model, at::kCPU), "torch CPU rig");
      if (cpu == nullptr) return;
      std::vector<Approach> approaches;
      approaches.push_back(strata_streamed("streamed/strata_k1", "strata layer_prefetch K=1", *k1));
      approaches.push_back(pipeline(2));
      approaches.push_back({"streamed/torch_cpu_fused",
                            str_cat("torch AdamW fused on the CPU (at::_fused_adamw_ on CPU "
                                    "tensors), whole model, ",
                                    at::get_num_threads(), " threads; no transfers"),
                            [&]() -> absl::StatusOr<Sample> {
                              Sample s;
                              STRATA_ASSIGN_OR_RETURN(
                                  s.ms, time_on_host([&] { return torch_resident_step(*cpu); }));
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
}
#endif  // STRATA_BENCH_TORCH

}  // namespace strata::bench
