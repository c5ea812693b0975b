// bench/runtime_bench.cpp: how close the runtime's migrations come to the PCIe link, measured in
// the same run as the raw copies they are judged against.
//
// Measures (targets in /work/shared/PERF.md and issue 3, "Must show"):
//   BM_RawPinnedCopy/{h2d,d2h,both}    raw cudaMemcpyAsync between cudaMalloc memory and
//                                      cudaHostAlloc memory on non-blocking streams: 4 GiB per
//                                      direction as 16 pieces of 256 MiB, timed by CUDA events on
//                                      the streams (both: one stream per direction, started at
//                                      once, from the first start event to the last end event).
//   BM_RuntimeMigrate/{h2d,d2h,both}   the same bytes as 256 MiB tensors registered with the
//                                      runtime (policy bulk, placement = home tier): migrate()
//                                      each tensor, then wait_all(), timed on the host (the honest
//                                      end-to-end figure). both: 32 tensors, 16 going each way at
//                                      once, so each direction moves 4 GiB as in the raw run.
//                                      Before each timed cycle, outside its clock, one raw pass
//                                      of the same direction (See Note [Adjacent floor] in
//                                      link_rig.h). Target: ratio_to_raw (gbps over those passes'
//                                      raw_gbps) >= 0.95.
//   BM_OffloadReload/12GB_cached       offload_all(keep_cached) + reload_all() of 12e9 bytes (48
//                                      tensors of 250e6 B, home GPU) under bulk with every role:
//                                      the migrations alone. Targets: seconds <= 1.03 x
//                                      floor_seconds (bytes over the raw H2D plus bytes over the
//                                      raw D2H bandwidth, each alone, from a pass of each right
//                                      before each cycle); no GPU or pinned segment allocation
//                                      after the first cycle; pinned reserved <= 1.02 x bytes
//                                      held.
//   BM_OffloadReload/12GB              the same with offload_all's default, the GPU memory given
//                                      back to the driver and mapped again by reload_all (a phase
//                                      switch). Target (issue 13's): seconds <= 1.05 x
//                                      (floor_seconds + the GPU tier's allocation time).
//   BM_SimulatedOffloadReload/256MB    the same cycle on the simulated device (host memcpy, not
//                                      PCIe); the one benchmark that runs without a GPU.
// Payloads are pseudo-random bits, never zeros (DMA engines and links must not see a trivial
// pattern), and every tensor carries its own tag in its first word; after each runtime benchmark
// the moved tensors are read back and compared, so a fast but wrong migration fails the run.
//
// Memory (GPU runs): the raw copies hold 8 GiB of GPU memory and 8 GiB pinned for the whole
// process; the migrate benchmarks share one runtime with 8 GiB of tensors (pinned at rest, up to
// 8 GiB on the GPU); BM_OffloadReload makes its own runtime per run (12 GB on the GPU, 12 GB
// pinned once offloaded). About 28 GiB of GPU memory and 28 GiB of pinned host memory in all.
//
// Run (on a machine without a GPU everything but the simulated benchmark reports "no GPU"):
//   build/bin/strata_runtime_bench --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true
//       --benchmark_out=runtime_bench.json --benchmark_out_format=json   (one command line)
//   python3 tools/gpu/summarize_runtime.py runtime_bench.json
// The JSON context carries the GPU name, the runtime's pinned method and the raw copy method.
//
// The benchmarks live one group a file (bench/runtime_bench.h) over the shared rig
// (bench/runtime_rig.h); this file registers them in the order they run and holds main.
#include <cstddef>
#include <string>

#include <benchmark/benchmark.h>

#include "allocator/upstream.h"
#include "base/strings.h"
#include "bench/runtime_bench.h"
#include "runtime/runtime.h"

namespace strata::bench {
namespace {

// The raw copies and the migrations move 16 pieces of 256 MiB per direction (bench/link_rig.h):
// each copy runs ~5 ms at PCIe gen5 speed, so neither launch latency nor the runtime's
// per-migration bookkeeping should show, and 4 GiB keeps the link busy for ~80 ms per direction.

// bulk offload + reload: 12 GB (decimal, as the issue states it) of optimizer states, two per
// layer; and the simulated stand-in.
constexpr std::size_t kOffloadBytes = 12'000'000'000;
constexpr int kOffloadTensors = 48;
constexpr std::size_t kSimulatedBytes = 256'000'000;
constexpr int kSimulatedTensors = 4;

BENCHMARK_CAPTURE(BM_RawPinnedCopy, h2d, Direction::kH2D)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_RawPinnedCopy, d2h, Direction::kD2H)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_RawPinnedCopy, both, Direction::kBoth)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);

BENCHMARK_CAPTURE(BM_RuntimeMigrate, h2d, Direction::kH2D)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_RuntimeMigrate, d2h, Direction::kD2H)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_RuntimeMigrate, both, Direction::kBoth)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);

// The migrations alone: the GPU segments stay in strata's pool.
BENCHMARK_CAPTURE(BM_OffloadReload, 12GB_cached, kOffloadBytes, kOffloadTensors, true)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
// offload_all's default: the GPU memory goes back to the driver, reload_all maps it again.
BENCHMARK_CAPTURE(BM_OffloadReload, 12GB, kOffloadBytes, kOffloadTensors, false)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);

BENCHMARK_CAPTURE(BM_SimulatedOffloadReload, 256MB, kSimulatedBytes, kSimulatedTensors)
    ->UseManualTime()
    ->Iterations(10)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("gpu", strata::alloc::cuda_device_name(0));
  benchmark::AddCustomContext("cuda_devices", std::to_string(strata::alloc::cuda_device_count()));
  benchmark::AddCustomContext("pinned_method",
                              std::string(strata::alloc::pinned_method_name(
                                  strata::rt::RuntimeOptions{}.allocator.pinned_method)));
  benchmark::AddCustomContext(
      "raw_method", strata::str_cat("cudaMemcpyAsync, cudaMalloc <-> cudaHostAlloc(portable), ",
                                    strata::bench::kPieces,
                                    " x 256 MiB per direction, non-blocking streams, CUDA events"));
  benchmark::AddCustomContext("runtime_timing", "host wall time around migrate()+wait_all()");
  benchmark::RunSpecifiedBenchmarks();
  // What the benchmarks kept across runs, freed while CUDA is still up (no CUDA call may run in a
  // static destructor).
  strata::bench::release_migrate_rig();
  strata::bench::release_raw_rig();
  benchmark::Shutdown();
  return 0;
}
