// strata's Adam through the runtime, on the simulated device: against LibTorch's torch::optim::Adam
// and AdamW over 100 steps with several parameter groups (rtol 1e-5, atol 1e-6; the largest
// differences are printed), D2 of RELIABILITY.md (bitwise equal parameters and moments under
// keep_on_gpu, bulk offloading every step and layer_prefetch, exact step counters), per-parameter
// steps, and the bad inputs Adam rejects before anything runs. Checkpoints (D3) are in
// adam_checkpoint_test.cpp.
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "allocator/upstream.h"
#include "base/status.h"
#include "base/units.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "tests/optim/adam_test_model.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::optim {
namespace {

using namespace adam_testing;  // NOLINT(build/namespaces): the shared model

class AgainstTorchTest : public ::testing::TestWithParam<std::pair<bool, bool>> {};

TEST_P(AgainstTorchTest, HundredStepsWithTwoGroups) {
  const auto [decoupled, amsgrad] = GetParam();
  const auto init = initial_values();
  auto [runtime, dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1});
  Model m = register_model(*runtime, init);
  auto adam = Adam::create(*runtime, options_for(m, decoupled, amsgrad));
  ASSERT_TRUE(adam.ok()) << adam.status();

  std::vector<torch::Tensor> tp;
  for (int l = 0; l < kLayers; ++l) {
    tp.push_back(
        torch::from_blob(const_cast<float*>(init[l].data()), {static_cast<long>(kNumel[l])})
            .clone()
            .requires_grad_(true));
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  const AdamOptions o = options_for(m, decoupled, amsgrad);
  for (int g = 0; g < 2; ++g) {
    const AdamHyper& h = o.groups[g].hyper;
    std::vector<torch::Tensor> ps = {tp[2 * g], tp[2 * g + 1]};
    if (decoupled) {
      groups.emplace_back(
          ps, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(h.lr)
                                                               .betas({h.beta1, h.beta2})
                                                               .eps(h.eps)
                                                               .weight_decay(h.weight_decay)
                                                               .amsgrad(h.amsgrad)));
    } else {
      groups.emplace_back(
          ps, std::make_unique<torch::optim::AdamOptions>(torch::optim::AdamOptions(h.lr)
                                                              .betas({h.beta1, h.beta2})
                                                              .eps(h.eps)
                                                              .weight_decay(h.weight_decay)
                                                              .amsgrad(h.amsgrad)));
    }
  }
  std::unique_ptr<torch::optim::Optimizer> ref;
  if (decoupled) {
    ref = std::make_unique<torch::optim::AdamW>(std::move(groups));
  } else {
    ref = std::make_unique<torch::optim::Adam>(std::move(groups));
  }
  constexpr int kSteps = 100;
  for (int step = 1; step <= kSteps; ++step) {
    for (int l = 0; l < kLayers; ++l) {
      std::vector<float> g = gradient(l, step);
      tp[l].mutable_grad() = torch::from_blob(g.data(), {static_cast<long>(kNumel[l])}).clone();
    }
    ref->step();
  }
  run_steps(*runtime, **adam, m, kSteps);
  EXPECT_EQ((*adam)->step_count(0), kSteps);
  EXPECT_EQ((*adam)->step_count(1), kSteps);
  double worst_abs = 0, worst_rel = 0;
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> got = as_floats(*runtime, m.params[l]);
    torch::Tensor want = tp[l].detach();
    for (std::size_t i = 0; i < kNumel[l]; ++i) {
      const double w = want[i].item<float>();
      const double diff = std::abs(got[i] - w);
      worst_abs = std::max(worst_abs, diff);
      worst_rel = std::max(worst_rel, diff / (std::abs(w) + 1e-12));
      ASSERT_LE(diff, 1e-6 + 1e-5 * std::abs(w)) << "layer " << l << " element " << i;
    }
    // Moments too.
    auto& st = ref->state().at(tp[l].unsafeGetTensorImpl());
    torch::Tensor exp_avg = decoupled ? static_cast<torch::optim::AdamWParamState&>(*st).exp_avg()
                                      : static_cast<torch::optim::AdamParamState&>(*st).exp_avg();
    std::vector<float> m1 = as_floats(*runtime, (*(*adam)->state(m.params[l]))[0]);
    for (std::size_t i = 0; i < kNumel[l]; ++i) {
      const double w = exp_avg[i].item<float>();
      ASSERT_LE(std::abs(m1[i] - w), 1e-6 + 1e-5 * std::abs(w)) << "exp_avg layer " << l;
    }
  }
  std::printf("vs torch::optim::%s%s, %d steps: largest |diff| %.3g, largest relative %.3g\n",
              decoupled ? "AdamW" : "Adam", amsgrad ? " (amsgrad)" : "", kSteps, worst_abs,
              worst_rel);
}

INSTANTIATE_TEST_SUITE_P(AdamAndAdamW, AgainstTorchTest,
                         ::testing::Values(std::make_pair(true, false),
                                           std::make_pair(false, false),
                                           std::make_pair(true, true)));

TEST(D2Test, BitwiseEqualUnderEveryPolicy) {
  const auto init = initial_values();
  std::map<std::string, std::vector<unsigned char>> want;
  struct Run {
    std::string policy;
    rt::PolicyConfig config;
  };
  const std::vector<Run> runs = {
      {"keep_on_gpu", {}},
      {"bulk", {.roles = RoleSet::optimizer_states(), .offload_after_step = true}},
      {"bulk", {.roles = RoleSet::all(), .offload_after_step = true}},
      {"layer_prefetch", {.prefetch_depth = 0}},
      {"layer_prefetch", {.prefetch_depth = 2}},
      {"layer_prefetch", {.prefetch_depth = 1, .roles = RoleSet::all()}},
  };
  for (const Run& r : runs) {
    auto [runtime, dev] = make_runtime(r.policy, r.config);
    Model m = register_model(*runtime, init);
    auto adam = Adam::create(*runtime, options_for(m, true, false));
    ASSERT_TRUE(adam.ok()) << adam.status();
    run_steps(*runtime, **adam, m, 200);
    EXPECT_EQ((*adam)->step_count(0), 200);
    std::map<std::string, std::vector<unsigned char>> got;
    for (TensorHandle h : runtime->tensors())
      got[runtime->info(h)->spec.name] = read_all(*runtime, h);
    if (want.empty()) {
      want = got;
      continue;
    }
    for (const auto& [name, bytes] : want) {
      EXPECT_EQ(got.at(name), bytes)
          << name << " under " << r.policy << " differs from keep_on_gpu";
    }
  }
}

// Layers of parameters of different sizes: layer_prefetch stages the first layer smallest first and
// the last smallest last (See Note [Staging order]), and Adam steps a staged layer in the order its
// moments arrive; results stay bitwise equal to keep_on_gpu, also with the copies deferred.
TEST(D2Test, LayersOfMixedSizesSteppedInArrivalOrderAreBitwiseEqual) {
  constexpr int kMixedLayers = 3;
  const std::size_t sizes[] = {300, 5000, 0, 1000};  // one empty parameter: nothing to stage
  auto run = [&](const std::string& policy, rt::PolicyConfig config, bool deferred,
                 std::map<std::string, std::vector<unsigned char>>* out) -> absl::Status {
    auto [runtime, dev] = make_runtime(policy, config, deferred);
    AdamOptions o;
    o.groups.resize(2);
    o.groups[0].hyper = {.lr = 1e-2f, .weight_decay = 0.01f};
    o.groups[1].hyper = {.lr = 3e-3f, .beta1 = 0.8f};
    std::vector<std::pair<TensorHandle, TensorHandle>> all;
    for (int l = 0; l < kMixedLayers; ++l) {
      for (std::size_t k = 0; k < std::size(sizes); ++k) {
        std::vector<float> init(sizes[k]);
        for (std::size_t i = 0; i < sizes[k]; ++i) init[i] = std::sin(0.01f * i + l + k);
        STRATA_ASSIGN_OR_RETURN(
            TensorHandle p,
            runtime->register_tensor(spec(str_cat("l", l, ".p", k), l, Role::kParameter, sizes[k]),
                                     init.data()));
        STRATA_ASSIGN_OR_RETURN(TensorHandle g,
                                runtime->register_tensor(spec(str_cat("l", l, ".p", k, ".grad"), l,
                                                              Role::kGradient, sizes[k])));
        o.groups[k % 2].params.push_back({p, g});
        all.push_back({p, g});
      }
    }
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Adam> adam, Adam::create(*runtime, o));
    for (int step = 1; step <= 20; ++step) {
      for (std::size_t j = 0; j < all.size(); ++j) {
        const std::size_t n = runtime->info(all[j].second)->bytes / sizeof(float);
        std::vector<float> g(n);
        for (std::size_t i = 0; i < n; ++i) g[i] = 0.1f * std::cos(0.03f * i * step + j);
        STRATA_RETURN_IF_ERROR(runtime->write(all[j].second, g.data()));
      }
      STRATA_RETURN_IF_ERROR(runtime->begin_step());
      STRATA_RETURN_IF_ERROR(adam->step());
      STRATA_RETURN_IF_ERROR(runtime->end_step());
    }
    for (TensorHandle h : runtime->tensors()) {
      (*out)[runtime->info(h)->spec.name] = read_all(*runtime, h);
    }
    return absl::OkStatus();
  };
  std::map<std::string, std::vector<unsigned char>> want;
  ASSERT_TRUE(run("keep_on_gpu", {}, false, &want).ok());
  for (int depth : {0, 1, 2}) {
    for (bool deferred : {false, true}) {
      std::map<std::string, std::vector<unsigned char>> got;
      absl::Status s = run("layer_prefetch", {.prefetch_depth = depth}, deferred, &got);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_TRUE(got == want) << "layer_prefetch K=" << depth << (deferred ? " deferred" : "")
                               << " differs from keep_on_gpu";
    }
  }
}

// States larger than the GPU budget (See Note [Bulk over budget] in policies/bulk.cpp). keep_on_gpu
// cannot hold them; bulk streams them a layer at a time and layer_prefetch through its ring, both
// within the budget and bitwise equal to an unbudgeted keep_on_gpu run; also with the device
// deferring its copies until the host waits, as a GPU does (states still arriving when the
// optimizer releases their layer).
TEST(D2Test, StatesLargerThanTheBudgetTrainUnderBulkAndLayerPrefetch) {
  constexpr int kBigLayers = 4;
  constexpr std::size_t kBigNumel = 1 << 20;  // 4 MiB tensors: P + G 32 MiB, states 32 MiB
  constexpr std::size_t kBudget = 48 * kMiB;
  auto run = [&](const std::string& policy, rt::PolicyConfig config, std::size_t budget,
                 std::map<std::string, std::vector<unsigned char>>* out,
                 bool deferred = false) -> absl::Status {
    auto [runtime, dev] = make_runtime(policy, config, deferred, budget);
    std::vector<std::pair<TensorHandle, TensorHandle>> params;
    for (int l = 0; l < kBigLayers; ++l) {
      std::vector<float> init(kBigNumel);
      for (std::size_t i = 0; i < kBigNumel; ++i) init[i] = std::sin(0.001f * i + l);
      TensorHandle p = *runtime->register_tensor(
          spec(str_cat("b", l, ".w"), l, Role::kParameter, kBigNumel), init.data());
      TensorHandle g = *runtime->register_tensor(
          spec(str_cat("b", l, ".w.grad"), l, Role::kGradient, kBigNumel));
      params.push_back({p, g});
    }
    AdamOptions o;
    o.groups.push_back({.params = params, .hyper = {.lr = 1e-2f, .weight_decay = 0.01f}});
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Adam> adam, Adam::create(*runtime, o));
    for (int step = 1; step <= 3; ++step) {
      for (int l = 0; l < kBigLayers; ++l) {
        std::vector<float> g(kBigNumel);
        for (std::size_t i = 0; i < kBigNumel; ++i) g[i] = std::cos(0.01f * i * step + l) * 0.1f;
        STRATA_RETURN_IF_ERROR(runtime->write(params[l].second, g.data()));
      }
      STRATA_RETURN_IF_ERROR(runtime->begin_step());
      STRATA_RETURN_IF_ERROR(adam->step());
      STRATA_RETURN_IF_ERROR(runtime->end_step());
    }
    // strata's GPU memory at its peak: the GPU tier's segments and the staging ring together.
    const auto peak = runtime->stats().gpu_reserved_peak_bytes;
    EXPECT_LE(static_cast<std::size_t>(peak), budget) << policy;
    for (TensorHandle h : runtime->tensors()) {
      (*out)[runtime->info(h)->spec.name] = read_all(*runtime, h);
    }
    return absl::OkStatus();
  };
  std::map<std::string, std::vector<unsigned char>> want, unused;
  ASSERT_TRUE(run("keep_on_gpu", {}, alloc::kNoBudget, &want).ok());
  absl::Status keep = run("keep_on_gpu", {}, kBudget, &unused);
  EXPECT_EQ(keep.code(), absl::StatusCode::kResourceExhausted) << keep;
  EXPECT_NE(keep.message().find("out of memory in tier gpu"), std::string_view::npos) << keep;
  for (bool deferred : {false, true}) {
    std::map<std::string, std::vector<unsigned char>> bulk, prefetch;
    absl::Status s = run("bulk", {.roles = RoleSet::optimizer_states(), .offload_after_step = true},
                         kBudget, &bulk, deferred);
    ASSERT_TRUE(s.ok()) << s << (deferred ? " (deferred)" : "");
    s = run("layer_prefetch", {.prefetch_depth = 1}, kBudget, &prefetch, deferred);
    ASSERT_TRUE(s.ok()) << s << (deferred ? " (deferred)" : "");
    EXPECT_TRUE(bulk == want) << "bulk over budget differs from keep_on_gpu, deferred " << deferred;
    EXPECT_TRUE(prefetch == want)
        << "layer_prefetch over budget differs from keep_on_gpu, deferred " << deferred;
  }
}

// D2 on a real GPU: the fused kernel, real copies, every policy; bitwise equal to keep_on_gpu.
TEST(GpuD2Test, GpuBitwiseEqualUnderEveryPolicy) {
  if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  const auto init = initial_values();
  std::map<std::string, std::vector<unsigned char>> want;
  const std::vector<std::pair<std::string, rt::PolicyConfig>> runs = {
      {"keep_on_gpu", {}},
      {"bulk", {.roles = RoleSet::all(), .offload_after_step = true}},
      {"layer_prefetch", {.prefetch_depth = 1}},
      {"layer_prefetch", {.prefetch_depth = 2, .roles = RoleSet::all()}},
  };
  for (const auto& [policy, config] : runs) {
    rt::RuntimeOptions options;
    options.policy = policy;
    options.policy_config = config;
    options.device = rt::DeviceKind::kCuda;
    auto runtime = rt::Runtime::create(std::move(options), policy::builtin_policies());
    ASSERT_TRUE(runtime.ok()) << runtime.status();
    Model m = register_model(**runtime, init);
    auto adam = Adam::create(**runtime, options_for(m, true, false));
    ASSERT_TRUE(adam.ok()) << adam.status();
    run_steps(**runtime, **adam, m, 200);
    std::map<std::string, std::vector<unsigned char>> got;
    for (TensorHandle h : (*runtime)->tensors()) {
      got[(*runtime)->info(h)->spec.name] = read_all(**runtime, h);
    }
    if (want.empty()) {
      want = got;
      continue;
    }
    for (const auto& [name, bytes] : want) {
      EXPECT_EQ(got.at(name), bytes) << name << " under " << policy << " differs from keep_on_gpu";
    }
  }
}

#ifdef STRATA_HAS_CUDA
// C1 of RELIABILITY.md on a real GPU: the copy streams are held up at random (host functions that
// sleep) while layer_prefetch moves states around the Adam step; the results equal keep_on_gpu's.
TEST(GpuD2Test, GpuDelayedCopyStreamsGiveBitwiseEqualResults) {
  if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  const auto init = initial_values();
  std::map<std::string, std::vector<unsigned char>> want;
  for (bool delayed : {false, true}) {
    rt::RuntimeOptions options;
    options.policy = delayed ? "layer_prefetch" : "keep_on_gpu";
    options.policy_config = {.prefetch_depth = 1, .roles = RoleSet::all()};
    options.device = rt::DeviceKind::kCuda;
    auto runtime = *rt::Runtime::create(std::move(options), policy::builtin_policies());
    Model m = register_model(*runtime, init);
    auto adam = *Adam::create(*runtime, options_for(m, true, false));
    std::mt19937 rng(5);
    for (int step = 1; step <= 60; ++step) {
      for (int l = 0; l < kLayers; ++l) {
        ASSERT_TRUE(runtime->write(m.grads[l], gradient(l, step).data()).ok());
      }
      if (delayed) {
        for (rt::StreamHandle s : {runtime->h2d_stream(), runtime->d2h_stream()}) {
          const int us = static_cast<int>(rng() % 3000);
          ASSERT_TRUE(
              runtime->device()
                  .enqueue_host(
                      s, [us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); })
                  .ok());
        }
      }
      ASSERT_TRUE(adam->step().ok());
    }
    auto got = states_of(*runtime);
    if (want.empty()) {
      want = got;
    } else {
      EXPECT_EQ(got, want);
    }
  }
}
#endif

TEST(AdamBadInputTest, RejectedBeforeAnythingIsRegistered) {
  auto [runtime, dev] = make_runtime("keep_on_gpu");
  TensorHandle p = *runtime->register_tensor(spec("p", 0, Role::kParameter, 10));
  TensorHandle g = *runtime->register_tensor(spec("p.grad", 0, Role::kGradient, 10));
  TensorHandle g_short = *runtime->register_tensor(spec("short.grad", 0, Role::kGradient, 9));
  TensorHandle dbl =
      *runtime->register_tensor(spec("d", 0, Role::kParameter, 10, rt::DType::kFloat64));
  TensorHandle not_grad = *runtime->register_tensor(spec("x", 0, Role::kOther, 10));
  const std::size_t before = runtime->tensors().size();
  auto expect = [&](std::vector<std::pair<TensorHandle, TensorHandle>> params,
                    absl::StatusCode code, const std::string& message) {
    AdamOptions o;
    o.groups.push_back({.params = std::move(params), .hyper = {}});
    absl::Status s = Adam::create(*runtime, o).status();
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_EQ(s.message(), message);
    EXPECT_EQ(runtime->tensors().size(), before) << "nothing may be registered";
  };
  expect({{p, g_short}}, absl::StatusCode::kInvalidArgument,
         "Adam: gradient 'short.grad' does not match parameter 'p' in shape or layer");
  expect({{dbl, g}}, absl::StatusCode::kInvalidArgument,
         "Adam: parameter 'd' is float64; Adam steps float32, bfloat16 and float16 tensors");
  expect({{p, not_grad}}, absl::StatusCode::kInvalidArgument,
         "Adam: gradient 'x' has role other, not gradient");
  expect({{p, g}, {p, g}}, absl::StatusCode::kInvalidArgument,
         "Adam: parameter 'p' is listed twice");
  expect({{p, TensorHandle{999}}}, absl::StatusCode::kNotFound,
         "tensor handle 999 is not registered");
}

// A layer that cannot fit the GPU could never be stepped (the kernel reads GPU memory only):
// refused at create, and at step when the budget was lowered since, before anything changes.
TEST(AdamBadInputTest, ALayerThatCannotFitTheBudgetIsRefusedBeforeAnyLaunch) {
  constexpr std::size_t kNumel = 1024 * 1024;  // 4 MiB per tensor, 16 MiB per layer with moments
  auto [runtime, dev] = make_runtime("keep_on_gpu", {}, false, 12 * kMiB);
  TensorHandle p = *runtime->register_tensor(spec("p", 3, Role::kParameter, kNumel));
  TensorHandle g = *runtime->register_tensor(spec("p.grad", 3, Role::kGradient, kNumel));
  const std::size_t before = runtime->tensors().size();
  AdamOptions o;
  o.groups.push_back({.params = {{p, g}}, .hyper = {}});
  absl::Status s = Adam::create(*runtime, o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(s.message(),
            "Adam: layer 3 needs 16.00 MiB on the GPU for its step (parameters, gradients and "
            "moments; the kernel reads GPU memory only), more than the GPU budget of 12.00 MiB");
  EXPECT_EQ(runtime->tensors().size(), before) << "nothing may be registered";

  // Room for it: made and stepped once. Then the budget shrinks below the layer (the allocator
  // allows it: its blocks stay) and the next step is refused with nothing changed, its list of
  // parameters to skip kept for the retry (See Note [Per-parameter steps] in optim/adam.h).
  ASSERT_TRUE(runtime->allocator().set_budget(Tier::kGpu, 40 * kMiB).ok());
  TensorHandle q = *runtime->register_tensor(spec("q", 3, Role::kParameter, 16));
  TensorHandle qg = *runtime->register_tensor(spec("q.grad", 3, Role::kGradient, 16));
  o.groups[0].params.push_back({q, qg});
  std::unique_ptr<Adam> adam = *Adam::create(*runtime, o);
  std::vector<float> ones(kNumel, 1.0f);
  ASSERT_TRUE(runtime->write(g, ones.data()).ok());
  ASSERT_TRUE(runtime->write(qg, ones.data()).ok());
  ASSERT_TRUE(adam->step().ok());
  const std::vector<unsigned char> params = rt::testing::read_all(*runtime, p);
  const std::vector<unsigned char> q_params = rt::testing::read_all(*runtime, q);
  ASSERT_TRUE(runtime->allocator().set_budget(Tier::kGpu, 12 * kMiB).ok());
  ASSERT_TRUE(adam->skip_parameters({q}).ok());
  s = adam->step();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(adam->step_count(0), 1);
  EXPECT_EQ(rt::testing::read_all(*runtime, p), params);
  EXPECT_TRUE(adam->skipped_this_step(q)) << "a refused step forgot the parameters it skips";
  // The retry, with room again, skips the same parameter.
  ASSERT_TRUE(runtime->allocator().set_budget(Tier::kGpu, 40 * kMiB).ok());
  ASSERT_TRUE(adam->step().ok());
  EXPECT_EQ(*adam->step_count_of(p), 2);
  EXPECT_EQ(*adam->step_count_of(q), 1);
  EXPECT_EQ(rt::testing::read_all(*runtime, q), q_params);
}

TEST(AdamBadInputTest, AnUnregisteredTensorStopsTheStepBeforeAnyLaunch) {
  auto [runtime, dev] = make_runtime("keep_on_gpu");
  TensorHandle p0 = *runtime->register_tensor(spec("p0", 0, Role::kParameter, 16));
  TensorHandle g0 = *runtime->register_tensor(spec("p0.grad", 0, Role::kGradient, 16));
  TensorHandle p1 = *runtime->register_tensor(spec("p1", 1, Role::kParameter, 16));
  TensorHandle g1 = *runtime->register_tensor(spec("p1.grad", 1, Role::kGradient, 16));
  AdamOptions o;
  o.groups.push_back({.params = {{p0, g0}, {p1, g1}}, .hyper = {}});
  std::unique_ptr<Adam> adam = *Adam::create(*runtime, o);
  std::vector<float> ones(16, 1.0f);
  ASSERT_TRUE(runtime->write(g0, ones.data()).ok());
  const std::vector<unsigned char> before = rt::testing::read_all(*runtime, p0);
  ASSERT_TRUE(runtime->unregister(g1).ok());
  absl::Status s = adam->step();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(s.message(),
            "Adam: tensor 'p1.grad' (layer 1) was unregistered after the optimizer was made");
  EXPECT_EQ(adam->step_count(0), 0);
  EXPECT_EQ(rt::testing::read_all(*runtime, p0), before) << "layer 0 must not have been stepped";
}

// A parameter named to skip_parameters sits the step out (its values, states and step count
// unchanged), the others step as usual, and the counts differ from then on
// (See Note [Per-parameter steps] in optim/adam.h): training the two halves apart equals training
// them with skips, under every policy, and a checkpoint keeps each parameter's count.
class PerParameterStepsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PerParameterStepsTest, SkippedParametersAreUntouchedAndKeepTheirOwnCounts) {
  const auto init = initial_values();
  auto [runtime, dev] = make_runtime(GetParam(), {.prefetch_depth = 1});
  Model m = register_model(*runtime, init);
  auto adam = *Adam::create(*runtime, options_for(m, true, false));
  // Step 1: everything. Steps 2-3: layer 1 sits out. Step 4: everything again.
  for (int step = 1; step <= 4; ++step) {
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(runtime->write(m.grads[l], gradient(l, step).data()).ok());
    }
    const std::vector<unsigned char> layer1 = read_all(*runtime, m.params[1]);
    const std::vector<unsigned char> layer0 = read_all(*runtime, m.params[0]);
    const bool skip = step == 2 || step == 3;
    if (skip) {
      ASSERT_TRUE(adam->skip_parameters({m.params[1]}).ok());
    }
    EXPECT_EQ(adam->skipped_this_step(m.params[1]), skip);
    ASSERT_TRUE(runtime->begin_step().ok());
    ASSERT_TRUE(adam->step().ok());
    ASSERT_TRUE(runtime->end_step().ok());
    EXPECT_FALSE(adam->skipped_this_step(m.params[1])) << "the list outlived its step";
    EXPECT_EQ(read_all(*runtime, m.params[1]) == layer1, skip) << "step " << step;
    EXPECT_NE(read_all(*runtime, m.params[0]), layer0) << "step " << step;
  }
  EXPECT_EQ(*adam->step_count_of(m.params[0]), 4);
  EXPECT_EQ(*adam->step_count_of(m.params[1]), 2);
  EXPECT_EQ(adam->step_count(0), 4);  // a group's count: the most of its parameters'
  // The bias corrections follow each parameter's own count: layer 1's second step is a step 2.
  auto [ref, ref_dev] = make_runtime("keep_on_gpu", {});
  Model mr = register_model(*ref, init);
  AdamOptions one = options_for(mr, true, false);
  auto ref_adam = *Adam::create(*ref, one);
  for (int step : {1, 4}) {
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(ref->write(mr.grads[l], gradient(l, step).data()).ok());
    }
    ASSERT_TRUE(ref->begin_step().ok());
    ASSERT_TRUE(ref_adam->step().ok());
    ASSERT_TRUE(ref->end_step().ok());
  }
  EXPECT_EQ(read_all(*runtime, m.params[1]), read_all(*ref, mr.params[1]));
  // A checkpoint keeps the counts; a fresh optimizer loading it steps on from them.
  std::stringstream file;
  ASSERT_TRUE(adam->save(file).ok());
  auto [c, c_dev] = make_runtime(GetParam(), {.prefetch_depth = 1});
  Model mc = register_model(*c, init);
  auto loaded = *Adam::create(*c, options_for(mc, true, false));
  ASSERT_TRUE(loaded->load(file).ok());
  EXPECT_EQ(*loaded->step_count_of(mc.params[0]), 4);
  EXPECT_EQ(*loaded->step_count_of(mc.params[1]), 2);
  ASSERT_TRUE(loaded->set_step_count_of(mc.params[1], 7).ok());
  EXPECT_EQ(*loaded->step_count_of(mc.params[1]), 7);
  EXPECT_EQ(*loaded->step_count_of(mc.params[0]), 4);
}

// Gradients in the caller's memory, given at each step, step the parameters bitwise as registered
// gradients with the same values do, under every policy (See Note [Gradients given at each step] in
// optim/adam.h); a step without one for a parameter that takes part is refused before anything
// changes.
TEST_P(PerParameterStepsTest, GradientsGivenAtEachStepStepAsRegisteredOnes) {
  const auto init = initial_values();
  auto [a, a_dev] = make_runtime(GetParam(), {.prefetch_depth = 1});
  Model ma = register_model(*a, init);
  auto adam_a = *Adam::create(*a, options_for(ma, true, false));
  run_steps(*a, *adam_a, ma, 3);

  auto [b, b_dev] = make_runtime(GetParam(), {.prefetch_depth = 1});
  Model mb = register_model(*b, init);
  AdamOptions given = options_for(mb, true, false);
  given.gradients_given = true;
  for (ParamGroup& g : given.groups) {
    for (auto& pair : g.params) pair.second = TensorHandle();
  }
  auto adam_b = *Adam::create(*b, given);
  EXPECT_EQ(adam_b->step().code(), absl::StatusCode::kFailedPrecondition)
      << "a step without the gradients must be refused";
  EXPECT_EQ(*adam_b->step_count_of(mb.params[0]), 0);
  EXPECT_EQ(adam_b->set_gradient(mb.params[0], nullptr, ElemType::kF32).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(adam_b->set_gradient(mb.grads[0], nullptr, ElemType::kF32).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(adam_a->set_gradient(ma.params[0], init[0].data(), ElemType::kF32).code(),
            absl::StatusCode::kFailedPrecondition)
      << "a parameter with a registered gradient";
  for (int step = 1; step <= 3; ++step) {
    // The caller's memory: on the simulated device, host memory the kernel reads.
    std::vector<std::vector<float>> grads;
    for (int l = 0; l < kLayers; ++l) grads.push_back(gradient(l, step));
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(adam_b->set_gradient(mb.params[l], grads[l].data(), ElemType::kF32).ok());
    }
    ASSERT_TRUE(b->begin_step().ok());
    ASSERT_TRUE(adam_b->step().ok());
    ASSERT_TRUE(b->end_step().ok());
    ASSERT_TRUE(b->wait_all().ok());  // the kernels read `grads`
  }
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(read_all(*b, mb.params[l]), read_all(*a, ma.params[l])) << "layer " << l;
  }
  // The gradients given are forgotten once their step completed.
  EXPECT_EQ(adam_b->step().code(), absl::StatusCode::kFailedPrecondition);
}

INSTANTIATE_TEST_SUITE_P(Policies, PerParameterStepsTest,
                         ::testing::Values("keep_on_gpu", "bulk", "layer_prefetch"));

}  // namespace
}  // namespace strata::optim
