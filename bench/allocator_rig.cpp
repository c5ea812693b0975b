// bench/allocator_rig.cpp: the allocator benchmarks' shared rig (bench/allocator_rig.h).
#include "bench/allocator_rig.h"

#include <cstddef>

#include "allocator/cuda_status.h"
#include "base/strings.h"

namespace strata::bench {
namespace {

constexpr std::size_t kTiB = std::size_t{1} << 40;

}  // namespace

void pooled_sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t bytes : kPooledSizes) b->Arg(bytes);
}

absl::StatusOr<std::unique_ptr<alloc::TieredAllocator>> make_allocator(
    alloc::DeviceBackend backend, alloc::GpuSegments segments) {
  alloc::AllocatorOptions options;
  options.device = backend;
  options.gpu_segments = segments;
  options.simulated_device = {.capacity = kTiB, .backing = alloc::SimulatedBacking::kAddressOnly};
  return alloc::TieredAllocator::create(std::move(options));
}

#ifdef STRATA_HAS_CUDA
bool cuda_ok(benchmark::State& state, cudaError_t err, const char* what) {
  const absl::Status s = alloc::cuda_status(err, what);
  if (s.ok()) return true;
  skip(state, std::string(s.message()));
  return false;
}
#endif

}  // namespace strata::bench
