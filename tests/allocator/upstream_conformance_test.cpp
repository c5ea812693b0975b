// The conformance suite every upstream passes: aligned, disjoint, usable segments; out of memory is
// kResourceExhausted and leaves the upstream working; alloc/free cycles hold nothing back.
// Host upstreams run everywhere; the Gpu* ones (CUDA device and both pinned methods) need a GPU and
// run under the CTest label gpu.
#include <sys/resource.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "allocator/upstream.h"
#include "gtest/gtest.h"
#include "tests/allocator/test_util.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::alloc {
namespace {

enum class Access { kHost, kDevice, kNone };

struct SimulatedDevice {
  static constexpr Access kAccess = Access::kHost;
  static constexpr bool kNeedsGpu = false;
  static absl::StatusOr<std::unique_ptr<Upstream>> make() {
    return make_simulated_device_upstream({.capacity = 512 * kMiB});
  }
};
struct SimulatedAddressOnly {
  static constexpr Access kAccess = Access::kNone;
  static constexpr bool kNeedsGpu = false;
  static absl::StatusOr<std::unique_ptr<Upstream>> make() {
    return make_simulated_device_upstream(
        {.capacity = 512 * kMiB, .backing = SimulatedBacking::kAddressOnly});
  }
};
struct PageableHost {
  static constexpr Access kAccess = Access::kHost;
  static constexpr bool kNeedsGpu = false;
  static absl::StatusOr<std::unique_ptr<Upstream>> make() { return make_pageable_host_upstream(); }
};
struct SimulatedPinnedHost {
  static constexpr Access kAccess = Access::kHost;
  static constexpr bool kNeedsGpu = false;
  static absl::StatusOr<std::unique_ptr<Upstream>> make() {
    return make_simulated_pinned_upstream();
  }
};
struct GpuCudaDevice {  // the default: virtual memory where the device supports it
  static constexpr Access kAccess = Access::kDevice;
  static constexpr bool kNeedsGpu = true;
  static absl::StatusOr<std::unique_ptr<Upstream>> make() { return make_cuda_device_upstream(0); }
};
struct GpuCudaMalloc {
  static constexpr Access kAccess = Access::kDevice;
  static constexpr bool kNeedsGpu = true;
  static absl::StatusOr<std::unique_ptr<Upstream>> make() {
    return make_cuda_device_upstream(0, DeviceMethod::kCudaMalloc);
  }
};
struct GpuVirtualMemory {
  static constexpr Access kAccess = Access::kDevice;
  static constexpr bool kNeedsGpu = true;
  static absl::StatusOr<std::unique_ptr<Upstream>> make() {
    return make_cuda_device_upstream(0, DeviceMethod::kVirtualMemory);
  }
};
struct GpuPinnedHostAlloc {
  static constexpr Access kAccess = Access::kHost;
  static constexpr bool kNeedsGpu = true;
  static absl::StatusOr<std::unique_ptr<Upstream>> make() {
    return make_pinned_host_upstream(PinnedMethod::kCudaHostAlloc);
  }
};
struct GpuPinnedMmapRegister {
  static constexpr Access kAccess = Access::kHost;
  static constexpr bool kNeedsGpu = true;
  static absl::StatusOr<std::unique_ptr<Upstream>> make() {
    return make_pinned_host_upstream(PinnedMethod::kMmapRegister);
  }
};

template <typename T>
class UpstreamConformance : public ::testing::Test {
 protected:
  void SetUp() override {
    if (T::kNeedsGpu && cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
    absl::StatusOr<std::unique_ptr<Upstream>> made = T::make();
    ASSERT_TRUE(made.ok()) << made.status();
    upstream_ = std::move(*made);
  }

  // Writes a pattern through the segment and reads it back.
  void expect_usable(void* p, std::size_t bytes) {
    std::vector<unsigned char> pattern(bytes);
    for (std::size_t i = 0; i < bytes; ++i) pattern[i] = static_cast<unsigned char>(i * 131 + 7);
    std::vector<unsigned char> back(bytes, 0);
    if (T::kAccess == Access::kHost) {
      std::memcpy(p, pattern.data(), bytes);
      std::memcpy(back.data(), p, bytes);
    } else if (T::kAccess == Access::kDevice) {
#ifdef STRATA_HAS_CUDA
      ASSERT_EQ(cudaMemcpy(p, pattern.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(back.data(), p, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
#endif
    } else {
      return;  // address only: nothing to touch
    }
    EXPECT_EQ(std::memcmp(pattern.data(), back.data(), bytes), 0);
  }

  std::unique_ptr<Upstream> upstream_;
};

using Upstreams = ::testing::Types<SimulatedDevice, SimulatedAddressOnly, PageableHost,
                                   SimulatedPinnedHost, GpuCudaDevice, GpuCudaMalloc,
                                   GpuVirtualMemory, GpuPinnedHostAlloc, GpuPinnedMmapRegister>;
class UpstreamNames {
 public:
  template <typename T>
  static std::string GetName(int) {
    if (std::is_same_v<T, SimulatedDevice>) return "SimulatedDevice";
    if (std::is_same_v<T, SimulatedAddressOnly>) return "SimulatedAddressOnly";
    if (std::is_same_v<T, PageableHost>) return "PageableHost";
    if (std::is_same_v<T, SimulatedPinnedHost>) return "SimulatedPinnedHost";
    if (std::is_same_v<T, GpuCudaDevice>) return "GpuCudaDevice";
    if (std::is_same_v<T, GpuCudaMalloc>) return "GpuCudaMalloc";
    if (std::is_same_v<T, GpuVirtualMemory>) return "GpuVirtualMemory";
    if (std::is_same_v<T, GpuPinnedHostAlloc>) return "GpuPinnedHostAlloc";
    return "GpuPinnedMmapRegister";
  }
};
TYPED_TEST_SUITE(UpstreamConformance, Upstreams, UpstreamNames);

TYPED_TEST(UpstreamConformance, SegmentsAreAlignedDisjointAndUsable) {
  std::vector<std::pair<std::byte*, std::size_t>> segments;
  for (std::size_t bytes : {kSegmentAlignment, 2 * kMiB, 3 * kMiB + 512, 64 * kMiB}) {
    absl::StatusOr<void*> p = this->upstream_->allocate(bytes);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_NE(*p, nullptr);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(*p) % kSegmentAlignment, 0u);
    segments.emplace_back(static_cast<std::byte*>(*p), bytes);
  }
  for (std::size_t i = 0; i < segments.size(); ++i) {
    for (std::size_t j = i + 1; j < segments.size(); ++j) {
      const bool disjoint = segments[i].first + segments[i].second <= segments[j].first ||
                            segments[j].first + segments[j].second <= segments[i].first;
      EXPECT_TRUE(disjoint) << i << " overlaps " << j;
    }
  }
  for (auto [p, bytes] : segments) this->expect_usable(p, std::min<std::size_t>(bytes, 4 * kMiB));
  for (auto [p, bytes] : segments) ASSERT_TRUE(this->upstream_->deallocate(p, bytes).ok());
}

TYPED_TEST(UpstreamConformance, ImpossibleRequestIsResourceExhaustedAndHarmless) {
  const std::size_t huge = std::size_t{1} << 50;  // 1 PiB: no machine has it
  absl::StatusOr<void*> p = this->upstream_->allocate(huge);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  absl::StatusOr<void*> q = this->upstream_->allocate(2 * kMiB);
  ASSERT_TRUE(q.ok()) << q.status();
  this->expect_usable(*q, 2 * kMiB);
  ASSERT_TRUE(this->upstream_->deallocate(*q, 2 * kMiB).ok());
}

TYPED_TEST(UpstreamConformance, CyclesHoldNothingBack) {
  // 100 cycles of 32 MiB: a leak of one cycle's segment would show on the capacity-bound upstreams
  // (512 MiB) and as address growth elsewhere.
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<void*> p = this->upstream_->allocate(32 * kMiB);
    ASSERT_TRUE(p.ok()) << "cycle " << i << ": " << p.status();
    ASSERT_TRUE(this->upstream_->deallocate(*p, 32 * kMiB).ok());
  }
  absl::StatusOr<void*> big = this->upstream_->allocate(448 * kMiB);
  ASSERT_TRUE(big.ok()) << big.status();
  ASSERT_TRUE(this->upstream_->deallocate(*big, 448 * kMiB).ok());
}

TYPED_TEST(UpstreamConformance, HasAName) { EXPECT_FALSE(this->upstream_->name().empty()); }

// Memory mapped into a reserved range by separate calls is one contiguous, usable span; unmapping
// one piece leaves the others' contents; a piece maps again (See Note [Expandable segments] in
// allocator/block_pool_expand.cpp).
TYPED_TEST(UpstreamConformance, RangesMapAndUnmapInPieces) {
  Upstream& up = *this->upstream_;
  const std::size_t g = up.expansion_granularity();
  if (g == 0) {
    absl::StatusOr<Upstream::Range> range = up.reserve_range(2 * kMiB, 2 * kMiB);
    ASSERT_FALSE(range.ok());
    EXPECT_EQ(range.status().code(), absl::StatusCode::kUnimplemented) << range.status();
    return;
  }
  EXPECT_EQ(g & (g - 1), 0u) << "the granularity is a power of two";
  EXPECT_GE(up.max_range_bytes(), 4 * g);
  absl::StatusOr<Upstream::Range> range = up.reserve_range(16 * g, 4 * g);
  ASSERT_TRUE(range.ok()) << range.status();
  ASSERT_GE(range->bytes, 4 * g);
  auto* base = static_cast<std::byte*>(range->base);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(base) % kSegmentAlignment, 0u);
  ASSERT_TRUE(up.map_range(base, 2 * g).ok());
  ASSERT_TRUE(up.map_range(base + 2 * g, g).ok());
  this->expect_usable(base, 3 * g);  // across the two mappings
  ASSERT_TRUE(up.unmap_range(base, 2 * g).ok());
  this->expect_usable(base + 2 * g, g);
  ASSERT_TRUE(up.map_range(base, 2 * g).ok());
  this->expect_usable(base, 3 * g);
  ASSERT_TRUE(up.unmap_range(base, 2 * g).ok());
  ASSERT_TRUE(up.unmap_range(base + 2 * g, g).ok());
  ASSERT_TRUE(up.release_range(range->base, range->bytes).ok());
}

// Misuse is refused and leaves the mappings as they were. The driver reports the refused call to
// compute-sanitizer as an API error, so tools/gpu/check.sh leaves this test (*Refused*) out of its
// memcheck runs.
TYPED_TEST(UpstreamConformance, MappingOverAMappingIsRefused) {
  Upstream& up = *this->upstream_;
  const std::size_t g = up.expansion_granularity();
  if (g == 0) GTEST_SKIP() << up.name() << " has no expandable segments";
  absl::StatusOr<Upstream::Range> range = up.reserve_range(4 * g, 4 * g);
  ASSERT_TRUE(range.ok()) << range.status();
  auto* base = static_cast<std::byte*>(range->base);
  ASSERT_TRUE(up.map_range(base, 2 * g).ok());
  EXPECT_FALSE(up.map_range(base + g, g).ok()) << "mapping over a mapping";
  EXPECT_FALSE(up.unmap_range(base, g).ok()) << "unmapping part of one mapping";
  this->expect_usable(base, 2 * g);
  ASSERT_TRUE(up.unmap_range(base, 2 * g).ok());
  ASSERT_TRUE(up.release_range(range->base, range->bytes).ok());
}

// Runs out of device memory on purpose: left out of check.sh's memcheck runs (*MappingPast*), as
// the driver's out-of-memory answer is an API error there.
TYPED_TEST(UpstreamConformance, MappingPastTheMemoryIsResourceExhaustedAndHarmless) {
  Upstream& up = *this->upstream_;
  const std::size_t g = up.expansion_granularity();
  if (g == 0) GTEST_SKIP() << up.name() << " has no expandable segments";
  const std::size_t too_much = (up.max_range_bytes() / g + 1) * g;
  absl::StatusOr<Upstream::Range> range = up.reserve_range(too_much, too_much);
  ASSERT_TRUE(range.ok()) << range.status();
  const absl::Status failed = up.map_range(range->base, too_much);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.code(), absl::StatusCode::kResourceExhausted) << failed;
  ASSERT_TRUE(up.map_range(range->base, g).ok());
  this->expect_usable(range->base, g);
  ASSERT_TRUE(up.unmap_range(range->base, g).ok());
  ASSERT_TRUE(up.release_range(range->base, range->bytes).ok());
}

// Sanitizers map terabytes of shadow memory and abort rather than fail when an address-space limit
// bites, so the limit test runs in the plain build only.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

std::size_t virtual_memory_bytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmSize:") {
      std::size_t kib = 0;
      status >> kib;
      return kib * kKiB;
    }
  }
  return 0;
}

// Where the process cannot map the whole capacity (the CI's ThreadSanitizer layout could not map
// 1 TiB), the address-only device reserves what it can and says so when that runs out.
TEST(SimulatedAddressOnly, ReservesWhatTheAddressSpaceAllowsAndSaysSo) {
  if (kSanitized) GTEST_SKIP() << "address-space limits and sanitizers do not mix";
  const std::size_t in_use = virtual_memory_bytes();
  ASSERT_GT(in_use, 0u);
  rlimit old_limit{};
  ASSERT_EQ(getrlimit(RLIMIT_AS, &old_limit), 0);
  rlimit limit = old_limit;
  limit.rlim_cur = in_use + 8 * kGiB;
  ASSERT_EQ(setrlimit(RLIMIT_AS, &limit), 0);
  auto device = make_simulated_device_upstream(
      {.capacity = std::size_t{1} << 40, .backing = SimulatedBacking::kAddressOnly});
  absl::StatusOr<void*> first = device->allocate(2 * kMiB);
  absl::StatusOr<void*> too_much = device->allocate(16 * kGiB);
  ASSERT_EQ(setrlimit(RLIMIT_AS, &old_limit), 0);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_FALSE(too_much.ok());
  EXPECT_EQ(too_much.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(too_much.status().message().find("of address space could be reserved"),
            std::string_view::npos)
      << too_much.status();
  ASSERT_TRUE(device->deallocate(*first, 2 * kMiB).ok());
}

}  // namespace
}  // namespace strata::alloc
