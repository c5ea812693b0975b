// The overlapped step on a real GPU, with C1 of RELIABILITY.md: the copy streams are held up at
// random (host functions that sleep) while layers step during backward and their states stream
// around them; the result is bitwise the sequential step's, under every policy and parameter dtype,
// over steps where clipping triggers and steps where it does not, with a float16 step whose
// gradients hold inf, and with gradient accumulation. The same small training loop as
// overlap_test.cpp (which runs it on the simulated device), with CUDA kernels for forward and
// backward: each layer's gradients and their part of the norm are computed on the compute stream as
// its backward runs, the norm reduced in a fixed order so that both runs see the same bits
// (tests/optim/overlap_gpu_kernels.cu).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "optim/adam.h"
#include "optim/adam_math.h"
#include "policies/builtin.h"
#include "tests/optim/overlap_gpu_kernels.h"
#include "tests/optim/overlap_model.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::optim {
namespace {

using namespace overlap;  // NOLINT: the tests' shared model
using rt::DType;
using rt::RoleSet;
using rt::TensorHandle;

static_assert(gpu_loop::kSlots == kLayers * kTensorsPerLayer);
constexpr std::size_t kNumel = std::size_t{1} << 18;  // 1 MiB of float32 a tensor

int type_of(DType d) { return d == DType::kBFloat16 ? 1 : (d == DType::kFloat16 ? 2 : 0); }

// The device scalars of the loop, freed with it.
struct Scalars {
  float* act = nullptr;
  double* slots = nullptr;
  int* non_finite = nullptr;
  float* loss_scale = nullptr;
  float* grad_scale = nullptr;
  float* found_inf = nullptr;
  Scalars() {
    act = alloc<float>(1);
    slots = alloc<double>(gpu_loop::kSlots);
    non_finite = alloc<int>(1);
    loss_scale = alloc<float>(1);
    grad_scale = alloc<float>(1);
    found_inf = alloc<float>(1);
  }
  template <typename T>
  static T* alloc(std::size_t n) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
    return static_cast<T*>(p);
  }
  ~Scalars() {
    (void)cudaDeviceSynchronize();
    for (void* p :
         std::initializer_list<void*>{act, slots, non_finite, loss_scale, grad_scale, found_inf}) {
      (void)cudaFree(p);
    }
  }
};

// Where an overlapped layer's step runs: on the compute stream, or on a stream of its own with the
// runtime computing there for the call, joined before the step is validated, as bridge::ModelHooks
// does (See Note [The step stream] in bridge/model_hooks.cpp).
enum class StepStream { kCompute, kOwn };

// Trains `steps` steps on the GPU; with `overlapped`, each layer steps in backward. The copy
// streams (and the step's own stream) are held up at random (seeded by `seed`). Returns every
// tensor's bytes and each group's steps.
Bytes train(const Case& setup, bool overlapped, int steps, std::uint64_t seed, Outcomes* outcomes,
            StepStream step_stream = StepStream::kCompute) {
  rt::RuntimeOptions options;
  options.policy = setup.policy;
  options.policy_config = setup.config;
  options.policy_config.overlap = overlapped ? rt::Overlap::kBackward : rt::Overlap::kNone;
  options.device = rt::DeviceKind::kCuda;
  absl::StatusOr<std::unique_ptr<rt::Runtime>> created =
      rt::Runtime::create(std::move(options), policy::builtin_policies());
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return {};
  rt::Runtime& runtime = **created;
  std::unique_ptr<LoopModel> model = make_loop_model(runtime, setup);
  if (model == nullptr) return {};
  Adam& adam = *model->adam;
  const std::vector<Pairs>& of_layer = model->of_layer;
  std::map<std::uint64_t, void*>& addr = model->addr;
  const float max_norm = overlap::max_norm(setup);
  std::mt19937 rng(static_cast<std::uint32_t>(seed));
  // C1: each copy stream is held up for up to 1.5 ms, half the time, at every hook.
  auto delay = [&] {
    for (rt::StreamHandle s : {runtime.h2d_stream(), runtime.d2h_stream()}) {
      if (rng() % 2 == 0) continue;
      const int us = static_cast<int>(rng() % 1500);
      EXPECT_TRUE(
          runtime.device()
              .enqueue_host(s, [us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); })
              .ok());
    }
  };
  const auto stream = static_cast<cudaStream_t>(runtime.compute_stream());
  cudaStream_t own = nullptr;
  if (step_stream == StepStream::kOwn) {
    EXPECT_EQ(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking), cudaSuccess);
  }
  // One stream waits on the GPU for what is queued on another so far.
  auto wait_for = [](cudaStream_t waiter, cudaStream_t on) {
    cudaEvent_t ev = nullptr;
    EXPECT_EQ(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
    EXPECT_EQ(cudaEventRecord(ev, on), cudaSuccess);
    EXPECT_EQ(cudaStreamWaitEvent(waiter, ev, 0), cudaSuccess);
    EXPECT_EQ(cudaEventDestroy(ev), cudaSuccess);
  };
  Scalars dev;
  const bool scaled = setup.dtype == DType::kFloat16;
  const float ls = scaled ? 1024.0f : 1.0f;
  EXPECT_EQ(cudaMemcpy(dev.loss_scale, &ls, sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  auto ok = [](const absl::Status& st) {
    EXPECT_TRUE(st.ok()) << st;
    return st.ok();
  };

  for (int step = 1; step <= steps; ++step) {
    // Every fourth step's gradients are ten times larger: the clip triggers there only.
    const float boost = step % 4 == 0 ? 10.0f : 1.0f;
    for (int micro = 0; micro < setup.micro_batches; ++micro) {
      const bool last = micro + 1 == setup.micro_batches;
      if (!ok(runtime.begin_step())) return {};
      gpu_loop::reset_act(stream, dev.act);
      for (int l = 0; l < kLayers; ++l) {
        delay();
        if (!ok(runtime.before_forward(l))) return {};
        for (auto [p, g] : of_layer[static_cast<std::size_t>(l)]) {
          gpu_loop::forward(stream, addr[p.id], type_of(setup.dtype), kNumel, dev.act);
        }
      }
      if (last) gpu_loop::reset_norm(stream, dev.slots, dev.non_finite);
      for (int l = kLayers - 1; l >= 0; --l) {
        int t = 0;
        for (auto [p, g] : of_layer[static_cast<std::size_t>(l)]) {
          float* gp = static_cast<float*>(addr[g.id]);
          // Only loss scaling checks for inf; unscaled, an inf would make everything NaN.
          const bool inf = scaled && last && step == kInfStep && l == 1 && t == 0;
          gpu_loop::backward(stream, addr[p.id], type_of(setup.dtype), gp, kNumel, boost, l, micro,
                             ls, dev.act, inf);
          if (last) {
            gpu_loop::norm_part(stream, gp, kNumel, ls, dev.slots + l * kTensorsPerLayer + t,
                                dev.non_finite);
          }
          ++t;
        }
        EXPECT_EQ(cudaGetLastError(), cudaSuccess);
        delay();
        if (!ok(runtime.after_backward(l))) return {};
        if (overlapped && last && own == nullptr) {
          if (!ok(adam.step_layer(l, scaled ? dev.loss_scale : nullptr))) return {};
        } else if (overlapped && last) {
          wait_for(own, stream);
          if (rng() % 2 == 0) {  // the step's stream held up too
            const int us = static_cast<int>(rng() % 1500);
            EXPECT_TRUE(
                runtime.device()
                    .enqueue_host(
                        own, [us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); })
                    .ok());
          }
          runtime.set_compute_stream(own);
          const absl::Status stepped = adam.step_layer(l, scaled ? dev.loss_scale : nullptr);
          runtime.set_compute_stream(stream);
          if (!ok(stepped)) return {};
        }
      }
      if (!last) {
        if (!ok(runtime.end_step())) return {};
        continue;
      }
      if (own != nullptr) wait_for(stream, own);
      gpu_loop::scales(stream, dev.slots, max_norm, ls, dev.non_finite, dev.grad_scale,
                       dev.found_inf);
      for (int l : adam.overlapped_layers()) {
        const std::vector<int>& host = adam.host_layers();
        outcomes->host_in_backward += std::count(host.begin(), host.end(), l) > 0 ? 1 : 0;
      }
      absl::StatusOr<Adam::StepOutcome> outcome =
          adam.finish_step(dev.grad_scale, scaled ? dev.found_inf : nullptr);
      if (!ok(outcome.status())) return {};
      outcomes->count(*outcome);
      EXPECT_EQ(runtime.undo_tensors(), 0u);
      if (!ok(runtime.end_step())) return {};
    }
  }
  Bytes bytes = collect(runtime, adam, outcomes);
  if (own != nullptr) EXPECT_EQ(cudaStreamDestroy(own), cudaSuccess);
  return bytes;
}

// Every basic case trained 12 steps without and with the overlapped step: bitwise the same.
void expect_overlap_is_bitwise_the_sequential_step(StepStream step_stream) {
  constexpr int kSteps = 12;
  std::vector<Case> cases = basic_cases();
  for (Case& c : cases) c.numel = kNumel;
  for (const Case& setup : cases) {
    SCOPED_TRACE(describe(setup));
    Outcomes seq, ovl;
    const Bytes want = train(setup, /*overlap=*/false, kSteps, 1, &seq);
    const Bytes got = train(setup, /*overlap=*/true, kSteps, 2, &ovl, step_stream);
    expect_same(want, got, seq, ovl, kSteps);
  }
}

TEST(GpuOverlapTest, GpuOverlappedStepWithDelayedCopyStreamsIsBitwiseTheSequentialStep) {
  if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  expect_overlap_is_bitwise_the_sequential_step(StepStream::kCompute);
}

// The same with each layer's step on a stream of its own, held up at random as well: what backward
// needs next is still fenced on the compute stream, and the step's copies behind the step.
TEST(GpuOverlapTest, GpuOverlappedStepOnItsOwnStreamIsBitwiseTheSequentialStep) {
  if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  expect_overlap_is_bitwise_the_sequential_step(StepStream::kOwn);
}

// Exactness on the GPU (See Note [Bias corrections from the device] in optim/adam_kernels.h): a
// hybrid run, with the host kernel stepping some or all layers, sequential and overlapped (its host
// layers stepped during backward too), ends
// bitwise where layer_prefetch's all-GPU run does, in float32, bfloat16 and float16, over steps
// where clipping triggers and one whose gradients hold inf, with the copy streams held up at
// random; with Adam and with Lion (whose host kernel needs nothing from the device).
TEST(GpuOverlapTest, GpuHybridStepIsBitwiseTheLayerPrefetchStep) {
  if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  constexpr int kSteps = 8;
  for (Case setup : hybrid_cases()) {
    setup.numel = kNumel;
    SCOPED_TRACE(describe(setup));
    Outcomes ref, seq, ovl;
    const Bytes want =
        train(reference(setup), /*overlap=*/false, kSteps, 1, &ref, StepStream::kOwn);
    expect_same_tensors(want, train(setup, /*overlap=*/false, kSteps, 2, &seq, StepStream::kOwn));
    expect_same_tensors(want, train(setup, /*overlap=*/true, kSteps, 3, &ovl, StepStream::kOwn));
    // Overlapped, the host layers step during backward too (See Note [Host steps in backward] in
    // optim/adam_host_speculation.cpp), redone where clipping fired.
    if (setup.config.hybrid_fraction) {
      EXPECT_GT(ovl.host_in_backward, 0);
      EXPECT_GT(ovl.redone, 0);
    }
  }
}

// Lion (See Note [Step rules] in optim/step_rule.h) on the GPU: its overlapped step, on a stream
// of its own with the copy streams held up at random, is bitwise its sequential step (its hybrid
// cases are GpuHybridStepIsBitwiseTheLayerPrefetchStep's).
TEST(GpuOverlapTest, GpuLionOverlappedStepIsBitwiseItsSequentialStep) {
  if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  constexpr int kSteps = 8;
  for (Case setup : lion_cases()) {
    setup.numel = kNumel;
    SCOPED_TRACE(describe(setup));
    Outcomes seq, ovl;
    const Bytes want = train(setup, /*overlap=*/false, kSteps, 1, &seq, StepStream::kOwn);
    expect_same(want, train(setup, /*overlap=*/true, kSteps, 2, &ovl, StepStream::kOwn), seq, ovl,
                kSteps, 1);
  }
}

}  // namespace
}  // namespace strata::optim
