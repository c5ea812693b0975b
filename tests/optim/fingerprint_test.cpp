// Gradient fingerprints (optim/fingerprint.h): the same values give the same fingerprint, a
// scaling by any factor but 1 (clip_grad_norm_ that clipped, unscale_) changes it for float32 and
// bfloat16 elements, so does any single-element change or a swap, and on a GPU (gpu label, skipped
// without one) the CUDA fingerprint is the host's.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "allocator/upstream.h"
#include "gtest/gtest.h"
#include "optim/fingerprint.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::optim {
namespace {

std::vector<float> random_grads(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1e-3f);
  std::vector<float> g(n);
  for (float& x : g) x = dist(gen);
  return g;
}

std::vector<std::uint16_t> to_bf16(const std::vector<float>& g) {
  std::vector<std::uint16_t> out(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, &g[i], 4);
    out[i] = static_cast<std::uint16_t>(bits >> 16);  // truncation: any bfloat16 values do
  }
  return out;
}

template <typename T>
std::vector<std::int64_t> print_of(const std::vector<T>& v) {
  std::vector<std::int64_t> out = {0, 0};
  fingerprint_cpu(v.data(), static_cast<std::int64_t>(v.size()), sizeof(T), out.data());
  return out;
}

TEST(FingerprintTest, SameValuesSamePrintAndEveryScalingButOneChangesIt) {
  const std::vector<float> g = random_grads(100'003, 7);
  const auto before = print_of(g);
  EXPECT_EQ(print_of(std::vector<float>(g)), before);
  std::vector<float> one = g;
  for (float& x : one) x *= 1.0f;
  EXPECT_EQ(print_of(one), before);
  const auto before_bf16 = print_of(to_bf16(g));
  for (float c : {1.0f - 0x1p-24f, 1.0f - 0x1p-20f, 0.999f, 0.7f, 0.5f, 1e-30f, 0.0f,
                  1.0f + 0x1p-23f, 2.0f, 1e20f}) {
    std::vector<float> scaled = g;
    for (float& x : scaled) x *= c;
    EXPECT_NE(print_of(scaled), before) << c;
    if (c < 0.999f || c > 1.001f) {
      EXPECT_NE(print_of(to_bf16(scaled)), before_bf16) << c;
    }
  }
}

TEST(FingerprintTest, OneElementChangedOrTwoSwappedChangesIt) {
  const std::vector<float> g = random_grads(4097, 8);
  const auto before = print_of(g);
  for (std::size_t i : {std::size_t{0}, std::size_t{1}, std::size_t{2048}, std::size_t{4096}}) {
    std::vector<float> changed = g;
    changed[i] = std::nextafter(changed[i], 1.0f);
    EXPECT_NE(print_of(changed), before) << i;
    std::vector<float> swapped = g;
    std::swap(swapped[i], swapped[(i + 1) % g.size()]);
    EXPECT_NE(print_of(swapped), before) << i;
  }
  std::vector<float> negated = g;
  negated[5] = -negated[5];
  EXPECT_NE(print_of(negated), before);
}

#ifdef STRATA_HAS_CUDA
TEST(GpuFingerprintTest, GpuFingerprintIsTheHosts) {
  if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{255}, std::size_t{1'000'003},
                        std::size_t{5'000'000}}) {
    const std::vector<float> g = random_grads(n, 9 + static_cast<unsigned>(n));
    const std::vector<std::uint16_t> low = to_bf16(g);
    void* data = nullptr;
    std::int64_t* out = nullptr;
    ASSERT_EQ(cudaMalloc(&data, std::max<std::size_t>(4 * n, 4)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&out), 4 * sizeof(std::int64_t)), cudaSuccess);
    ASSERT_EQ(cudaMemset(out, 0, 4 * sizeof(std::int64_t)), cudaSuccess);
    if (n > 0) {
      ASSERT_EQ(cudaMemcpy(data, g.data(), 4 * n, cudaMemcpyHostToDevice), cudaSuccess);
    }
    ASSERT_EQ(fingerprint_cuda(data, static_cast<std::int64_t>(n), 4, out, nullptr), cudaSuccess);
    if (n > 0) {
      ASSERT_EQ(cudaMemcpy(data, low.data(), 2 * n, cudaMemcpyHostToDevice), cudaSuccess);
    }
    ASSERT_EQ(fingerprint_cuda(data, static_cast<std::int64_t>(n), 2, out + 2, nullptr),
              cudaSuccess);
    std::vector<std::int64_t> got(4);
    ASSERT_EQ(cudaMemcpy(got.data(), out, 4 * sizeof(std::int64_t), cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(std::vector<std::int64_t>(got.begin(), got.begin() + 2), print_of(g)) << n;
    EXPECT_EQ(std::vector<std::int64_t>(got.begin() + 2, got.end()), print_of(low)) << n;
    cudaFree(data);
    cudaFree(out);
  }
}
#endif

}  // namespace
}  // namespace strata::optim
