// bench/compare_resident.cpp: strata_optim_compare's resident part (bench/compare_parts.h): strata
// keep_on_gpu against at::_fused_adamw_ with everything on the GPU (full model), each step after
// a 2 GiB device-to-device copy that gives its HBM floor, and the fraction of HBM bandwidth each
// reaches.
#include <exception>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status.h"
#include "bench/compare_parts.h"
#include "bench/compare_rounds.h"
#include "bench/optim_common.h"
#include "bench/optim_torch.h"

namespace strata::bench {

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
    torch_rig = must(make_torch_resident_rig(model), "torch resident rig");
    if (torch_rig == nullptr) return;
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
#endif  // STRATA_HAS_CUDA

}  // namespace strata::bench
