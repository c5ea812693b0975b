// bench/compare_mixed.cpp: strata_optim_compare's "mixed" part: the bfloat16 optimizer step with
// float32 master weights and moments (bench/mixed_rig.h) under strata and PyTorch, in
// alternation:
//   - resident: strata keep_on_gpu against at::_fused_adamw_ over float32 masters (the gradients
//     cast, the parameters copied from the masters), everything on the GPU;
//   - streamed: layer_prefetch K=1 and K=2 streaming masters and moments (12 bytes a parameter
//     each way) against PyTorch's per-layer pipeline with pinned states at the same number of GPU
//     slots (2 and 3). Before each step two floors are taken: a pass over the step's own pinned
//     buffers (See Note [Own-memory floor] in bench/mixed_rig.h) and the link rig's passes right
//     before the step (See Note [Adjacent floor] in bench/link_rig.h).
// Every approach's masters are checked against float32 AdamW on the host after its rounds, and
// every strata sample against the bytes its floor counts.
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status.h"
#include "base/strings.h"
#include "bench/compare_parts.h"
#include "bench/compare_rounds.h"
#include "bench/mixed_rig.h"

namespace strata::bench {

#ifdef STRATA_BENCH_TORCH
namespace {

// A streamed step after both floors: the own-memory pass first, then the link rig's passes right
// before the step (offloaded_sample); the own floor's time goes into the sample's extras.
absl::StatusOr<Sample> own_and_link_sample(
    OwnMemoryFloor& own, const std::function<absl::StatusOr<HostBuffers>()>& buffers,
    const std::function<absl::Status()>& step) {
  STRATA_ASSIGN_OR_RETURN(HostBuffers b, buffers());
  STRATA_ASSIGN_OR_RETURN(double own_ms, own.pass_ms(b));
  STRATA_ASSIGN_OR_RETURN(Sample s,
                          offloaded_sample(LinkFloor::kConcurrent, mixed_state_bytes(), step));
  s.extra["own_floor_ms"] = own_ms;
  return s;
}

Approach strata_mixed_streamed(std::string id, MixedStrataRig& r, OwnMemoryFloor& own) {
  return {std::move(id),
          str_cat("strata layer_prefetch K=", r.depth,
                  ", bfloat16 params and grads on the GPU, float32 masters and moments streamed"),
          [&r, &own]() -> absl::StatusOr<Sample> {
            const rt::RuntimeStats before = r.runtime->stats();
            STRATA_ASSIGN_OR_RETURN(Sample s, own_and_link_sample(
                                                  own, [&] { return mixed_strata_buffers(r); },
                                                  [&] { return mixed_strata_step(r); }));
            STRATA_RETURN_IF_ERROR(check_moved(before, r.runtime->stats(), mixed_state_bytes()));
            return s;
          }};
}

Approach torch_mixed_pipeline(std::string id, TorchMixedModel& t, int slots, OwnMemoryFloor& own) {
  return {std::move(id),
          str_cat("PyTorch per-layer pipeline, ", slots,
                  " GPU slots: pinned float32 masters and moments, one stream per direction, "
                  "gradients cast to float32, at::_fused_adamw_ on the slot, parameters copied "
                  "from it"),
          [&t, slots, &own]() -> absl::StatusOr<Sample> {
            return own_and_link_sample(
                own, [&]() -> absl::StatusOr<HostBuffers> { return torch_mixed_buffers(t); },
                [&] { return torch_mixed_pipeline_step(t, slots); });
          }};
}

absl::StatusOr<Sample> resident_sample(const std::function<absl::Status()>& step) {
  STRATA_ASSIGN_OR_RETURN(double ms, time_to_idle(step));
  Sample s;
  s.ms = ms;
  return s;
}

void mixed_resident(int rounds) {
  absl::StatusOr<std::unique_ptr<MixedStrataRig> > strata = make_mixed_strata_rig("keep_on_gpu");
  if (!strata.ok()) return fail("mixed strata resident rig", strata.status());
  absl::StatusOr<std::unique_ptr<TorchMixedModel> > torch = make_torch_mixed_model(false);
  if (!torch.ok()) return fail("mixed torch resident model", torch.status());
  std::vector<Approach> approaches;
  approaches.push_back(
      {"mixed/strata_resident",
       "strata keep_on_gpu: bfloat16 params and grads, float32 masters and "
       "moments, all on the GPU, one fused kernel",
       [&] { return resident_sample([&] { return mixed_strata_step(**strata); }); }});
  approaches.push_back(
      {"mixed/torch_resident",
       "at::_fused_adamw_ over float32 masters on the GPU, gradients cast with .to(float32), "
       "parameters copied with _foreach_copy_",
       [&] { return resident_sample([&] { return torch_mixed_resident_step(**torch); }); }});
  if (absl::Status s = interleave("mixed resident", approaches, rounds); !s.ok()) {
    return fail("mixed resident", s);
  }
  check("mixed/strata_resident", check_mixed_strata(**strata));
  check("mixed/torch_resident", check_mixed_torch("torch resident", **torch));
}

void mixed_streamed(int rounds) {
  OwnMemoryFloor own;
  if (absl::Status s = own.init(static_cast<std::size_t>(mixed_state_bytes())); !s.ok()) {
    return fail("own-memory floor", s);
  }
  absl::StatusOr<std::unique_ptr<TorchMixedModel> > torch = make_torch_mixed_model(true);
  if (!torch.ok()) return fail("mixed torch pinned model", torch.status());
  for (int depth : {1, 2}) {
    absl::StatusOr<std::unique_ptr<MixedStrataRig> > strata =
        make_mixed_strata_rig("layer_prefetch", depth);
    if (!strata.ok()) return fail(str_cat("mixed layer_prefetch K=", depth), strata.status());
    const std::string ours = str_cat("mixed/strata_k", depth);
    const std::string peer = str_cat("mixed/torch_pipeline_", depth + 1);
    std::vector<Approach> approaches;
    approaches.push_back(strata_mixed_streamed(ours, **strata, own));
    approaches.push_back(torch_mixed_pipeline(peer, **torch, depth + 1, own));
    if (absl::Status s = interleave(str_cat("mixed streamed K=", depth), approaches, rounds);
        !s.ok()) {
      return fail(str_cat("mixed streamed K=", depth), s);
    }
    check(ours, check_mixed_strata(**strata));
    check(peer, check_mixed_torch("torch pipeline", **torch));
    g_results.series[ours].info["params"] = mixed_params();
    g_results.series[ours].info["staging_bytes"] =
        static_cast<double>((*strata)->runtime->stats().staging_bytes);
    strata->reset();
    empty_caches();
    add_comparison(str_cat("mixed layer_prefetch K=", depth, " step / its adjacent link floor"),
                   "floor", ours, "", 1.03);
    add_comparison(str_cat("mixed layer_prefetch K=", depth, " step / its own-memory floor"),
                   "floor", ours, "", 1.03, "own_floor_ms");
    add_comparison(
        str_cat("mixed layer_prefetch K=", depth, " / PyTorch pipeline with ", depth + 1, " slots"),
        "faster", ours, peer, 1.0);
  }
}

}  // namespace

void part_mixed(int rounds) {
  mixed_resident(rounds);
  empty_caches();
  add_comparison("mixed resident step: strata / PyTorch fused AdamW over float32 masters", "faster",
                 "mixed/strata_resident", "mixed/torch_resident", 1.0);
  mixed_streamed(rounds);
  empty_caches();
}
#endif  // STRATA_BENCH_TORCH

}  // namespace strata::bench
