// bench/optim_bench.h: the benchmarks of strata_optim_bench, registered in the order they run by
// bench/optim_bench.cpp (which says what each measures): strata's approaches in
// bench/optim_bench_strata.cpp, the LibTorch peers in bench/optim_bench_torch.cpp, all over the rig
// of bench/optim_bench_rig.h.
//
// Example:
//   BENCHMARK(BM_StrataLayerPrefetch)->Arg(1)->UseManualTime()->Iterations(5);
//   BENCHMARK(BM_TorchPerLayerPipeline)->UseManualTime()->Iterations(5);
#pragma once

#include <benchmark/benchmark.h>

namespace strata::bench {

// bench/optim_bench_strata.cpp
void BM_StrataResident(benchmark::State& state);
void BM_StrataBulk(benchmark::State& state);
void BM_StrataLayerPrefetch(benchmark::State& state);  // range(0): the prefetch depth
void BM_SimulatedLayerPrefetch(benchmark::State& state);

// bench/optim_bench_torch.cpp
void BM_TorchFusedAdamW(benchmark::State& state);
void BM_TorchBulkTo(benchmark::State& state);
void BM_TorchPerLayerPipeline(benchmark::State& state);
void BM_TorchCpuAdamW(benchmark::State& state);

}  // namespace strata::bench
