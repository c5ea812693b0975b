// bench/allocator_replay.cpp: replays of training steps' allocation traces (bench/replay_trace.h),
// fixed and variable shapes, through strata's GPU tier with expandable or fixed segments: reserved
// bytes against peak allocated bytes, with what mapping cost (bench/allocator_bench.h). PyTorch's
// caching allocator replays the same traces in bench/allocator_torch.cpp.
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/stats.h"
#include "base/strings.h"
#include "bench/allocator_bench.h"
#include "bench/bench_util.h"
#include "bench/replay_trace.h"

namespace strata::bench {

using alloc::DeviceBackend;
using alloc::GpuSegments;
using alloc::Tier;
using alloc::TieredAllocator;
using alloc::TierStats;

void BM_ReplayStrata(benchmark::State& state, DeviceBackend backend, std::string_view trace_name,
                     GpuSegments segments) {
  if (backend == DeviceBackend::kCuda && !require_gpu(state)) return;
  const ReplayTrace& trace = replay_trace_named(trace_name);  // built before the clock starts
  absl::StatusOr<std::unique_ptr<TieredAllocator>> created = make_allocator(backend, segments);
  if (!created.ok()) return skip(state, "TieredAllocator::create", created.status());
  TieredAllocator& allocator = **created;

  for (auto _ : state) {
    std::string last_error;
    const ReplayResult result = run_replay(
        trace,
        [&](std::size_t bytes) -> void* {
          absl::StatusOr<void*> p = allocator.allocate(Tier::kGpu, bytes);
          if (p.ok()) return *p;
          last_error = p.status().ToString();
          return nullptr;
        },
        [&](void* p) {
          const absl::Status s = allocator.deallocate(Tier::kGpu, p);
          if (!s.ok()) last_error = s.ToString();
          return s.ok();
        });
    if (!result.error.empty()) {
      skip(state, str_cat("replay: ", result.error, ": ", last_error));
      break;
    }
    const TierStats stats = allocator.stats(Tier::kGpu);
    report_replay(state, trace, result,
                  {.reserved_bytes = stats.reserved_bytes.current,
                   .reserved_peak_bytes = stats.reserved_bytes.peak,
                   .peak_allocated_bytes = stats.allocated_bytes.peak,
                   .upstream_allocs = stats.num_segment_allocs,
                   .maps = stats.num_maps,
                   .upstream_alloc_ms = static_cast<double>(stats.upstream_alloc_ns) * 1e-6,
                   .upstream_free_ms = static_cast<double>(stats.upstream_free_ns) * 1e-6});
  }
  state.SetLabel(str_cat("strata ", alloc::device_backend_name(backend), " gpu tier over ",
                         allocator.upstream(Tier::kGpu).name(), ", ",
                         allocator.pool(Tier::kGpu).expandable() ? "expandable" : "fixed",
                         " segments, ", trace.name, " shapes"));
}

}  // namespace strata::bench
