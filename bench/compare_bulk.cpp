// bench/compare_bulk.cpp: strata_optim_compare's bulk part (bench/compare_parts.h): bulk
// (reload_all, step, offload_all) against the PyTorch .to() round trip, with offload_all giving
// the GPU memory back to the driver (the default) and keeping it cached; offload_all + reload_all
// alone, with expandable and with fixed segments; the GPU tier's mapping and unmapping time in
// each sample.
#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/stats.h"
#include "allocator/tier.h"
#include "allocator/tiered_allocator.h"
#include "base/status.h"
#include "base/strings.h"
#include "bench/compare_parts.h"
#include "bench/compare_rounds.h"
#include "bench/optim_common.h"
#include "bench/optim_torch.h"

namespace strata::bench {

#ifdef STRATA_BENCH_TORCH
namespace {

using alloc::Tier;

// The GPU tier's upstream work during fn: time mapping / allocating and unmapping / freeing, and
// how many of each, as a sample's extras.
absl::StatusOr<Sample> with_gpu_tier_stats(rt::Runtime& runtime,
                                           const std::function<absl::StatusOr<Sample>()>& fn) {
  const alloc::TierStats a = runtime.allocator().stats(Tier::kGpu);
  STRATA_ASSIGN_OR_RETURN(Sample s, fn());
  const alloc::TierStats b = runtime.allocator().stats(Tier::kGpu);
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

}  // namespace

// bulk against the PyTorch .to() round trip, giving the emptied GPU memory back to the driver at
// every offload_all (the default: another engine may take it) and keeping it in strata's pool
// (OffloadOptions::keep_cached); offload_all + reload_all alone, with expandable and with fixed
// GPU segments. One function, longer than a screen: the comparisons in the order they print.
void part_bulk(int rounds) {
  const Model& model = full_model();
  const double moments = model.moment_bytes();
  try {
    std::unique_ptr<TorchOffloadRig> torch_rig =
        must(make_torch_offload_rig(model), "torch offload rig");
    if (torch_rig == nullptr) return;
    const Approach torch_bulk{
        "bulk/torch_bulk_to", "PyTorch bulk: .to(cuda) all, fused step, copy_ back, synchronize",
        [&] {
          return offloaded_sample(LinkFloor::kSequential, moments,
                                  [&] { return torch_bulk_step(*torch_rig); });
        }};
    auto bulk_rig = [&](alloc::GpuSegments segments) {
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
      std::unique_ptr<StrataRig> expandable = bulk_rig(alloc::GpuSegments::kExpandable);
      std::unique_ptr<StrataRig> fixed = bulk_rig(alloc::GpuSegments::kFixed);
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
      const alloc::TierStats pinned = expandable->runtime->allocator().stats(Tier::kPinnedHost);
      g_results.series["bulk/strata_moves"].info["pinned_reserved_per_held"] =
          static_cast<double>(pinned.reserved_bytes.current) /
          static_cast<double>(std::max<std::int64_t>(1, pinned.allocated_bytes.current));
    }
    empty_caches();
    {
      std::unique_ptr<StrataRig> cached = bulk_rig(alloc::GpuSegments::kAuto);
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
}

#endif  // STRATA_BENCH_TORCH

}  // namespace strata::bench
