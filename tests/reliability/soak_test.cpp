// S1 of RELIABILITY.md: thousands of training steps with migrations every step (layer_prefetch
// streams the Adam states through the GPU at every step; every 50th step a bulk phase switch moves
// the parameters and gradients to the host and back). After a warm-up, the bytes reserved per tier
// stay flat, no segment is taken from an upstream (no cudaMalloc / cudaHostAlloc), the staging
// ring does not grow, and the host's resident memory grows by less than 16 MiB.
//
// GpuSoakTest runs on the GPU (label gpu; STRATA_SOAK_STEPS, default 3000); SoakTest runs the same
// loop on the simulated device for a few hundred steps, so the logic is exercised in CI.

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "allocator/upstream.h"
#include "base/host_memory.h"
#include "gtest/gtest.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using testing::spec;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

struct Levels {
  std::array<std::int64_t, alloc::kNumTiers> reserved{}, segment_allocs{};
  std::int64_t staging = 0, rss = 0;
};

Levels levels(Runtime& rt) {
  Levels l;
  for (Tier t : alloc::kAllTiers) {
    const alloc::TierStats s = rt.allocator().stats(t);
    l.reserved[alloc::tier_index(t)] = s.reserved_bytes.current;
    l.segment_allocs[alloc::tier_index(t)] = s.num_segment_allocs;
  }
  l.staging = rt.stats().staging_bytes;
  l.rss = resident_bytes();
  return l;
}

void soak(DeviceKind device, int steps, std::size_t numel) {
  constexpr int kLayers = 8;
  constexpr int kWarmup = 100;
  RuntimeOptions options;
  options.policy = "layer_prefetch";
  options.policy_config.prefetch_depth = 1;
  options.device = device;
  options.allocator.simulated_device.capacity = std::size_t{2} << 30;
  auto made = Runtime::create(std::move(options), policy::builtin_policies());
  ASSERT_TRUE(made.ok()) << made.status();
  Runtime& rt = **made;

  std::vector<std::pair<TensorHandle, TensorHandle>> params;
  std::vector<float> init(numel);
  for (std::size_t i = 0; i < numel; ++i) init[i] = 1e-3f * static_cast<float>(i % 1000);
  for (int l = 0; l < kLayers; ++l) {
    TensorHandle p =
        *rt.register_tensor(spec(str_cat("l", l, ".w"), l, Role::kParameter, numel), init.data());
    TensorHandle g = *rt.register_tensor(
        spec(str_cat("l", l, ".w.grad"), l, Role::kGradient, numel), init.data());
    params.push_back({p, g});
  }
  optim::AdamOptions ao;
  ao.groups.push_back({.params = params, .hyper = {.lr = 1e-4f, .weight_decay = 0.01f}});
  std::unique_ptr<optim::Adam> adam = *optim::Adam::create(rt, ao);

  Levels warm;
  for (int step = 1; step <= steps; ++step) {
    ASSERT_TRUE(rt.begin_step().ok());
    absl::Status s = adam->step();
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s;
    ASSERT_TRUE(rt.end_step().ok());
    if (step % 50 == 0) {
      // A phase switch: the parameters and gradients go to the host and come back.
      for (auto [p, g] : params) {
        ASSERT_TRUE(rt.migrate(p, Tier::kPinnedHost).ok());
        ASSERT_TRUE(rt.migrate(g, Tier::kPinnedHost).ok());
      }
      ASSERT_TRUE(rt.wait_all().ok());
      for (auto [p, g] : params) {
        ASSERT_TRUE(rt.migrate(p, Tier::kGpu).ok());
        ASSERT_TRUE(rt.migrate(g, Tier::kGpu).ok());
      }
    }
    if (step == kWarmup) {
      ASSERT_TRUE(rt.wait_all().ok());
      warm = levels(rt);
    }
    if (step % 1000 == 0) std::printf("soak: step %d of %d\n", step, steps);
  }
  ASSERT_TRUE(rt.wait_all().ok());
  const Levels end = levels(rt);
  for (Tier t : alloc::kAllTiers) {
    const int i = alloc::tier_index(t);
    EXPECT_EQ(end.reserved[i], warm.reserved[i])
        << "reserved bytes grew in " << alloc::tier_name(t);
    EXPECT_EQ(end.segment_allocs[i], warm.segment_allocs[i])
        << "segments taken from the upstream after warm-up in " << alloc::tier_name(t);
  }
  EXPECT_EQ(end.staging, warm.staging);
  // AddressSanitizer keeps freed memory in quarantine (up to 256 MiB), so the RSS of a sanitized
  // build grows whatever the code does; the plain build checks it.
  if (!kSanitized) {
    EXPECT_LT(end.rss - warm.rss, std::int64_t{16} << 20) << "host RSS grew";
  }
  std::printf(
      "S1 soak (%s): %d steps of %d layers x %zu floats; after warm-up: reserved gpu %lld -> %lld, "
      "pinned %lld -> %lld, pageable %lld -> %lld; upstream segment allocations %lld / %lld / "
      "%lld after warm-up; host RSS %+lld KiB\n",
      rt.device().name().c_str(), steps, kLayers, numel, static_cast<long long>(warm.reserved[0]),
      static_cast<long long>(end.reserved[0]), static_cast<long long>(warm.reserved[1]),
      static_cast<long long>(end.reserved[1]), static_cast<long long>(warm.reserved[2]),
      static_cast<long long>(end.reserved[2]),
      static_cast<long long>(end.segment_allocs[0] - warm.segment_allocs[0]),
      static_cast<long long>(end.segment_allocs[1] - warm.segment_allocs[1]),
      static_cast<long long>(end.segment_allocs[2] - warm.segment_allocs[2]),
      static_cast<long long>((end.rss - warm.rss) / 1024));
}

TEST(SoakTest, SimulatedStepsHoldEveryLevelFlat) { soak(DeviceKind::kSimulated, 400, 1 << 16); }

TEST(GpuSoakTest, GpuStepsHoldEveryLevelFlat) {
  if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  const char* env = std::getenv("STRATA_SOAK_STEPS");
  soak(DeviceKind::kCuda, env != nullptr ? std::atoi(env) : 3000, 4 << 20);
}

}  // namespace
}  // namespace strata::rt
