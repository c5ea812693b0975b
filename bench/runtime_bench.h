// bench/runtime_bench.h: the benchmarks of strata_runtime_bench, one group a file, registered in
// the order they run by bench/runtime_bench.cpp:
//   bench/runtime_raw_copy.cpp   BM_RawPinnedCopy: the raw pinned copies, the reference
//   bench/runtime_migrate.cpp    BM_RuntimeMigrate: the same bytes through migrate()
//   bench/runtime_offload.cpp    BM_OffloadReload, BM_SimulatedOffloadReload: offload_all +
//                                reload_all under bulk
//
// Example:
//   BENCHMARK_CAPTURE(BM_RuntimeMigrate, h2d, Direction::kH2D)->UseManualTime()->Iterations(5);
//   ...
//   benchmark::RunSpecifiedBenchmarks();
//   release_migrate_rig();
//   release_raw_rig();
#pragma once

#include <cstddef>

#include <benchmark/benchmark.h>

#include "bench/runtime_rig.h"

namespace strata::bench {

void BM_RawPinnedCopy(benchmark::State& state, Direction direction);

void BM_RuntimeMigrate(benchmark::State& state, Direction direction);
// Frees the runtime the migrate benchmarks share (no CUDA call may run in a static destructor).
void release_migrate_rig();

// keep_cached: offload_all keeps the emptied GPU segments in strata's pool (the migrations alone);
// otherwise it gives them back to the driver and reload_all maps them again (a phase switch).
void BM_OffloadReload(benchmark::State& state, std::size_t total_bytes, int count,
                      bool keep_cached);
void BM_SimulatedOffloadReload(benchmark::State& state, std::size_t total_bytes, int count);

}  // namespace strata::bench
