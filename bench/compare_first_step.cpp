// bench/compare_first_step.cpp: strata_optim_compare's first_step part (bench/compare_parts.h):
// from nothing to the end of the first step, and the host memory it took, for strata
// layer_prefetch K=1, the LibTorch pipeline and torch's fused AdamW on the CPU, at 2 .. 32 layers.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "allocator/tier.h"
#include "base/host_memory.h"
#include "base/strings.h"
#include "bench/compare_parts.h"
#include "bench/compare_rounds.h"
#include "bench/optim_common.h"
#include "bench/optim_torch.h"

#ifdef STRATA_BENCH_TORCH
#include <ATen/core/CachingHostAllocator.h>
#endif

namespace strata::bench {

#ifdef STRATA_HAS_CUDA
namespace {

using alloc::Tier;

// Resident set size of this process (bytes; 0 where unreadable).
double rss_bytes() { return static_cast<double>(std::max<std::int64_t>(resident_bytes(), 0)); }

}  // namespace

// Time from nothing to the end of the first step, and the host memory it took. One function,
// longer than a screen: the measurements in the order they print.
void part_first_step(int rounds) {
  // The GPU copies of the value sources exist before any timing (every approach uses them).
  if (absl::StatusOr<DeviceSources> d = device_sources(); !d.ok()) {
    return fail("device sources", d.status());
  }
  std::vector<int> sizes = {2, 4, 8, 16, 32};
  std::vector<std::string> strata_ids, torch_ids, cpu_ids;
  std::vector<double> xs;
  for (int layers : sizes) {
    strata_ids.push_back(str_cat("first_step/strata_", layers));
    torch_ids.push_back(str_cat("first_step/torch_pipeline_", layers));
    cpu_ids.push_back(str_cat("first_step/torch_cpu_", layers));
    xs.push_back(Model{layers, full_model().tensor_numel}.moment_bytes());
  }
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const Model model{sizes[i], full_model().tensor_numel};
      // strata
      {
        empty_caches();
        const double rss0 = rss_bytes();
        const Clock::time_point t0 = Clock::now();
        std::unique_ptr<StrataRig> rig =
            must(make_strata_rig(model, "layer_prefetch", 1, rt::DeviceKind::kCuda), strata_ids[i]);
        if (rig == nullptr) return;
        const double made_ms = seconds_between(t0, Clock::now()) * 1e3;
        absl::Status s = rig->adam->step();
        if (s.ok()) s = cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        if (!s.ok()) return fail(strata_ids[i], s);
        Sample x;
        x.ms = seconds_between(t0, Clock::now()) * 1e3;
        x.extra["setup_ms"] = made_ms;
        x.extra["rss_growth_bytes"] = rss_bytes() - rss0;
        const strata::alloc::TierStats pinned = rig->runtime->allocator().stats(Tier::kPinnedHost);
        x.extra["pinned_reserved_bytes"] = static_cast<double>(pinned.reserved_bytes.current);
        x.extra["pinned_held_bytes"] = static_cast<double>(pinned.allocated_bytes.current);
        g_results.series[strata_ids[i]].label =
            "strata layer_prefetch K=1: runtime, register, Adam, first step";
        g_results.series[strata_ids[i]].samples.push_back(x);
      }
#ifdef STRATA_BENCH_TORCH
      try {
        // The LibTorch pipeline: pinned moments, then the first step.
        {
          empty_caches();
          const at::HostStats before = at::getHostAllocator(at::kCUDA)->get_stats();
          const double rss0 = rss_bytes();
          const Clock::time_point t0 = Clock::now();
          absl::StatusOr<std::unique_ptr<TorchOffloadRig>> made = make_torch_offload_rig(model);
          if (!made.ok()) return fail(torch_ids[i], made.status());
          const double made_ms = seconds_between(t0, Clock::now()) * 1e3;
          if (absl::Status s = torch_pipeline_step(model, **made, 2); !s.ok()) {
            return fail(torch_ids[i], s);
          }
          (void)cudaDeviceSynchronize();
          Sample x;
          x.ms = seconds_between(t0, Clock::now()) * 1e3;
          x.extra["setup_ms"] = made_ms;
          x.extra["rss_growth_bytes"] = rss_bytes() - rss0;
          const at::HostStats after = at::getHostAllocator(at::kCUDA)->get_stats();
          x.extra["pinned_reserved_bytes"] =
              static_cast<double>(after.allocated_bytes.current - before.allocated_bytes.current);
          x.extra["pinned_held_bytes"] =
              static_cast<double>(after.active_bytes.current - before.active_bytes.current);
          g_results.series[torch_ids[i]].label =
              "LibTorch pipeline: pinned moments (pin_memory), first step";
          g_results.series[torch_ids[i]].samples.push_back(x);
        }
        // torch's CPU AdamW: CPU tensors, then the first step.
        {
          empty_caches();
          const double rss0 = rss_bytes();
          const Clock::time_point t0 = Clock::now();
          absl::StatusOr<std::unique_ptr<TorchResidentRig>> made =
              make_torch_resident_rig(model, at::kCPU);
          if (!made.ok()) return fail(cpu_ids[i], made.status());
          const double made_ms = seconds_between(t0, Clock::now()) * 1e3;
          if (absl::Status s = torch_resident_step(**made); !s.ok()) return fail(cpu_ids[i], s);
          Sample x;
          x.ms = seconds_between(t0, Clock::now()) * 1e3;
          x.extra["setup_ms"] = made_ms;
          x.extra["rss_growth_bytes"] = rss_bytes() - rss0;
          x.extra["pinned_reserved_bytes"] = 0;
          x.extra["pinned_held_bytes"] = 0;
          g_results.series[cpu_ids[i]].label =
              "torch fused AdamW on the CPU: CPU tensors (params, grads, moments), first step";
          g_results.series[cpu_ids[i]].samples.push_back(x);
        }
      } catch (const std::exception& e) {
        return fail("first step (LibTorch)", absl::InternalError(e.what()));
      }
#endif
      std::printf("first_step round %d/%d: %d layers done\n", r + 1, rounds, sizes[i]);
      std::fflush(stdout);
    }
  }
  empty_caches();
  const std::string note =
      "ms from nothing to the first step's end; extra: setup_ms, rss_growth_bytes, "
      "pinned_reserved_bytes, pinned_held_bytes";
  add_curve("time to the first step: strata layer_prefetch K=1", "moment bytes each way",
            strata_ids, xs, "ms", note);
  add_curve("time to the first step: LibTorch pipeline", "moment bytes each way", torch_ids, xs,
            "ms", note);
  add_curve("time to the first step: torch fused AdamW on the CPU", "moment bytes each way",
            cpu_ids, xs, "ms", note);
}

#endif  // STRATA_HAS_CUDA

}  // namespace strata::bench
