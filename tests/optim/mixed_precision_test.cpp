// Mixed precision (See Note [Mixed precision] in optim/adam_math.h): the conversions round to
// nearest even as the compiler's _Float16 and a float64 reference of bfloat16 do; the kernel steps
// a bfloat16 or float16 parameter through its float32 master copy exactly as float32 math on the
// master gives, for every parameter and gradient dtype pair, near a float64 reference; the CUDA
// kernel (Gpu*, label gpu) agrees with the CPU kernel within float32 rounding (it fuses
// multiply-adds) and rounds its masters exactly alike; and Adam in bfloat16 trains bitwise the same
// under keep_on_gpu, bulk and layer_prefetch with every role streamed, its checkpoint carrying the
// master copies.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <vector>

#include "allocator/upstream.h"
#include "gtest/gtest.h"
#include "optim/adam.h"
#include "optim/adam_kernels.h"
#include "tests/runtime/runtime_test_util.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::optim {
namespace {

// The bfloat16 nearest to f, ties to even, chosen in float64 between the two candidates.
std::uint16_t bf16_reference(float f) {
  if (std::isnan(f)) return 0x7fc0;
  const std::uint32_t u = float_bits(f);
  const std::uint32_t lo = u & 0xffff0000u;
  const std::uint32_t hi = lo + 0x10000u;
  // Past the largest finite bfloat16 lies infinity, at the distance 2^128 would be.
  auto value = [](std::uint32_t bits) {
    const float v = bits_float(bits);
    return std::isinf(v) ? std::copysign(std::ldexp(1.0, 128), v) : static_cast<double>(v);
  };
  if (std::isinf(f)) return static_cast<std::uint16_t>(u >> 16);
  const double dl = std::fabs(value(lo) - f);
  const double dh = std::fabs(value(hi) - f);
  if (dl < dh || (dl == dh && ((lo >> 16) & 1u) == 0)) return static_cast<std::uint16_t>(lo >> 16);
  return static_cast<std::uint16_t>(hi >> 16);
}

std::uint16_t f16_reference(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  std::uint16_t out;
  std::memcpy(&out, &h, sizeof(out));
  if (std::isnan(f)) out = static_cast<std::uint16_t>((out & 0x8000u) | 0x7e00u);
  return out;
}

TEST(MixedPrecisionTest, ConversionsRoundToNearestEven) {
  // Every 997th float pattern (all exponents, signs and NaN payloads), and the edges.
  std::vector<std::uint32_t> patterns = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u,
                                         0x477fe000u, 0x477fefffu, 0x477ff000u, 0x33000000u,
                                         0x33000001u, 0x387fc000u, 0x38800000u, 0x3f808000u,
                                         0x3f818000u, 0x7f7fffffu, 0x00000001u};
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 997)
    patterns.push_back(static_cast<std::uint32_t>(u));
  std::size_t bad_bf16 = 0, bad_f16 = 0, bad_back = 0;
  for (std::uint32_t u : patterns) {
    const float f = bits_float(u);
    const std::uint16_t b = float_to_bf16(f), h = float_to_f16(f);
    bad_bf16 += b != bf16_reference(f);
    bad_f16 += h != f16_reference(f);
    // Back to float: exact, as the compiler's conversion.
    _Float16 hh;
    std::memcpy(&hh, &h, sizeof(hh));
    const float back = f16_to_float(h);
    bad_back += !(std::isnan(back) ? std::isnan(static_cast<float>(hh))
                                   : float_bits(back) == float_bits(static_cast<float>(hh)));
    bad_back += float_bits(bf16_to_float(b)) != (std::uint32_t{b} << 16);
  }
  EXPECT_EQ(bad_bf16, 0u);
  EXPECT_EQ(bad_f16, 0u);
  EXPECT_EQ(bad_back, 0u);
}

struct Case {
  ElemType param, grad;
};
const Case kCases[] = {{ElemType::kF32, ElemType::kF32},
                       {ElemType::kBF16, ElemType::kBF16},
                       {ElemType::kBF16, ElemType::kF32},
                       {ElemType::kF16, ElemType::kF16},
                       {ElemType::kF16, ElemType::kF32}};

// A tensor of one dtype pair, with its float32 master (or float32 parameter) and a float64 mirror.
struct Mixed {
  std::vector<std::uint16_t> p16, g16;
  std::vector<float> p32, g32, master, m, v;
  std::vector<double> rp, rm, rv;  // the float64 reference
  Case c;
  std::int64_t n;

  Mixed(Case c_, std::int64_t n_, std::uint64_t seed) : c(c_), n(n_) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (std::int64_t i = 0; i < n; ++i) {
      const float p = d(rng);
      p32.push_back(p);
      p16.push_back(c.param == ElemType::kBF16 ? float_to_bf16(p) : float_to_f16(p));
      // The master starts as the low-precision parameter's value, exactly.
      master.push_back(c.param == ElemType::kF32 ? p : load_elem(p16.data(), c.param, i));
      rp.push_back(master.back());
      m.push_back(0);
      v.push_back(0);
      rm.push_back(0);
      rv.push_back(0);
    }
    g32.resize(n);
    g16.resize(n);
  }
  void new_gradients(std::mt19937_64& rng) {
    std::normal_distribution<float> d(0.0f, 0.05f);
    for (std::int64_t i = 0; i < n; ++i) {
      g32[i] = d(rng);
      g16[i] = c.grad == ElemType::kBF16 ? float_to_bf16(g32[i]) : float_to_f16(g32[i]);
    }
  }
  AdamTensor tensor() {
    AdamTensor t;
    t.param = c.param == ElemType::kF32 ? static_cast<void*>(p32.data()) : p16.data();
    t.grad = c.grad == ElemType::kF32 ? static_cast<const void*>(g32.data()) : g16.data();
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.master = c.param == ElemType::kF32 ? nullptr : master.data();
    t.param_type = c.param;
    t.grad_type = c.grad;
    t.numel = n;
    return t;
  }
  float grad(std::int64_t i) const {
    return c.grad == ElemType::kF32 ? g32[i] : load_elem(g16.data(), c.grad, i);
  }
  float param(std::int64_t i) const {
    return c.param == ElemType::kF32 ? p32[i] : load_elem(p16.data(), c.param, i);
  }
};

TEST(MixedPrecisionTest, EveryDtypePairStepsTheMasterInFloat32NearAFloat64Reference) {
  ThreadPool pool(2);
  const AdamHyper h{.lr = 1e-2f, .weight_decay = 0.01f, .decoupled = true};
  std::mt19937_64 rng(20261124);
  for (const Case& c : kCases) {
    Mixed x(c, 1003, 7);
    // What float32 math on the master gives, element by element: the kernel must equal it.
    std::vector<float> fp = x.master, fm = x.m, fv = x.v;
    for (int step = 1; step <= 20; ++step) {
      x.new_gradients(rng);
      const AdamScalars s = adam_scalars(h, step);
      for (std::int64_t i = 0; i < x.n; ++i) {
        adam_element(fp[i], x.grad(i), fm[i], fv[i], nullptr, s, 1.0f);
        double vmax = 0;
        // The float64 reference of torch's math, fed the same gradients, with the
        // hyperparameters and bias corrections rounded to float32 as the kernel (and torch's
        // CUDA kernel) takes them.
        const double g = x.grad(i);
        double& p = x.rp[i];
        const double lr = static_cast<float>(h.lr), wd = static_cast<float>(h.weight_decay);
        const double b1 = static_cast<float>(h.beta1), b2 = static_cast<float>(h.beta2);
        p *= 1.0 - lr * wd;
        x.rm[i] = b1 * x.rm[i] + (1.0 - b1) * g;
        x.rv[i] = b2 * x.rv[i] + (1.0 - b2) * g * g;
        const double bc1 = 1.0f - powf(static_cast<float>(b1), static_cast<float>(step));
        const double bc2 = 1.0f - powf(static_cast<float>(b2), static_cast<float>(step));
        p -= (lr / bc1) * x.rm[i] /
             (std::sqrt(x.rv[i]) / std::sqrt(bc2) + static_cast<double>(static_cast<float>(h.eps)));
        (void)vmax;
      }
      AdamTensor t = x.tensor();
      t.step = step;
      adam_step_cpu(&t, 1, s, 1.0f, &pool);
    }
    const bool low = c.param != ElemType::kF32;
    double worst = 0;
    for (std::int64_t i = 0; i < x.n; ++i) {
      const float master = low ? x.master[i] : x.p32[i];
      ASSERT_EQ(float_bits(master), float_bits(fp[i])) << "element " << i;
      // The parameter is its master rounded to nearest even.
      if (low) {
        const std::uint16_t want =
            c.param == ElemType::kBF16 ? bf16_reference(master) : f16_reference(master);
        ASSERT_EQ(x.p16[i], want) << "element " << i;
      }
      worst = std::max(worst, std::fabs(master - x.rp[i]) / std::max(1e-3, std::fabs(x.rp[i])));
    }
    EXPECT_LT(worst, 2e-5) << "param " << static_cast<int>(c.param) << " grad "
                           << static_cast<int>(c.grad);
  }
}

// Adam in bfloat16 with every role streamed: the same bits under every policy, and a checkpoint
// that restores the master copies exactly.
TEST(MixedPrecisionTest, Bf16AdamTrainsBitwiseTheSameUnderEveryPolicy) {
  constexpr int kLayers = 3;
  constexpr std::size_t kNumel = 4096;
  using rt::DType;
  using rt::Role;
  std::map<std::string, std::vector<unsigned char>> want;
  for (const char* policy : {"keep_on_gpu", "bulk", "layer_prefetch"}) {
    SCOPED_TRACE(policy);
    rt::PolicyConfig config{.prefetch_depth = 1, .roles = rt::RoleSet::all()};
    if (std::string(policy) == "bulk") config.offload_after_step = true;
    rt::testing::Made made = rt::testing::make_runtime(policy, config, /*deferred=*/true);
    rt::Runtime& runtime = *made.rt;
    AdamOptions o;
    o.groups.resize(1);
    o.groups[0].hyper = {.lr = 1e-2f, .weight_decay = 0.01f};
    std::vector<rt::TensorHandle> grads;
    for (int l = 0; l < kLayers; ++l) {
      std::vector<std::uint16_t> w(kNumel);
      for (std::size_t i = 0; i < kNumel; ++i) {
        w[i] = float_to_bf16(0.01f * static_cast<float>((i * 13 + l) % 101) - 0.5f);
      }
      auto p = runtime.register_tensor(
          rt::testing::spec(str_cat("l", l, ".w"), l, Role::kParameter, kNumel, DType::kBFloat16),
          w.data());
      auto g = runtime.register_tensor(
          rt::testing::spec(str_cat("l", l, ".g"), l, Role::kGradient, kNumel, DType::kBFloat16));
      ASSERT_TRUE(p.ok() && g.ok());
      o.groups[0].params.push_back({*p, *g});
      grads.push_back(*g);
    }
    absl::StatusOr<std::unique_ptr<Adam>> adam = Adam::create(runtime, o);
    ASSERT_TRUE(adam.ok()) << adam.status();
    std::vector<std::uint16_t> g(kNumel);
    for (int step = 1; step <= 5; ++step) {
      for (int l = 0; l < kLayers; ++l) {
        for (std::size_t i = 0; i < kNumel; ++i) {
          g[i] = float_to_bf16(0.003f * static_cast<float>((i + step * 7 + l) % 29) - 0.04f);
        }
        ASSERT_TRUE(runtime.write(grads[l], g.data()).ok());
      }
      ASSERT_TRUE(runtime.begin_step().ok());
      for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(runtime.before_forward(l).ok());
      for (int l = kLayers - 1; l >= 0; --l) ASSERT_TRUE(runtime.after_backward(l).ok());
      ASSERT_TRUE((*adam)->step().ok());
      ASSERT_TRUE(runtime.end_step().ok());
    }
    ASSERT_TRUE(runtime.wait_all().ok());
    std::map<std::string, std::vector<unsigned char>> got;
    for (rt::TensorHandle h : runtime.tensors()) {
      got[runtime.info(h)->spec.name] = rt::testing::read_all(runtime, h);
    }
    ASSERT_EQ(got.count("l1.w.master"), 1u);
    if (want.empty()) {
      want = got;
    } else {
      EXPECT_EQ(got, want);
    }
    // The checkpoint carries the master copies: zero them, load, and they are back exactly.
    std::stringstream file;
    ASSERT_TRUE((*adam)->save(file).ok());
    const rt::TensorHandle master = *runtime.find("l1.w.master");
    const std::vector<unsigned char> zeros(kNumel * sizeof(float));
    ASSERT_TRUE(runtime.write(master, zeros.data()).ok());
    ASSERT_TRUE((*adam)->load(file).ok());
    EXPECT_EQ(rt::testing::read_all(runtime, master), got["l1.w.master"]);
  }
}

// A float16 run whose third step found inf/NaN gradients ends bitwise where a run without that step
// ends, parameters, masters, moments and step counters alike, as torch's GradScaler with a fused
// AdamW leaves them; and the skipped step is not counted, in the checkpoint either
// (See Note [Skipped steps] in optim/adam_kernels.h). On the simulated device, and (Gpu*) on the
// GPU, where the flag and the scale are device memory and the count is kept where the kernels run.
using Bytes = std::map<std::string, std::vector<unsigned char>>;
Bytes skip_run(bool cuda, bool with_skipped_step, std::int64_t* count, std::string* checkpoint) {
  constexpr std::size_t kNumel = 3000;
  using rt::DType;
  using rt::Role;
  std::unique_ptr<rt::Runtime> owned;
  rt::testing::Made made;
  if (cuda) {
    rt::RuntimeOptions options;
    options.device = rt::DeviceKind::kCuda;
    options.policy = "layer_prefetch";
    options.policy_config = {.prefetch_depth = 1, .roles = rt::RoleSet::all()};
    owned = *rt::Runtime::create(std::move(options), policy::builtin_policies());
  } else {
    made = rt::testing::make_runtime(
        "layer_prefetch", {.prefetch_depth = 1, .roles = rt::RoleSet::all()}, /*deferred=*/true);
  }
  rt::Runtime& runtime = cuda ? *owned : *made.rt;
  std::vector<std::uint16_t> w(kNumel);
  for (std::size_t i = 0; i < kNumel; ++i) w[i] = float_to_f16(0.001f * (i % 89) - 0.04f);
  auto p = runtime.register_tensor(
      rt::testing::spec("w", 0, Role::kParameter, kNumel, DType::kFloat16), w.data());
  auto g = runtime.register_tensor(
      rt::testing::spec("w.grad", 0, Role::kGradient, kNumel, DType::kFloat16));
  AdamOptions o;
  o.groups.push_back({.params = {{*p, *g}}, .hyper = {.lr = 1e-2f, .weight_decay = 0.1f}});
  auto adam = Adam::create(runtime, o);
  EXPECT_TRUE(adam.ok()) << adam.status();
  // {scale, found_inf}, where the kernels read them.
  float flags_host[2] = {1024.0f, 0.0f};
  float* flags = flags_host;
#ifdef STRATA_HAS_CUDA
  void* device_flags = nullptr;
  if (cuda) {
    EXPECT_EQ(cudaMalloc(&device_flags, sizeof(flags_host)), cudaSuccess);
    flags = static_cast<float*>(device_flags);
  }
#endif
  std::vector<std::uint16_t> grad(kNumel);
  for (int step = 1; step <= 6; ++step) {
    const bool skip = step == 3;
    if (skip && !with_skipped_step) continue;
    for (std::size_t i = 0; i < kNumel; ++i) {
      // Scaled gradients; the skipped step's hold an inf.
      grad[i] = float_to_f16(skip && i == 7 ? INFINITY : 1024.0f * 1e-4f * ((i + step) % 17));
    }
    flags_host[1] = skip ? 1.0f : 0.0f;
#ifdef STRATA_HAS_CUDA
    if (cuda) {
      EXPECT_EQ(cudaMemcpy(flags, flags_host, sizeof(flags_host), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
#endif
    EXPECT_TRUE(runtime.write(*g, grad.data()).ok());
    EXPECT_TRUE((*adam)->step(flags, flags + 1).ok());
    EXPECT_TRUE(runtime.wait_all().ok());
    EXPECT_TRUE(runtime.device().stream_synchronize(runtime.compute_stream()).ok());
  }
  *count = (*adam)->step_count(0);
  std::stringstream file;
  EXPECT_TRUE((*adam)->save(file).ok());
  *checkpoint = file.str();
  Bytes out;
  for (rt::TensorHandle h : runtime.tensors()) {
    out[runtime.info(h)->spec.name] = rt::testing::read_all(runtime, h);
  }
  out.erase("w.grad");
  adam->reset();
#ifdef STRATA_HAS_CUDA
  if (device_flags != nullptr) cudaFree(device_flags);
#endif
  return out;
}

void expect_skipped_step_changes_nothing(bool cuda) {
  std::int64_t skipped_count = 0, plain_count = 0;
  std::string skipped_file, plain_file;
  const Bytes skipped = skip_run(cuda, true, &skipped_count, &skipped_file);
  const Bytes plain = skip_run(cuda, false, &plain_count, &plain_file);
  EXPECT_EQ(skipped, plain);
  EXPECT_EQ(skipped_count, 5);
  EXPECT_EQ(plain_count, 5);
  EXPECT_EQ(skipped_file, plain_file);
}

TEST(MixedPrecisionTest, AStepFoundInfSkippedChangesNothingAndDoesNotCount) {
  expect_skipped_step_changes_nothing(/*cuda=*/false);
}

#ifdef STRATA_HAS_CUDA
class GpuMixedPrecisionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  }
};

template <typename T>
T* upload(const std::vector<T>& host) {
  void* raw = nullptr;
  EXPECT_EQ(cudaMalloc(&raw, host.size() * sizeof(T) + 16), cudaSuccess);
  T* d = static_cast<T*>(raw);
  EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return d;
}
template <typename T>
std::vector<T> download(const T* d, std::size_t n) {
  std::vector<T> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

TEST_F(GpuMixedPrecisionTest, GpuAStepFoundInfSkippedChangesNothingAndDoesNotCount) {
  expect_skipped_step_changes_nothing(/*cuda=*/true);
}

TEST_F(GpuMixedPrecisionTest, GpuAgreesWithTheCpuKernelAndRoundsAlikeForEveryDtypePair) {
  ThreadPool pool(2);
  const AdamHyper h{.lr = 1e-2f, .weight_decay = 0.01f, .decoupled = true};
  std::mt19937_64 rng(11);
  std::vector<Mixed> cpu;
  for (const Case& c : kCases) cpu.emplace_back(c, 70001, 3);  // odd: a tail in every chunk walk
  std::vector<Mixed> gpu = cpu;
  std::vector<AdamTensor> device(cpu.size());
  std::vector<void*> owned;
  for (int step = 1; step <= 3; ++step) {
    std::vector<AdamTensor> host;
    for (std::size_t k = 0; k < cpu.size(); ++k) {
      cpu[k].new_gradients(rng);
      host.push_back(cpu[k].tensor());
    }
    // The same gradients and starting state on the GPU.
    for (std::size_t k = 0; k < cpu.size(); ++k) {
      Mixed& x = cpu[k];
      AdamTensor t = host[k];
      if (step == 1) {
        t.param = x.c.param == ElemType::kF32 ? static_cast<void*>(upload(x.p32))
                                              : static_cast<void*>(upload(x.p16));
        t.exp_avg = upload(x.m);
        t.exp_avg_sq = upload(x.v);
        t.master = x.c.param == ElemType::kF32 ? nullptr : upload(x.master);
        for (void* p : {t.param, static_cast<void*>(t.exp_avg), static_cast<void*>(t.exp_avg_sq),
                        static_cast<void*>(t.master)}) {
          if (p != nullptr) owned.push_back(p);
        }
      } else {
        t = device[k];
      }
      t.grad = x.c.grad == ElemType::kF32 ? static_cast<const void*>(upload(x.g32))
                                          : static_cast<const void*>(upload(x.g16));
      owned.push_back(const_cast<void*>(t.grad));
      device[k] = t;
    }
    const AdamScalars s = adam_scalars(h, step);
    for (AdamTensor& t : host) t.step = step;
    for (AdamTensor& t : device) t.step = step;
    adam_step_cpu(host.data(), host.size(), s, 1.0f, &pool);
    ASSERT_EQ(adam_step_cuda(device.data(), device.size(), s, nullptr, nullptr, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  // The GPU fuses multiply-adds (as torch's fused kernels do) and the CPU does not, so the two
  // agree within float32 rounding; each rounds its own master to the parameter exactly alike.
  auto near = [](const std::vector<float>& gpu, const std::vector<float>& cpu) {
    double worst = 0;
    for (std::size_t i = 0; i < gpu.size(); ++i) {
      worst = std::max(
          worst, std::abs(static_cast<double>(gpu[i]) - cpu[i]) / (1e-7 + 1e-5 * std::abs(cpu[i])));
    }
    return worst;
  };
  for (std::size_t k = 0; k < cpu.size(); ++k) {
    const Mixed& x = cpu[k];
    const AdamTensor& t = device[k];
    const auto n = static_cast<std::size_t>(x.n);
    if (x.c.param == ElemType::kF32) {
      EXPECT_LE(near(download(static_cast<const float*>(t.param), n), x.p32), 1.0) << k;
    } else {
      const std::vector<float> master = download(t.master, n);
      EXPECT_LE(near(master, x.master), 1.0) << k;
      const std::vector<std::uint16_t> p16 =
          download(static_cast<const std::uint16_t*>(t.param), n);
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint16_t want =
            x.c.param == ElemType::kBF16 ? bf16_reference(master[i]) : f16_reference(master[i]);
        ASSERT_EQ(p16[i], want) << k << " element " << i;
      }
    }
    EXPECT_LE(near(download(static_cast<const float*>(t.exp_avg), n), x.m), 1.0) << k;
    EXPECT_LE(near(download(static_cast<const float*>(t.exp_avg_sq), n), x.v), 1.0) << k;
  }
  for (void* p : owned) cudaFree(p);
}
#endif

}  // namespace
}  // namespace strata::optim
