// bench/allocator_scaling_bench.cpp: how the cost of one pooled allocate+deallocate grows with the
// number of blocks the pool holds (issue 17: at most 200 ns with 10^6 live blocks, growth no worse
// than logarithmic).
//
// BM_AllocFreeWithLiveBlocks/<live>: a pool holding <live> live blocks and about as many free ones
// between them (2 x <live> blocks allocated, every other one freed, so the free sets are as large
// as the live population), then one allocate+deallocate pair per iteration of a size drawn from the
// same distribution: log-uniform from 512 B to 256 KiB, with one block in 64 from 1 to 8 MiB (the
// large pool). The GPU tier is simulated with address-only backing: the pool's bookkeeping is host
// code, the same on every device, and 10^6 blocks need no memory behind them. Counters: live and
// free blocks, segments, and whether the timed loop reached the upstream (it must not).
//   build/bin/strata_allocator_scaling_bench --benchmark_repetitions=5
//       --benchmark_enable_random_interleaving=true --benchmark_out=scaling.json
//       --benchmark_out_format=json                                  (one command line)
//   python3 tools/plot_scaling.py scaling.json scaling.svg
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/tier.h"
#include "allocator/tiered_allocator.h"
#include "allocator/upstream.h"
#include "base/units.h"
#include "bench/bench_util.h"

namespace {

using strata::kMiB;
using strata::alloc::Tier;
using strata::alloc::TieredAllocator;
using strata::bench::skip;

std::vector<std::size_t> draw_sizes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> small(std::log(512.0), std::log(256.0 * 1024));
  std::uniform_int_distribution<std::size_t> large(1 * kMiB, 8 * kMiB);
  std::vector<std::size_t> sizes(n);
  for (std::size_t& s : sizes) {
    s = rng() % 64 == 0 ? large(rng) : static_cast<std::size_t>(std::exp(small(rng)));
  }
  return sizes;
}

void BM_AllocFreeWithLiveBlocks(benchmark::State& state) {
  const auto live = static_cast<std::size_t>(state.range(0));
  strata::alloc::AllocatorOptions options;
  options.device = strata::alloc::DeviceBackend::kSimulated;
  options.simulated_device = {.capacity = std::size_t{8} << 40,
                              .backing = strata::alloc::SimulatedBacking::kAddressOnly};
  absl::StatusOr<std::unique_ptr<TieredAllocator>> created =
      TieredAllocator::create(std::move(options));
  if (!created.ok()) return skip(state, "TieredAllocator::create", created.status());
  TieredAllocator& allocator = **created;

  // The population: 2 x live blocks, then every other one freed, so free blocks sit between live
  // ones all over the segments.
  const std::vector<std::size_t> population = draw_sizes(2 * live, 17);
  std::vector<void*> blocks(population.size());
  for (std::size_t i = 0; i < population.size(); ++i) {
    absl::StatusOr<void*> p = allocator.allocate(Tier::kGpu, population[i]);
    if (!p.ok()) return skip(state, "populating the pool", p.status());
    blocks[i] = *p;
  }
  for (std::size_t i = 0; i < blocks.size(); i += 2) {
    if (absl::Status s = allocator.deallocate(Tier::kGpu, blocks[i]); !s.ok()) {
      return skip(state, "freeing half the pool", s);
    }
  }
  allocator.pool(Tier::kGpu).consolidate();

  const std::vector<std::size_t> sizes = draw_sizes(1 << 16, 29);
  const std::int64_t upstream_before = allocator.stats(Tier::kGpu).num_segment_allocs;
  std::size_t next = 0;
  for (auto _ : state) {
    absl::StatusOr<void*> p = allocator.allocate(Tier::kGpu, sizes[next]);
    if (!p.ok()) {
      skip(state, "allocate", p.status());
      break;
    }
    benchmark::DoNotOptimize(*p);
    if (absl::Status s = allocator.deallocate(Tier::kGpu, *p); !s.ok()) {
      skip(state, "deallocate", s);
      break;
    }
    next = (next + 1) & (sizes.size() - 1);
  }
  const strata::alloc::TierStats stats = allocator.stats(Tier::kGpu);
  state.counters["live_blocks"] = static_cast<double>(stats.active_blocks.current);
  state.counters["segments"] = static_cast<double>(stats.segments.current);
  state.counters["upstream_allocs"] =
      static_cast<double>(stats.num_segment_allocs - upstream_before);
  state.counters["fragmentation"] = stats.fragmentation;
  for (std::size_t i = 1; i < blocks.size(); i += 2) {
    if (absl::Status s = allocator.deallocate(Tier::kGpu, blocks[i]); !s.ok()) {
      return skip(state, "emptying the pool", s);
    }
  }
}
BENCHMARK(BM_AllocFreeWithLiveBlocks)
    ->Arg(1000)
    ->Arg(3000)
    ->Arg(10000)
    ->Arg(30000)
    ->Arg(100000)
    ->Arg(300000)
    ->Arg(1000000)
    ->Unit(benchmark::kNanosecond);

}  // namespace

BENCHMARK_MAIN();
