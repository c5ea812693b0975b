// Lion, the second step rule (optim/step_rule.h): its host kernel against a float64 reference of
// the published update, its threads' split, its edge cases (sign of 0 and NaN, maximize, mixed
// precision), the rule's declared states and refusals, and on a GPU (gpu label, skipped without
// one) its CUDA kernel bitwise the host kernel's.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "allocator/upstream.h"
#include "gtest/gtest.h"
#include "optim/lion_kernels.h"
#include "optim/step_rule.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::optim {
namespace {

struct Buffers {
  std::vector<float> p, g, m;
  StepTensor tensor() {
    StepTensor t;
    t.param = p.data();
    t.grad = g.data();
    t.states[0] = m.data();
    t.numel = static_cast<std::int64_t>(p.size());
    return t;
  }
};

std::vector<float> normal(std::mt19937_64& rng, std::size_t n, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> out(n);
  for (float& x : out) x = d(rng);
  return out;
}

Buffers random_buffers(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  return {normal(rng, n, 1.0f), normal(rng, n, 0.1f), normal(rng, n, 0.05f)};
}

std::vector<AdamHyper> hypers() {
  return {{.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.99},
          {.lr = 3e-4, .beta1 = 0.95, .beta2 = 0.98, .weight_decay = 0.1},
          {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.99, .weight_decay = 0.01, .maximize = true}};
}

TEST(LionKernelTest, HostKernelIsThePublishedUpdate) {
  ThreadPool pool(4);
  for (const AdamHyper& h : hypers()) {
    Buffers b = random_buffers(100'003, 7);
    std::vector<double> p(b.p.begin(), b.p.end()), m(b.m.begin(), b.m.end());
    const StepTensor t = b.tensor();
    int compared = 0;
    for (int step = 0; step < 3; ++step) {
      lion_step_cpu(&t, 1, lion_scalars(h), 1.0f, &pool);
      for (std::size_t i = 0; i < p.size(); ++i) {
        // Chen et al., 2023, Algorithm 2, in float64.
        const double g = h.maximize ? -b.g[i] : b.g[i];
        const double c = h.beta1 * m[i] + (1 - h.beta1) * g;
        p[i] = p[i] * (1 - h.lr * h.weight_decay) - h.lr * (c > 0 ? 1 : (c < 0 ? -1 : 0));
        m[i] = h.beta2 * m[i] + (1 - h.beta2) * g;
      }
    }
    for (std::size_t i = 0; i < p.size(); ++i) {
      // An interpolation within a rounding of 0 may take the other sign; none here is that close.
      if (std::abs(m[i]) < 1e-6) continue;
      ++compared;
      ASSERT_NEAR(b.p[i], p[i], 1e-6 + 1e-6 * std::abs(p[i])) << i;
      ASSERT_NEAR(b.m[i], m[i], 1e-7 + 1e-5 * std::abs(m[i])) << i;
    }
    EXPECT_GT(compared, 99'000);
  }
}

TEST(LionKernelTest, ThreadSplitsAndTheElementFunctionGiveTheSameBits) {
  const AdamHyper h = hypers()[1];
  std::vector<Buffers> runs;
  for (int k = 0; k < 3; ++k) runs.push_back(random_buffers(300'017, 11));
  ThreadPool seven(7);
  std::vector<StepTensor> ts;
  for (Buffers& b : runs) ts.push_back(b.tensor());
  lion_step_cpu(&ts[0], 1, lion_scalars(h), 0.5f, nullptr);
  lion_step_cpu(&ts[1], 1, lion_scalars(h), 0.5f, &seven);
  const LionScalars s = lion_scalars(h);
  for (std::size_t i = 0; i < runs[2].p.size(); ++i) {
    lion_element(runs[2].p[i], runs[2].g[i], runs[2].m[i], s, 0.5f);
  }
  for (int k = 1; k < 3; ++k) {
    EXPECT_EQ(std::memcmp(runs[0].p.data(), runs[k].p.data(), runs[0].p.size() * 4), 0) << k;
    EXPECT_EQ(std::memcmp(runs[0].m.data(), runs[k].m.data(), runs[0].m.size() * 4), 0) << k;
  }
}

TEST(LionKernelTest, SignOfZeroMovesNothingAndNanPropagates) {
  Buffers b;
  b.p = {1.0f, 2.0f, -3.0f};
  b.g = {0.0f, std::nanf(""), 1.0f};
  b.m = {0.0f, 0.0f, 0.0f};
  const StepTensor t = b.tensor();
  lion_step_cpu(&t, 1, lion_scalars({.lr = 0.5, .beta1 = 0.9, .beta2 = 0.99}), 1.0f, nullptr);
  EXPECT_EQ(b.p[0], 1.0f);  // c = 0: no move
  EXPECT_TRUE(std::isnan(b.p[1]));
  EXPECT_TRUE(std::isnan(b.m[1]));
  EXPECT_EQ(b.p[2], -3.5f);         // c > 0: -lr
  EXPECT_EQ(b.m[2], 1.0f - 0.99f);  // fma(0.99, 0, fma(-0.99, 1, 1))
}

TEST(LionKernelTest, LowPrecisionParametersStepTheirMasterAsFloat32Ones) {
  const AdamHyper h = hypers()[1];
  Buffers f = random_buffers(4099, 5);
  // The float32 run's parameters are the bfloat16 run's masters.
  for (float& v : f.p) v = bf16_to_float(float_to_bf16(v));
  std::vector<float> master = f.p;
  std::vector<std::uint16_t> low(f.p.size()), low_grad(f.g.size());
  for (std::size_t i = 0; i < f.p.size(); ++i) {
    low[i] = float_to_bf16(f.p[i]);
    low_grad[i] = float_to_bf16(f.g[i]);
    f.g[i] = bf16_to_float(low_grad[i]);
  }
  std::vector<float> m = f.m;
  StepTensor t;
  t.param = low.data();
  t.grad = low_grad.data();
  t.states[0] = m.data();
  t.master = master.data();
  t.numel = static_cast<std::int64_t>(low.size());
  t.param_type = ElemType::kBF16;
  t.grad_type = ElemType::kBF16;
  const StepTensor ft = f.tensor();
  for (int step = 0; step < 3; ++step) {
    lion_step_cpu(&t, 1, lion_scalars(h), 1.0f, nullptr);
    lion_step_cpu(&ft, 1, lion_scalars(h), 1.0f, nullptr);
  }
  EXPECT_EQ(std::memcmp(master.data(), f.p.data(), master.size() * 4), 0);
  EXPECT_EQ(std::memcmp(m.data(), f.m.data(), m.size() * 4), 0);
  for (std::size_t i = 0; i < low.size(); ++i) ASSERT_EQ(low[i], float_to_bf16(master[i])) << i;
}

// See Note [A float32 parameter as its own master] in optim/adam_cpu.cpp: Lion's host kernel too.
TEST(LionKernelTest, AFloat32ParameterAsItsOwnMasterStepsAsOneWithout) {
  const AdamHyper h = hypers()[1];
  Buffers plain = random_buffers(70'001, 6), own = plain;
  const StepTensor tp = plain.tensor();
  StepTensor to = own.tensor();
  to.master = static_cast<float*>(to.param);
  ThreadPool three(3);
  for (int step = 0; step < 3; ++step) {
    lion_step_cpu(&tp, 1, lion_scalars(h), 1.0f, &three);
    lion_step_cpu(&to, 1, lion_scalars(h), 1.0f, &three);
  }
  EXPECT_EQ(std::memcmp(own.p.data(), plain.p.data(), plain.p.size() * 4), 0);
  EXPECT_EQ(std::memcmp(own.m.data(), plain.m.data(), plain.m.size() * 4), 0);
}

TEST(StepRuleTest, RulesDeclareTheirStatesAndRefuseWhatTheyDoNotTake) {
  const std::shared_ptr<const StepRule> lion = lion_rule();
  const std::shared_ptr<const StepRule> adam = adam_rule();
  auto names = [](const std::vector<StateDecl>& d) {
    std::vector<std::string> out;
    for (const StateDecl& s : d) out.push_back(s.name);
    return out;
  };
  const AdamHyper h;
  using V = std::vector<std::string>;
  EXPECT_EQ(names(lion->states(h, rt::DType::kFloat32, rt::StepPlace::kGpu, StateType::kF32)),
            V{"exp_avg"});
  EXPECT_EQ(names(lion->states(h, rt::DType::kBFloat16, rt::StepPlace::kGpu, StateType::kF32)),
            (V{"exp_avg", "master_param"}));
  EXPECT_EQ(names(lion->states(h, rt::DType::kFloat32, rt::StepPlace::kHost, StateType::kF32)),
            (V{"exp_avg", "master_param"}));
  EXPECT_EQ(names(adam->states(h, rt::DType::kFloat32, rt::StepPlace::kGpu, StateType::kF32)),
            (V{"exp_avg", "exp_avg_sq"}));
  EXPECT_EQ(
      state_bytes(lion->states(h, rt::DType::kFloat32, rt::StepPlace::kGpu, StateType::kF32), 1000),
      4000);
  EXPECT_EQ(lion->host_scalars(), 0);
  EXPECT_EQ(adam->host_scalars(), 2);

  EXPECT_TRUE(lion->check(h, StateType::kF32, 0).ok());
  AdamHyper amsgrad = h;
  amsgrad.amsgrad = true;
  EXPECT_EQ(lion->check(amsgrad, StateType::kF32, 0).code(), absl::StatusCode::kInvalidArgument);
  AdamHyper coupled = h;
  coupled.decoupled = false;
  EXPECT_EQ(lion->check(coupled, StateType::kF32, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(lion->check(h, StateType::kI8, 0).code(), absl::StatusCode::kInvalidArgument);
  AdamHyper beta = h;
  beta.beta2 = 1.0;
  const absl::Status bad = lion->check(beta, StateType::kF32, 3);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("group 3"), std::string_view::npos) << bad;
  // eps is Adam's: Lion takes any.
  AdamHyper eps = h;
  eps.eps = 0;
  EXPECT_TRUE(lion->check(eps, StateType::kF32, 0).ok());
  EXPECT_FALSE(adam->check(eps, StateType::kF32, 0).ok());
}

TEST(StepRuleTest, RulesAreChosenByName) {
  EXPECT_EQ((*make_step_rule("adam"))->name(), "adam");
  EXPECT_EQ((*make_step_rule("adamw"))->name(), "adam");
  EXPECT_EQ((*make_step_rule("lion"))->name(), "lion");
  const absl::Status s = make_step_rule("sgd").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("adam"), std::string_view::npos) << s;
  EXPECT_NE(s.message().find("lion"), std::string_view::npos) << s;
}

TEST(StepRuleTest, ASkippedStepCountsOnceAndChangesNothing) {
  Buffers b = random_buffers(100, 3);
  const Buffers before = b;
  std::int64_t skipped = 0;
  StepTensor t = b.tensor();
  t.skipped = &skipped;
  lion_rule()->count_skipped_host(&t, 1);
  EXPECT_EQ(skipped, 1);
  EXPECT_EQ(b.p, before.p);
  EXPECT_EQ(b.m, before.m);
}

#ifdef STRATA_HAS_CUDA
class GpuLionKernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  }
  template <typename T>
  static T* upload(const std::vector<T>& h) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, std::max<std::size_t>(h.size() * sizeof(T), 4)), cudaSuccess);
    if (!h.empty()) {
      EXPECT_EQ(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
    return static_cast<T*>(d);
  }
  template <typename T>
  static std::vector<T> download(const void* d, std::size_t n) {
    std::vector<T> h(n);
    if (n > 0) {
      EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return h;
  }
};

// Float32 and bfloat16 / float16 parameters with their masters, many tensors with tails, a grad
// scale, then a step found_inf skips: the CUDA kernel's bits are the host kernel's.
TEST_F(GpuLionKernelTest, GpuLionKernelIsBitwiseTheHostKernel) {
  ThreadPool pool(4);
  for (const AdamHyper& h : hypers()) {
    for (ElemType type : {ElemType::kF32, ElemType::kBF16, ElemType::kF16}) {
      std::vector<Buffers> host;
      std::vector<std::vector<std::uint16_t>> low;
      std::vector<StepTensor> cpu, gpu;
      std::vector<void*> device;
      for (int k = 0; k < 20; ++k) {
        const std::size_t n = k == 3 ? 1'000'003 : (k * 37) % 1001;
        host.push_back(random_buffers(n, 100 + k));
      }
      low.resize(host.size());
      for (std::size_t k = 0; k < host.size(); ++k) {
        Buffers& b = host[k];
        StepTensor c = b.tensor();
        if (type != ElemType::kF32) {
          low[k].resize(b.p.size());
          for (std::size_t i = 0; i < b.p.size(); ++i) {
            store_elem(low[k].data(), type, static_cast<std::int64_t>(i), b.p[i]);
            b.p[i] = load_elem(low[k].data(), type, static_cast<std::int64_t>(i));
          }
          c.param = low[k].data();
          c.param_type = type;
          c.master = b.p.data();
        }
        cpu.push_back(c);
        StepTensor d = c;
        d.grad = upload(b.g);
        d.states[0] = upload(b.m);
        if (type != ElemType::kF32) {
          d.param = upload(low[k]);
          d.master = upload(b.p);
          device.push_back(d.master);
        } else {
          d.param = upload(b.p);
        }
        device.insert(device.end(), {d.param, const_cast<void*>(d.grad), d.states[0]});
        gpu.push_back(d);
      }
      std::vector<float> scalars = {4.0f, 0.0f, 1.0f};  // grad_scale, found_inf 0, found_inf 1
      float* dev_scalars = upload(scalars);
      for (int step = 0; step < 3; ++step) {
        lion_step_cpu(cpu.data(), cpu.size(), lion_scalars(h), 1.0f / 4.0f, &pool);
        ASSERT_EQ(lion_step_cuda(gpu.data(), gpu.size(), lion_scalars(h), dev_scalars,
                                 dev_scalars + 1, nullptr),
                  cudaSuccess);
      }
      std::int64_t* skipped = nullptr;
      ASSERT_EQ(cudaMallocManaged(reinterpret_cast<void**>(&skipped), sizeof(std::int64_t)),
                cudaSuccess);
      *skipped = 0;
      gpu[0].skipped = skipped;
      ASSERT_EQ(lion_step_cuda(gpu.data(), gpu.size(), lion_scalars(h), dev_scalars,
                               dev_scalars + 2, nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(*skipped, 1);
      cudaFree(skipped);
      for (std::size_t k = 0; k < host.size(); ++k) {
        const std::size_t n = host[k].p.size();
        if (type == ElemType::kF32) {
          EXPECT_TRUE(download<float>(gpu[k].param, n) == host[k].p) << k;
        } else {
          EXPECT_TRUE(download<std::uint16_t>(gpu[k].param, n) == low[k]) << k;
          EXPECT_EQ(std::memcmp(download<float>(gpu[k].master, n).data(), host[k].p.data(), n * 4),
                    0)
              << k;
        }
        EXPECT_EQ(std::memcmp(download<float>(gpu[k].states[0], n).data(), host[k].m.data(), n * 4),
                  0)
            << k;
      }
      for (void* d : device) cudaFree(d);
      cudaFree(dev_scalars);
    }
  }
}
#endif

}  // namespace
}  // namespace strata::optim
