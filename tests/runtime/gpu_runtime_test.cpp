// The runtime on a real GPU (label gpu; skipped without one): D1 over real memory, H2D and D2H
// copies running at once, and a layer_prefetch optimizer step with a real kernel that makes no
// host wait after warm-up and keeps every state exact.
#include <chrono>
#include <cstdlib>
#include <cstring>

#include <cuda_runtime_api.h>

#include "base/strings.h"
#include "base/units.h"
#include "tests/runtime/kernels.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using testing::read_all;
using testing::spec;
using testing::special_payload;

std::unique_ptr<Runtime> make_gpu_runtime(std::string policy, PolicyConfig config = {}) {
  RuntimeOptions options;
  options.policy = std::move(policy);
  options.policy_config = config;
  options.device = DeviceKind::kCuda;
  options.allocator.track_allocations = true;
  absl::StatusOr<std::unique_ptr<Runtime>> rt =
      Runtime::create(std::move(options), policy::builtin_policies());
  EXPECT_TRUE(rt.ok()) << rt.status();
  return rt.ok() ? std::move(*rt) : nullptr;
}

class GpuRuntimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  }
};

// See Note [One CUDA device a runtime] in runtime/runtime.h: a runtime made without a device
// index runs on the current one, one given runs there and leaves the current device as it was,
// and one that does not exist is refused, naming how many there are.
TEST_F(GpuRuntimeTest, GpuRuntimeRunsOnTheCurrentOrTheNamedDevice) {
  const int count = alloc::cuda_device_count();
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  for (int index : {kCurrentCudaDevice, count - 1}) {
    RuntimeOptions options;
    options.device = DeviceKind::kCuda;
    options.cuda_device = index;
    absl::StatusOr<std::unique_ptr<Runtime>> rt =
        Runtime::create(std::move(options), policy::builtin_policies());
    ASSERT_TRUE(rt.ok()) << rt.status();
    EXPECT_EQ((*rt)->cuda_device(), index == kCurrentCudaDevice ? current : index);
    // Streams, events and memory made on it; the thread's device is untouched.
    const TensorHandle h =
        *(*rt)->register_tensor(testing::spec("w", 0, Role::kParameter, 1 << 20));
    for (Tier tier : {Tier::kPinnedHost, Tier::kGpu}) {
      ASSERT_TRUE((*rt)->migrate(h, tier).ok());
      ASSERT_TRUE((*rt)->wait_all().ok());
    }
    cudaPointerAttributes attributes{};
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, (*rt)->info(h)->data), cudaSuccess);
    EXPECT_EQ(attributes.device, (*rt)->cuda_device());
    int after = -1;
    ASSERT_EQ(cudaGetDevice(&after), cudaSuccess);
    EXPECT_EQ(after, current);
  }
  RuntimeOptions options;
  options.device = DeviceKind::kCuda;
  options.cuda_device = count;
  absl::StatusOr<std::unique_ptr<Runtime>> rt =
      Runtime::create(std::move(options), policy::builtin_policies());
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rt.status().message(),
            str_cat("CUDA device ", count, " does not exist; ", count, " visible"));
}

// D1 on the GPU: payloads that change every cycle (a variant of special values, the last 4 bytes
// the cycle number), written on the first tier, moved to the second and back, read back every
// cycle. Sizes up to 4 MiB + 1 keep 10^4 cycles of three tier pairs near a minute on an H200 (the
// CPU suites cross the 16 MiB bounce-chunk boundary).
TEST_F(GpuRuntimeTest, GpuD1CyclesPerTierPairAreBitExact) {
  const std::pair<Tier, Tier> pairs[] = {{Tier::kGpu, Tier::kPinnedHost},
                                         {Tier::kGpu, Tier::kPageableHost},
                                         {Tier::kPinnedHost, Tier::kPageableHost}};
  std::vector<std::size_t> sizes = {1, 255, (std::size_t{1} << 22) + 1};
  for (int k : {3, 12, 20}) {
    sizes.push_back((std::size_t{1} << k) - 1);
    sizes.push_back((std::size_t{1} << k) + 1);
  }
  const char* env = std::getenv("STRATA_D1_CYCLES");
  const int cycles = env != nullptr ? std::atoi(env) : 10'000;
  constexpr int kVariants = 4;
  std::int64_t mismatches = 0;
  for (auto [a, b] : pairs) {
    auto rt = make_gpu_runtime("bulk");
    std::vector<TensorHandle> hs;
    std::vector<std::vector<std::vector<unsigned char>>> variants(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      for (int v = 0; v < kVariants; ++v) {
        variants[i].push_back(special_payload(sizes[i], 300 + 10 * i + v));
      }
      hs.push_back(
          *rt->register_tensor(spec(str_cat("t", i), 0, Role::kOther, sizes[i], DType::kUInt8, a),
                               variants[i][0].data()));
    }
    std::vector<std::vector<unsigned char>> now(hs.size());
    for (int c = 0; c < cycles; ++c) {
      for (std::size_t i = 0; i < hs.size(); ++i) {
        now[i] = variants[i][c % kVariants];
        if (now[i].size() >= 8) std::memcpy(now[i].data() + now[i].size() - 4, &c, 4);
        ASSERT_TRUE(rt->write(hs[i], now[i].data()).ok());
      }
      for (Tier t : {b, a}) {
        for (TensorHandle h : hs) ASSERT_TRUE(rt->migrate(h, t).ok());
        ASSERT_TRUE(rt->wait_all().ok());
      }
      for (std::size_t i = 0; i < hs.size(); ++i) mismatches += read_all(*rt, hs[i]) != now[i];
    }
  }
  std::printf(
      "GPU D1: %d cycles x 3 tier pairs, %zu tensors (1 B .. 4 MiB), new payloads every cycle, "
      "%lld mismatches\n",
      cycles, sizes.size(), static_cast<long long>(mismatches));
  EXPECT_EQ(mismatches, 0);
}

TEST_F(GpuRuntimeTest, GpuH2DAndD2HRunAtOnce) {
  auto rt = make_gpu_runtime("bulk");
  constexpr std::size_t kBytes = std::size_t{256} << 20;
  constexpr int kEach = 8;  // 2 GiB each way
  std::vector<TensorHandle> up, down;
  std::vector<unsigned char> payload = special_payload(kBytes, 1);
  for (int i = 0; i < kEach; ++i) {
    up.push_back(*rt->register_tensor(
        spec(str_cat("up", i), 0, Role::kOther, kBytes, DType::kUInt8, Tier::kPinnedHost),
        payload.data()));
    down.push_back(*rt->register_tensor(
        spec(str_cat("down", i), 0, Role::kOther, kBytes, DType::kUInt8, Tier::kGpu),
        payload.data()));
  }
  auto timed = [&](bool do_up, bool do_down) {
    // Warm both pools for the sizes, then time one pass.
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kEach; ++i) {
      if (do_up) {
        EXPECT_TRUE(rt->migrate(up[i], Tier::kGpu).ok());
      }
      if (do_down) {
        EXPECT_TRUE(rt->migrate(down[i], Tier::kPinnedHost).ok());
      }
    }
    EXPECT_TRUE(rt->wait_all().ok());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (int i = 0; i < kEach; ++i) {
      if (do_up) {
        EXPECT_TRUE(rt->migrate(up[i], Tier::kPinnedHost).ok());
      }
      if (do_down) {
        EXPECT_TRUE(rt->migrate(down[i], Tier::kGpu).ok());
      }
    }
    EXPECT_TRUE(rt->wait_all().ok());
    return s;
  };
  timed(true, true);  // warm-up
  const double h2d = timed(true, false);
  const double d2h = timed(false, true);
  const double both = timed(true, true);
  std::printf("2 GiB H2D %.1f ms, D2H %.1f ms, both at once %.1f ms (%.2f of the sum)\n", h2d * 1e3,
              d2h * 1e3, both * 1e3, both / (h2d + d2h));
  // Serial copies would take h2d + d2h; overlapped ones about the longer of the two.
  EXPECT_LT(both, 0.8 * (h2d + d2h));
  EXPECT_EQ(read_all(*rt, up[0]), payload);
}

TEST_F(GpuRuntimeTest, GpuLayerPrefetchStepMakesNoHostWaitAndKeepsStatesExact) {
  for (int depth : {1, 2}) {
    auto rt = make_gpu_runtime("layer_prefetch", {.prefetch_depth = depth});
    constexpr int kLayers = 8;
    constexpr std::size_t kN = (std::size_t{3} << 20) + 7;  // floats per state, odd
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(
          rt->register_tensor(spec(str_cat("m", l), l, Role::kOptimizerState, kN + l)).ok());
      ASSERT_TRUE(
          rt->register_tensor(spec(str_cat("v", l), l, Role::kOptimizerState, kN - l)).ok());
    }
    auto stream = static_cast<cudaStream_t>(rt->compute_stream());
    auto step = [&] {
      ASSERT_TRUE(rt->begin_optimizer_step().ok());
      for (int l : rt->optimizer_layer_order()) {
        auto ptrs = rt->acquire_layer(l, RoleSet::optimizer_states(), Tier::kGpu, stream);
        ASSERT_TRUE(ptrs.ok()) << ptrs.status();
        std::vector<TensorHandle> hs = rt->layer_tensors(l, RoleSet::optimizer_states());
        for (std::size_t i = 0; i < hs.size(); ++i) {
          ASSERT_EQ(::strata::testing::add_scalar(static_cast<float*>((*ptrs)[i]),
                                                  rt->info(hs[i])->bytes / 4, 1.0f, stream),
                    cudaSuccess);
        }
        ASSERT_TRUE(rt->release_layer(l, RoleSet::optimizer_states(), stream).ok());
      }
      ASSERT_TRUE(rt->end_optimizer_step().ok());
    };
    step();  // warm-up: staging ring and pinned pool take their memory
    const std::int64_t syncs = rt->stats().host_syncs;
    const std::int64_t pinned_segments =
        rt->allocator().stats(Tier::kPinnedHost).num_segment_allocs;
    constexpr int kSteps = 6;
    for (int i = 0; i < kSteps; ++i) step();
    const std::int64_t steady_waits = rt->stats().host_syncs - syncs;
    EXPECT_EQ(steady_waits, 0) << "host waits in steady state, depth " << depth;
    EXPECT_EQ(rt->allocator().stats(Tier::kPinnedHost).num_segment_allocs, pinned_segments);
    RuntimeStats s = rt->stats();
    const std::int64_t layer = 2 * static_cast<std::int64_t>((kN + kLayers) * 4 + 512);
    EXPECT_LE(s.staged_peak_bytes, (depth + 1) * layer);
    EXPECT_EQ(rt->allocator().stats(Tier::kGpu).allocated_bytes.peak, 0);
    for (TensorHandle h : rt->tensors()) {
      std::vector<unsigned char> raw = read_all(*rt, h);
      const float* f = reinterpret_cast<const float*>(raw.data());
      std::size_t wrong = 0;
      for (std::size_t k = 0; k < raw.size() / 4; ++k) wrong += f[k] != kSteps + 1.0f;
      ASSERT_EQ(wrong, 0u) << rt->info(h)->spec.name << " depth " << depth;
    }
    std::printf(
        "layer_prefetch depth %d: %d steps, host waits in them %lld, staged peak %s, H2D %.1f "
        "GB/s, "
        "D2H %.1f GB/s, prefetch waits %lld (stalled %.3f ms)\n",
        depth, kSteps, static_cast<long long>(steady_waits),
        format_bytes(s.staged_peak_bytes).c_str(), s.h2d_gbps(), s.d2h_gbps(),
        static_cast<long long>(s.prefetch_waits), s.prefetch_stall_ns / 1e6);
  }
}

}  // namespace
}  // namespace strata::rt
