// The Adam kernels against a float64 reference of torch.optim's math: CPU always, CUDA with the gpu
// label (skipped without a GPU). Covers Adam and AdamW, amsgrad, maximize, weight decay, numel 0,
// tails, thread splits (bitwise equal), lists longer than one launch holds and a tensor of more
// than 2^31 elements on the GPU.
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "allocator/upstream.h"
#include "gtest/gtest.h"
#include "optim/adam_kernels.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::optim {
namespace {

struct Buffers {
  std::vector<float> p, g, m, v, vmax;
};

Buffers random_buffers(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  Buffers b;
  for (std::size_t i = 0; i < n; ++i) {
    b.p.push_back(d(rng));
    b.g.push_back(d(rng) * 0.1f);
    b.m.push_back(d(rng) * 0.01f);
    b.v.push_back(std::abs(d(rng)) * 0.001f);
    b.vmax.push_back(b.v.back() * 1.5f);
  }
  return b;
}

// torch.optim.Adam(W) for one element, in float64, with the hyperparameters and bias corrections
// as the kernel takes them (rounded to float32, as torch's CUDA kernel does).
void reference(double& p, double g, double& m, double& v, double& vmax, const AdamHyper& h,
               std::int64_t step) {
  const double lr = static_cast<float>(h.lr), wd = static_cast<float>(h.weight_decay);
  const double beta1 = static_cast<float>(h.beta1), beta2 = static_cast<float>(h.beta2);
  const double eps = static_cast<float>(h.eps);
  if (h.maximize) g = -g;
  if (wd != 0) {
    if (h.decoupled) {
      p *= 1.0 - lr * wd;
    } else {
      g += wd * p;
    }
  }
  m = beta1 * m + (1.0 - beta1) * g;
  v = beta2 * v + (1.0 - beta2) * g * g;
  double second = v;
  if (h.amsgrad) {
    vmax = std::max(vmax, v);
    second = vmax;
  }
  // The bias corrections as torch's CUDA kernel rounds them: float32 powf, then 1 - it in float32
  // (which alone is up to ~6e-5 off the float64 value for beta2 = 0.999 at small t).
  const double bc1 = 1.0f - powf(static_cast<float>(beta1), static_cast<float>(step));
  const double bc2 = 1.0f - powf(static_cast<float>(beta2), static_cast<float>(step));
  p -= (lr / bc1) * m / (std::sqrt(second) / std::sqrt(bc2) + eps);
}

std::vector<AdamHyper> hypers() {
  return {{},
          {.lr = 1e-2f, .weight_decay = 0.1f, .decoupled = true},
          {.lr = 3e-3f, .weight_decay = 0.05f, .decoupled = false},
          {.lr = 1e-3f, .amsgrad = true},
          {.lr = 1e-3f, .weight_decay = 0.01f, .amsgrad = true, .maximize = true}};
}

TEST(AdamCpuKernelTest, MatchesAFloat64ReferenceOverManySteps) {
  for (const AdamHyper& h : hypers()) {
    for (std::size_t n : {0ul, 1ul, 3ul, 5ul, 4097ul}) {
      Buffers b = random_buffers(n, n + 17);
      std::vector<double> rp(b.p.begin(), b.p.end()), rm(b.m.begin(), b.m.end()),
          rv(b.v.begin(), b.v.end()), rvmax(b.vmax.begin(), b.vmax.end());
      double worst = 0;
      for (std::int64_t step = 1; step <= 50; ++step) {
        AdamTensor t{b.p.data(),
                     b.g.data(),
                     b.m.data(),
                     b.v.data(),
                     h.amsgrad ? b.vmax.data() : nullptr,
                     static_cast<std::int64_t>(n)};
        t.step = step;  // each tensor's bias corrections follow its own step
        adam_step_cpu(&t, 1, adam_scalars(h, step), 1.0f, nullptr);
        for (std::size_t i = 0; i < n; ++i) {
          reference(rp[i], b.g[i], rm[i], rv[i], rvmax[i], h, step);
          // The criterion: |diff| <= atol 1e-6 + rtol 1e-5 * |reference|.
          worst = std::max(worst, std::abs(rp[i] - b.p[i]) / (1e-6 + 1e-5 * std::abs(rp[i])));
        }
      }
      EXPECT_LE(worst, 1.0) << "n=" << n << " lr=" << h.lr << " amsgrad=" << h.amsgrad;
    }
  }
}

TEST(AdamCpuKernelTest, ThreadSplitsGiveBitwiseEqualResults) {
  const std::size_t n = 3'000'001;
  Buffers a = random_buffers(n, 5), b = a;
  AdamTensor ta{a.p.data(), a.g.data(), a.m.data(),
                a.v.data(), nullptr,    static_cast<std::int64_t>(n)};
  AdamTensor tb{b.p.data(), b.g.data(), b.m.data(),
                b.v.data(), nullptr,    static_cast<std::int64_t>(n)};
  AdamScalars s = adam_scalars({.weight_decay = 0.01f}, 3);
  ta.step = tb.step = 3;
  ThreadPool seven(7);
  adam_step_cpu(&ta, 1, s, 1.0f, nullptr);
  adam_step_cpu(&tb, 1, s, 1.0f, &seven);
  EXPECT_EQ(a.p, b.p);
  EXPECT_EQ(a.m, b.m);
  EXPECT_EQ(a.v, b.v);
}

TEST(AdamCpuKernelTest, GradScaleDividesGradients) {
  Buffers a = random_buffers(100, 9), b = a;
  for (float& g : b.g) g *= 1024.0f;
  AdamScalars s = adam_scalars({}, 1);
  AdamTensor ta{a.p.data(), a.g.data(), a.m.data(), a.v.data(), nullptr, 100};
  AdamTensor tb{b.p.data(), b.g.data(), b.m.data(), b.v.data(), nullptr, 100};
  adam_step_cpu(&ta, 1, s, 1.0f, nullptr);
  adam_step_cpu(&tb, 1, s, 1.0f / 1024.0f, nullptr);
  EXPECT_EQ(a.p, b.p);  // scaling by a power of two is exact
}

// See Note [A float32 parameter as its own master] in optim/adam_cpu.cpp: a float32 parameter
// whose master is the parameter's own buffer (a host step's layout) steps to the bits of one
// without a master, and of one with a master of its own beside it, for every way of storing the
// moments.
TEST(AdamCpuKernelTest, AFloat32ParameterAsItsOwnMasterStepsAsOneWithout) {
  const std::size_t n = 70'001;  // past one part of a thread split, with a tail and a part block
  ThreadPool three(3);
  for (StateType moments : {StateType::kF32, StateType::kBF16, StateType::kI8}) {
    for (const AdamHyper& h : hypers()) {
      if (h.amsgrad && moments != StateType::kF32) continue;  // amsgrad takes float32 moments
      const std::size_t moment_bytes = moments == StateType::kF32    ? 4 * n
                                       : moments == StateType::kBF16 ? 2 * n
                                                                     : int8_state_bytes(n);
      // Three layouts of the same values: no master, the parameter as its master, a master apart.
      struct Layout {
        Buffers b;
        std::vector<unsigned char> m, v;
        std::vector<float> master;
      };
      std::array<Layout, 3> runs;
      for (Layout& r : runs) {
        r.b = random_buffers(n, 11);
        r.m.assign(moment_bytes, 0);  // zero codes: zero moments in every storage
        r.v.assign(moment_bytes, 0);
        if (moments == StateType::kF32) {
          std::memcpy(r.m.data(), r.b.m.data(), 4 * n);
          std::memcpy(r.v.data(), r.b.v.data(), 4 * n);
        }
      }
      runs[2].master = runs[2].b.p;
      for (std::int64_t step = 1; step <= 3; ++step) {
        const AdamScalars s = adam_scalars(h, step);
        for (std::size_t k = 0; k < runs.size(); ++k) {
          Layout& r = runs[k];
          AdamTensor t{r.b.p.data(),
                       r.b.g.data(),
                       r.m.data(),
                       r.v.data(),
                       h.amsgrad ? r.b.vmax.data() : nullptr,
                       static_cast<std::int64_t>(n)};
          t.state_type = moments;
          t.seed = 77;
          t.step = step;
          if (k == 1) t.master = r.b.p.data();
          if (k == 2) t.master = r.master.data();
          adam_step_cpu(&t, 1, s, 1.0f, &three);
        }
      }
      const std::string what = std::string("moments ") +
                               (moments == StateType::kF32    ? "float32"
                                : moments == StateType::kBF16 ? "bfloat16"
                                                              : "int8") +
                               " lr=" + std::to_string(h.lr) +
                               " amsgrad=" + std::to_string(h.amsgrad);
      for (std::size_t k = 1; k < runs.size(); ++k) {
        EXPECT_EQ(runs[k].b.p, runs[0].b.p) << what << ", layout " << k;
        EXPECT_EQ(runs[k].m, runs[0].m) << what << ", layout " << k;
        EXPECT_EQ(runs[k].v, runs[0].v) << what << ", layout " << k;
        EXPECT_EQ(runs[k].b.vmax, runs[0].b.vmax) << what << ", layout " << k;
      }
      EXPECT_EQ(runs[2].master, runs[0].b.p) << what;
    }
  }
}

#ifdef STRATA_HAS_CUDA
class GpuAdamKernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  }
  static float* upload(const std::vector<float>& h) {
    float* d = nullptr;
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), std::max<std::size_t>(h.size(), 1) * 4),
              cudaSuccess);
    if (!h.empty()) {
      EXPECT_EQ(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    }
    return d;
  }
  static std::vector<float> download(const float* d, std::size_t n) {
    std::vector<float> h(n);
    if (n > 0) {
      EXPECT_EQ(cudaMemcpy(h.data(), d, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return h;
  }
};

TEST_F(GpuAdamKernelTest, GpuMatchesTheCpuKernelOnManyTensorsAndTails) {
  ThreadPool pool(4);
  // 100 tensors (more than one launch holds), sizes with tails, one of several chunks.
  for (const AdamHyper& h : hypers()) {
    std::vector<Buffers> host;
    std::vector<AdamTensor> cpu, gpu;
    std::vector<float*> device;
    for (int t = 0; t < 100; ++t) {
      const std::size_t n = t == 7 ? 700'001 : (t * 37) % 1001;
      host.push_back(random_buffers(n, 1000 + t));
    }
    for (Buffers& b : host) {
      const auto n = static_cast<std::int64_t>(b.p.size());
      cpu.push_back(
          {b.p.data(), b.g.data(), b.m.data(), b.v.data(), h.amsgrad ? b.vmax.data() : nullptr, n});
      float* p = upload(b.p);
      float* g = upload(b.g);
      float* m = upload(b.m);
      float* v = upload(b.v);
      float* vm = upload(b.vmax);
      device.insert(device.end(), {p, g, m, v, vm});
      gpu.push_back({p, g, m, v, h.amsgrad ? vm : nullptr, n});
    }
    for (std::int64_t step = 1; step <= 5; ++step) {
      const AdamScalars s = adam_scalars(h, step);
      for (AdamTensor& t : cpu) t.step = step;
      for (AdamTensor& t : gpu) t.step = step;
      adam_step_cpu(cpu.data(), cpu.size(), s, 1.0f, &pool);
      ASSERT_EQ(adam_step_cuda(gpu.data(), gpu.size(), s, nullptr, nullptr, nullptr), cudaSuccess);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    double worst = 0;
    for (std::size_t t = 0; t < host.size(); ++t) {
      std::vector<float> p = download(static_cast<const float*>(gpu[t].param), host[t].p.size());
      for (std::size_t i = 0; i < p.size(); ++i) {
        worst = std::max(worst, std::abs(static_cast<double>(p[i]) - host[t].p[i]) /
                                    (1e-6 + 1e-5 * std::abs(host[t].p[i])));
      }
    }
    EXPECT_LE(worst, 1.0) << "lr=" << h.lr << " amsgrad=" << h.amsgrad;
    for (float* d : device) cudaFree(d);
  }
}

TEST_F(GpuAdamKernelTest, GpuFoundInfSkipsTheStepAndGradScaleDivides) {
  Buffers b = random_buffers(1000, 3);
  float* p = upload(b.p);
  float* g = upload(b.g);
  float* m = upload(b.m);
  float* v = upload(b.v);
  float* flags = upload({1.0f, 2.0f});  // found_inf = 1, grad_scale = 2
  AdamTensor t{p, g, m, v, nullptr, 1000};
  const AdamScalars s = adam_scalars({}, 1);
  ASSERT_EQ(adam_step_cuda(&t, 1, s, flags + 1, flags, nullptr), cudaSuccess);
  EXPECT_EQ(download(p, 1000), b.p) << "found_inf must skip the update";
  ASSERT_EQ(cudaMemset(flags, 0, sizeof(float)), cudaSuccess);
  ASSERT_EQ(adam_step_cuda(&t, 1, s, flags + 1, flags, nullptr), cudaSuccess);
  Buffers c = b;
  for (float& x : c.g) x *= 0.5f;
  AdamTensor tc{c.p.data(), c.g.data(), c.m.data(), c.v.data(), nullptr, 1000};
  adam_step_cpu(&tc, 1, s, 1.0f, nullptr);
  std::vector<float> got = download(p, 1000);
  for (int i = 0; i < 1000; ++i) EXPECT_NEAR(got[i], c.p[i], 1e-6f * (std::abs(c.p[i]) + 1e-3f));
  for (float* d : {p, g, m, v, flags}) cudaFree(d);
}

TEST_F(GpuAdamKernelTest, GpuMoreThanTwoToTheThirtyOneElements) {
  const std::int64_t n = (std::int64_t{1} << 31) + 5;
  std::size_t free_bytes = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  if (free_bytes < static_cast<std::size_t>(n) * 4 * 4 + (std::size_t{4} << 30)) {
    GTEST_SKIP() << "needs 36 GB of free GPU memory";
  }
  float* d[4];
  for (float*& x : d) {
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&x), n * sizeof(float)), cudaSuccess);
  }
  // p = 1, g = 0.5, m = v = 0 everywhere: every element gets the same exact update.
  std::vector<float> ones(1 << 20, 1.0f), halves(1 << 20, 0.5f);
  for (std::int64_t off = 0; off < n; off += 1 << 20) {
    const std::size_t k = std::min<std::int64_t>(1 << 20, n - off) * 4;
    ASSERT_EQ(cudaMemcpy(d[0] + off, ones.data(), k, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d[1] + off, halves.data(), k, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ASSERT_EQ(cudaMemset(d[2], 0, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(d[3], 0, n * 4), cudaSuccess);
  AdamTensor t{d[0], d[1], d[2], d[3], nullptr, n};
  const AdamScalars s = adam_scalars({}, 1);
  ASSERT_EQ(adam_step_cuda(&t, 1, s, nullptr, nullptr, nullptr), cudaSuccess);
  float want = 1.0f, gm = 0.0f, gv = 0.0f;
  adam_element(want, 0.5f, gm, gv, nullptr, s, 1.0f);
  for (std::int64_t i :
       {std::int64_t{0}, (std::int64_t{1} << 31) - 1, std::int64_t{1} << 31, n - 1}) {
    float got = 0;
    ASSERT_EQ(cudaMemcpy(&got, d[0] + i, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_FLOAT_EQ(got, want) << "element " << i;
  }
  for (float* x : d) cudaFree(x);
}
#endif

}  // namespace
}  // namespace strata::optim
