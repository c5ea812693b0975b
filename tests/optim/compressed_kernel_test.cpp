// Adam's kernels with compressed moments (See Note [Compressed moments] in optim/state_codec.h):
// the host kernel stepping parameters exactly as float32 moments of the decoded values would, the
// same bits for every thread split, a moment that should decay decaying; and the CUDA kernel (Gpu*,
// label gpu) bitwise the host kernel.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <vector>

#include "allocator/upstream.h"
#include "gtest/gtest.h"
#include "optim/adam_kernels.h"
#include "optim/state_codec.h"
#include "tests/optim/compressed_states_util.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::optim {
namespace {

using test_util::block_absmax;
using test_util::bound;
using test_util::stored_bytes;

// One tensor of each kind the kernel takes, with its buffers.
struct Host {
  std::int64_t n;
  ElemType param_type, grad_type;
  StateType state;
  std::vector<unsigned char> param, grad, m, v;
  std::vector<float> master;

  Host(std::int64_t numel, ElemType p, ElemType g, StateType s, std::uint64_t seed)
      : n(numel), param_type(p), grad_type(g), state(s) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> d(0.0f, 1.0f);
    param.resize(static_cast<std::size_t>(n) * elem_size(p));
    grad.resize(static_cast<std::size_t>(n) * elem_size(g));
    if (p != ElemType::kF32) master.resize(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      const float w = d(rng);
      store_elem(param.data(), p, i, w);
      if (!master.empty()) master[static_cast<std::size_t>(i)] = load_elem(param.data(), p, i);
    }
    std::vector<float> m0(static_cast<std::size_t>(n)), v0(m0.size());
    for (std::size_t i = 0; i < m0.size(); ++i) {
      m0[i] = d(rng) * 0.01f * (i % 97 == 0 ? 100.0f : 1.0f);
      v0[i] = std::abs(d(rng)) * 1e-4f;
    }
    m.resize(stored_bytes(s, n));
    v.resize(m.size());
    encode_moment(s, false, m0.data(), n, m.data());
    encode_moment(s, true, v0.data(), n, v.data());
  }
  void new_gradients(std::mt19937_64& rng) {
    std::normal_distribution<float> d(0.0f, 0.05f);
    for (std::int64_t i = 0; i < n; ++i) store_elem(grad.data(), grad_type, i, d(rng));
  }
  AdamTensor tensor(std::int64_t step) {
    AdamTensor t;
    t.param = param.data();
    t.grad = grad.data();
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.master = master.empty() ? nullptr : master.data();
    t.numel = n;
    t.param_type = param_type;
    t.grad_type = grad_type;
    t.state_type = state;
    t.seed = static_cast<std::uint32_t>(n * 2654435761u);
    t.step = step;
    return t;
  }
  std::vector<float> moment(bool square) const {
    std::vector<float> out(static_cast<std::size_t>(n));
    decode_moment(state, square, (square ? v : m).data(), n, out.data());
    return out;
  }
};

struct Pair {
  ElemType p, g;
};
constexpr Pair kPairs[] = {{ElemType::kF32, ElemType::kF32},
                           {ElemType::kBF16, ElemType::kBF16},
                           {ElemType::kBF16, ElemType::kF32},
                           {ElemType::kF16, ElemType::kF16},
                           {ElemType::kF16, ElemType::kF32}};

// The parameters step exactly as float32 moments holding the decoded values step them (the update
// takes the moments before they are rounded), and the new moments decode within one gap of the
// float32 step's.
TEST(CompressedStatesTest, ParametersStepAsWithTheDecodedMomentsInFloat32) {
  ThreadPool pool(2);
  const AdamHyper h{.lr = 1e-2, .weight_decay = 0.01};
  for (StateType type : {StateType::kBF16, StateType::kI8}) {
    for (const Pair& pair : kPairs) {
      for (std::int64_t n : {1, 200, 256, 1000, 70001}) {
        Host c(n, pair.p, pair.g, type, 3);
        std::mt19937_64 rng(9);
        for (int step = 1; step <= 3; ++step) {
          c.new_gradients(rng);
          // The float32 twin: the same parameter, gradient and decoded moments.
          Host f = c;
          f.state = StateType::kF32;
          const std::vector<float> m0 = c.moment(false), v0 = c.moment(true);
          f.m.assign(reinterpret_cast<const unsigned char*>(m0.data()),
                     reinterpret_cast<const unsigned char*>(m0.data() + m0.size()));
          f.v.assign(reinterpret_cast<const unsigned char*>(v0.data()),
                     reinterpret_cast<const unsigned char*>(v0.data() + v0.size()));
          AdamTensor tc = c.tensor(step), tf = f.tensor(step);
          const AdamScalars s = adam_scalars(h, step);
          adam_step_cpu(&tc, 1, s, 0.5f, &pool);
          adam_step_cpu(&tf, 1, s, 0.5f, &pool);
          ASSERT_EQ(c.param, f.param) << n;
          ASSERT_EQ(c.master, f.master) << n;
          for (bool square : {false, true}) {
            const std::vector<float> got = c.moment(square);
            std::vector<float> want(got.size());
            std::memcpy(want.data(), (square ? f.v : f.m).data(), want.size() * sizeof(float));
            for (std::size_t i = 0; i < got.size(); ++i) {
              ASSERT_LE(std::abs(got[i] - want[i]),
                        bound(type, square, want[i], block_absmax(want, i), true))
                  << "type " << static_cast<int>(type) << " n " << n << " i " << i;
            }
          }
        }
      }
    }
  }
}

TEST(CompressedStatesTest, ThreadSplitsGiveTheSameBits) {
  const AdamHyper h{.lr = 3e-3, .weight_decay = 0.1};
  for (StateType type : {StateType::kBF16, StateType::kI8}) {
    std::vector<std::vector<Host>> runs;
    for (int threads : {0, 1, 3}) {
      std::vector<Host> xs;
      for (std::int64_t n : {70001, 3, 65537, 130000, 255}) {
        xs.emplace_back(n, ElemType::kBF16, ElemType::kF32, type, n);
      }
      std::mt19937_64 rng(4);
      std::unique_ptr<ThreadPool> pool =
          threads > 0 ? std::make_unique<ThreadPool>(threads) : nullptr;
      for (int step = 1; step <= 2; ++step) {
        std::vector<AdamTensor> ts;
        for (Host& x : xs) {
          x.new_gradients(rng);
          ts.push_back(x.tensor(step));
        }
        adam_step_cpu(ts.data(), ts.size(), adam_scalars(h, step), 1.0f, pool.get());
      }
      runs.push_back(std::move(xs));
    }
    for (std::size_t r = 1; r < runs.size(); ++r) {
      for (std::size_t k = 0; k < runs[0].size(); ++k) {
        EXPECT_EQ(runs[r][k].m, runs[0][k].m) << r << " " << k;
        EXPECT_EQ(runs[r][k].v, runs[0][k].v) << r << " " << k;
        EXPECT_EQ(runs[r][k].master, runs[0][k].master) << r << " " << k;
      }
    }
  }
}

// exp_avg_sq at beta2 = 0.999 decays by 1e-3 a step without gradients: below half a gap of either
// encoding, so rounding to nearest would hold it where it is. Stochastically rounded, the moments
// of a block whose first element keeps a gradient (its absmax stays) decay as float32's do.
TEST(CompressedStatesTest, AMomentWithoutGradientsDecays) {
  constexpr std::int64_t kN = 8 * kStateBlock;
  constexpr int kSteps = 500;
  const AdamHyper h{.lr = 0.0};
  for (StateType type : {StateType::kBF16, StateType::kI8}) {
    Host x(kN, ElemType::kF32, ElemType::kF32, type, 1);
    std::vector<float> v0(kN, 0.25f), zero(kN, 0.0f);
    for (std::int64_t b = 0; b < kN; b += kStateBlock) v0[static_cast<std::size_t>(b)] = 1.0f;
    encode_moment(type, true, v0.data(), kN, x.v.data());
    encode_moment(type, false, zero.data(), kN, x.m.data());
    std::vector<float> g(kN, 0.0f);
    for (std::int64_t b = 0; b < kN; b += kStateBlock) g[static_cast<std::size_t>(b)] = 1.0f;
    std::memcpy(x.grad.data(), g.data(), g.size() * sizeof(float));
    for (int step = 1; step <= kSteps; ++step) {
      AdamTensor t = x.tensor(step);
      adam_step_cpu(&t, 1, adam_scalars(h, step), 1.0f, nullptr);
    }
    const std::vector<float> v = x.moment(true);
    double sum = 0;
    int count = 0;
    for (std::int64_t i = 0; i < kN; ++i) {
      if (i % kStateBlock == 0) continue;
      sum += v[static_cast<std::size_t>(i)];
      ++count;
    }
    const double want = 0.25 * std::pow(0.999, kSteps);
    EXPECT_NEAR(sum / count, want, 0.05 * want) << "type " << static_cast<int>(type);
  }
}

#ifdef STRATA_HAS_CUDA
class GpuCompressedStatesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  }
};

// A device copy of `bytes` from host, `offset` bytes into its allocation (kept in `allocations`).
void* upload(const void* host, std::size_t bytes, std::vector<void*>& allocations,
             std::size_t offset = 0) {
  void* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, std::max<std::size_t>(bytes, 1) + offset), cudaSuccess);
  allocations.push_back(d);
  void* at = static_cast<unsigned char*>(d) + offset;
  EXPECT_EQ(cudaMemcpy(at, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  return at;
}

void download(void* host, const void* d, std::size_t bytes) {
  EXPECT_EQ(cudaMemcpy(host, d, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

// The CUDA kernel's bits are the host kernel's, given the device's bias corrections (See Note
// [Bias corrections from the device] in optim/adam_kernels.h): parameters, masters, codes and
// scales, over tensors that cross the kernel's chunks and end in part blocks, with a loss scale
// and a step found_inf skips; every kind of tensor also with its parameter and gradient one
// element off the alignment that lets the kernel load four elements at once.
TEST_F(GpuCompressedStatesTest, GpuKernelIsBitwiseTheHostKernel) {
  ThreadPool pool(3);
  const AdamHyper h{.lr = 1e-2, .weight_decay = 0.05};
  for (StateType type : {StateType::kBF16, StateType::kI8}) {
    std::vector<Host> cpu;
    std::vector<bool> off;  // the parameter and gradient one element past their allocation's start
    for (bool shifted : {false, true}) {
      for (const Pair& pair : kPairs) {
        for (std::int64_t n : {1, 300, 70001, 131072 + 77}) {
          cpu.emplace_back(n, pair.p, pair.g, type, n);
          off.push_back(shifted);
        }
      }
    }
    std::vector<Host> gpu = cpu;
    std::vector<std::array<void*, 5>> dev(cpu.size());
    std::vector<void*> allocations;
    for (std::size_t k = 0; k < cpu.size(); ++k) {
      Host& x = gpu[k];
      dev[k] = {
          upload(x.param.data(), x.param.size(), allocations, off[k] ? elem_size(x.param_type) : 0),
          upload(x.grad.data(), x.grad.size(), allocations, off[k] ? elem_size(x.grad_type) : 0),
          upload(x.m.data(), x.m.size(), allocations), upload(x.v.data(), x.v.size(), allocations),
          x.master.empty() ? nullptr : upload(x.master.data(), x.master.size() * 4, allocations)};
    }
    float* scalars = nullptr;  // grad_scale, found_inf, then 2 floats of bias corrections a tensor
    ASSERT_EQ(
        cudaMallocHost(reinterpret_cast<void**>(&scalars), (2 + 2 * cpu.size()) * sizeof(float)),
        cudaSuccess);
    std::int64_t* skipped = nullptr;
    ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&skipped), cpu.size() * sizeof(std::int64_t)),
              cudaSuccess);
    std::fill(skipped, skipped + cpu.size(), 0);
    std::vector<std::int64_t> host_skipped(cpu.size(), 0);
    std::mt19937_64 rng(12);
    for (int step = 1; step <= 4; ++step) {
      const bool inf = step == 2;
      scalars[0] = 256.0f;
      scalars[1] = inf ? 1.0f : 0.0f;
      std::vector<AdamTensor> host, device;
      std::vector<BiasRequest> requests;
      for (std::size_t k = 0; k < cpu.size(); ++k) {
        cpu[k].new_gradients(rng);
        ASSERT_EQ(
            cudaMemcpy(dev[k][1], cpu[k].grad.data(), cpu[k].grad.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
        AdamTensor t = cpu[k].tensor(step);
        t.skipped = &host_skipped[k];
        host.push_back(t);
        AdamTensor d = t;
        d.param = dev[k][0];
        d.grad = dev[k][1];
        d.exp_avg = dev[k][2];
        d.exp_avg_sq = dev[k][3];
        d.master = static_cast<float*>(dev[k][4]);
        d.skipped = skipped + k;
        device.push_back(d);
        requests.push_back({adam_scalars(h, 1), step - host_skipped[k]});
      }
      const AdamScalars s = adam_scalars(h, step);
      ASSERT_EQ(adam_step_cuda(device.data(), device.size(), s, scalars, scalars + 1, nullptr),
                cudaSuccess);
      ASSERT_EQ(adam_bias_corrections_cuda(requests.data(), static_cast<int>(requests.size()),
                                           scalars + 2, nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      if (inf) {
        // A skipped step counts, as StepRule::count_skipped_host does it.
        for (AdamTensor& t : host) {
          if (t.skipped != nullptr) ++*t.skipped;
        }
        continue;
      }
      for (std::size_t k = 0; k < host.size(); ++k) host[k].bias = scalars + 2 + 2 * k;
      adam_step_cpu(host.data(), host.size(), s, 1.0f / scalars[0], &pool);
    }
    for (std::size_t k = 0; k < cpu.size(); ++k) {
      const Host& want = cpu[k];
      Host got = want;
      download(got.param.data(), dev[k][0], got.param.size());
      download(got.m.data(), dev[k][2], got.m.size());
      download(got.v.data(), dev[k][3], got.v.size());
      if (!got.master.empty()) download(got.master.data(), dev[k][4], got.master.size() * 4);
      EXPECT_EQ(got.param, want.param) << "type " << static_cast<int>(type) << " tensor " << k;
      EXPECT_EQ(got.master, want.master) << "type " << static_cast<int>(type) << " tensor " << k;
      EXPECT_EQ(got.m, want.m) << "type " << static_cast<int>(type) << " tensor " << k;
      EXPECT_EQ(got.v, want.v) << "type " << static_cast<int>(type) << " tensor " << k;
      EXPECT_EQ(skipped[k], 1);
    }
    for (void* p : allocations) cudaFree(p);
    cudaFreeHost(scalars);
    cudaFreeHost(skipped);
  }
}
#endif

}  // namespace
}  // namespace strata::optim
