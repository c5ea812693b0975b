// strata's Adam against torch's fused AdamW (torch._fused_adamw_, what
// torch.optim.AdamW(fused=True) runs) as mixed-precision PyTorch training uses it: a bfloat16 or
// float16 model whose float32 master weights the optimizer steps, the parameters rounded from
// them; gradients clipped with clip_grad_norm_ on the masters; float16 losses scaled the way
// torch.amp.GradScaler does, with an overflowing step in the middle that GradScaler skips.
//
// Both sides train their own copy of the same model from the same start for 50 steps, under every
// policy with the masters and moments streamed. On the GPU (Gpu*, label gpu) strata's kernel
// computes torch's expression in torch's order, so without clipping every master weight is bitwise
// torch's at every step; with clipping the norm's reduction order differs, so the masters agree
// within 1e-6 relative. On the CPU (simulated device) strata runs the same float32 math, but
// torch's CPU fused kernel is not its CUDA kernel: it keeps the hyperparameters in float64 where
// the CUDA kernel rounds them to float32 (1 - 0.999f is 1.3e-5 off 1 - 0.999), so each CPU step,
// started from the same state, agrees within 2e-5 of a step (lr); the norms within 1e-6.
#include <torch/torch.h>

#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/_fused_adamw.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "allocator/upstream.h"
#include "base/strings.h"
#include "bridge/grad_stats.h"
#include "bridge/status.h"
#include "bridge/torch_runtime.h"
#include "gtest/gtest.h"
#include "optim/adam.h"
#include "optim/adam_kernels.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

namespace strata::bridge {
namespace {

constexpr int kSteps = 50;
constexpr int kOverflowStep = 20;  // float16 runs: one gradient element is inf at this step
constexpr double kLr = 1e-2;
constexpr double kWeightDecay = 0.01;

struct Case {
  std::string policy;
  torch::Dtype dtype;
  double max_norm;  // 0: no clipping
};

torch::nn::Sequential make_model(torch::Device device, torch::Dtype dtype) {
  torch::manual_seed(7);
  torch::nn::Sequential m(torch::nn::Linear(64, 128), torch::nn::Tanh(),
                          torch::nn::Linear(128, 16));
  m->to(device, dtype);
  return m;
}

torch::Tensor loss_of(torch::nn::Sequential& m, const torch::Tensor& x, const torch::Tensor& y) {
  return (m->forward(x).to(torch::kFloat) - y).pow(2).mean();
}

// Where the two runs stand after a step.
struct Compare {
  bool bitwise = true;
  // The first step after which a state differed in its bits (0: none), and which state.
  int first_diff_step = 0;
  std::string first_diff;
  // Largest |strata - torch| / max(|torch|, lr) over master weights: a step moves a weight by
  // about lr, so its rounding is relative to the larger of the two.
  double worst_rel = 0;
  double worst_norm_rel = 0;
};

bool same_bits(const torch::Tensor& x, const torch::Tensor& y) {
  const torch::Tensor a = x.cpu().contiguous();
  const torch::Tensor b = y.cpu().contiguous();
  return a.nbytes() == b.nbytes() && std::memcmp(a.data_ptr(), b.data_ptr(), b.nbytes()) == 0;
}

// Notes the first step at which `what` of strata and of torch differ in their bits.
void note_bits(int step, const std::string& what, const torch::Tensor& a, const torch::Tensor& b,
               Compare& c) {
  if (c.first_diff_step == 0 && !same_bits(a, b)) {
    c.first_diff_step = step;
    c.first_diff = what;
  }
}

void compare_masters(const std::vector<torch::Tensor>& strata,
                     const std::vector<torch::Tensor>& ref, Compare& c) {
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const torch::Tensor a = strata[i].cpu().contiguous();
    const torch::Tensor b = ref[i].cpu().contiguous();
    if (!same_bits(a, b)) c.bitwise = false;
    const double rel = ((a.to(torch::kDouble) - b.to(torch::kDouble)).abs() /
                        b.to(torch::kDouble).abs().clamp_min(kLr))
                           .max()
                           .item<double>();
    c.worst_rel = std::max(c.worst_rel, rel);
  }
}

// With `resync`, torch's side starts every step from strata's state (masters, moments,
// parameters), so each step is compared on its own: on the CPU the two kernels round differently,
// and one bfloat16 parameter rounded the other way changes every later gradient.
Compare run(const Case& c, rt::DeviceKind kind, torch::Device device, bool resync) {
  SCOPED_TRACE(c.policy + (c.dtype == torch::kHalf ? " float16" : " bfloat16") +
               (c.max_norm > 0 ? " clipped" : ""));
  const bool fp16 = c.dtype == torch::kHalf;
  rt::RuntimeOptions ro;
  ro.device = kind;
  ro.policy = c.policy;
  ro.policy_config.roles = rt::RoleSet::optimizer_states();
  ro.policy_config.offload_after_step = true;
  std::unique_ptr<rt::Runtime> runtime =
      unwrap(rt::Runtime::create(std::move(ro), policy::builtin_policies()));
  Compare out;
  {
    TorchBinding binding(*runtime);
    torch::nn::Sequential model = make_model(device, c.dtype);
    torch::nn::Sequential ref = make_model(device, c.dtype);
    binding.register_module(*model, {}, rt::Tier::kGpu);
    for (torch::Tensor& p : model->parameters()) p.mutable_grad() = torch::zeros_like(p);
    binding.register_gradients(*model, rt::Tier::kGpu);
    optim::AdamOptions ao;
    ao.groups.resize(1);
    ao.groups[0].hyper = {.lr = kLr, .weight_decay = kWeightDecay, .decoupled = true};
    for (torch::Tensor& p : model->parameters()) {
      ao.groups[0].params.push_back({binding.handle(p), binding.handle(p.grad())});
    }
    std::unique_ptr<optim::Adam> adam = unwrap(optim::Adam::create(*runtime, std::move(ao)));

    // torch's side: float32 masters stepped by _fused_adamw_, parameters copied from them.
    std::vector<torch::Tensor> params = ref->parameters();
    std::vector<torch::Tensor> masters, exp_avg, exp_avg_sq, steps;
    for (const torch::Tensor& p : params) {
      masters.push_back(p.detach().to(torch::kFloat).clone());
      exp_avg.push_back(torch::zeros_like(masters.back()));
      exp_avg_sq.push_back(torch::zeros_like(masters.back()));
      steps.push_back(torch::zeros({}, masters.back().options()));
    }
    const auto on = torch::TensorOptions().device(device).dtype(torch::kFloat);
    // One GradScaler state per side, updated by the same function.
    torch::Tensor scale[2] = {torch::full({}, fp16 ? 1024.0 : 1.0, on),
                              torch::full({}, fp16 ? 1024.0 : 1.0, on)};
    torch::Tensor growth[2] = {torch::zeros({}, on.dtype(torch::kInt)),
                               torch::zeros({}, on.dtype(torch::kInt))};
    const std::vector<std::vector<torch::Tensor>> grads_of_layer = [&] {
      std::vector<std::vector<torch::Tensor>> g(3);
      for (const auto& p : model->named_parameters()) {
        g[p.key()[0] == '0' ? 0 : 2].push_back(p.value().grad());
      }
      return g;
    }();
    GradientStats stats;
    stats.set_check_non_finite(true);  // compared with torch's found_inf in every case
    torch::manual_seed(11);
    const torch::Tensor x = torch::randn({32, 64}, on).to(c.dtype);
    const torch::Tensor y = torch::randn({32, 16}, on);
    for (int step = 1; step <= kSteps; ++step) {
      const bool overflow = fp16 && step == kOverflowStep;
      if (resync && step > 1) {
        torch::NoGradGuard no_grad;
        std::vector<torch::Tensor> mine = model->parameters();
        for (std::size_t i = 0; i < params.size(); ++i) {
          const std::vector<rt::TensorHandle> st = unwrap(adam->state(binding.handle(mine[i])));
          for (auto [h, t] : {std::pair{st[0], &exp_avg[i]}, std::pair{st[1], &exp_avg_sq[i]},
                              std::pair{st[2], &masters[i]}}) {
            torch::Tensor host = torch::empty(t->sizes(), torch::kFloat);
            check(runtime->read(h, host.data_ptr()));
            t->copy_(host);
          }
          params[i].copy_(mine[i]);
        }
      }
      // strata
      check(runtime->begin_step());
      for (int l = 0; l < 3; ++l) check(runtime->before_forward(l));
      for (torch::Tensor& p : model->parameters()) p.mutable_grad().zero_();
      (loss_of(model, x, y) * scale[0]).backward();
      if (overflow) model->parameters()[0].mutable_grad().view(-1)[3].fill_(INFINITY);
      stats.reset();
      for (int l = 2; l >= 0; --l) {
        stats.add_layer(l, grads_of_layer[l]);
        check(runtime->after_backward(l));
      }
      const torch::Tensor loss_scale = fp16 ? scale[0] : torch::Tensor();
      const torch::Tensor gs = stats.grad_scale(loss_scale, c.max_norm).clone();
      const torch::Tensor inf = stats.found_inf();
      const torch::Tensor norm = stats.total_norm(loss_scale);
      check(adam->step(gs.data_ptr<float>(), fp16 ? inf.data_ptr<float>() : nullptr));
      check(runtime->end_step());
      check(runtime->wait_all());
      if (fp16) at::_amp_update_scale_(scale[0], growth[0], inf, 2.0, 0.5, 2000);

      // torch: GradScaler.unscale_ (which clipping needs) then clip_grad_norm_ and the fused step,
      // which skips on found_inf; or, without clipping, the fused step unscales itself.
      ref->zero_grad();
      (loss_of(ref, x, y) * scale[1]).backward();
      if (overflow) ref->parameters()[0].mutable_grad().view(-1)[3].fill_(INFINITY);
      std::vector<torch::Tensor> grads;
      for (std::size_t i = 0; i < params.size(); ++i) {
        masters[i].mutable_grad() = params[i].grad().to(torch::kFloat);
        grads.push_back(masters[i].grad());
      }
      torch::Tensor found_inf = torch::zeros({}, on);
      std::optional<at::Tensor> grad_scale;
      if (c.max_norm > 0) {
        if (fp16)
          at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, scale[1].reciprocal());
        const double ref_norm = torch::nn::utils::clip_grad_norm_(masters, c.max_norm);
        if (found_inf.item<float>() == 0) {
          out.worst_norm_rel =
              std::max(out.worst_norm_rel, std::abs(norm.item<double>() - ref_norm) / ref_norm);
        }
      } else if (fp16) {
        at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch::ones({}, on));
        grad_scale = scale[1];
      }
      at::_foreach_add_(steps, 1);
      {
        torch::NoGradGuard no_grad;
        at::_fused_adamw_(masters, grads, exp_avg, exp_avg_sq, {}, steps, kLr, 0.9, 0.999,
                          kWeightDecay, 1e-8, false, false, grad_scale,
                          fp16 ? std::optional<at::Tensor>(found_inf) : std::nullopt);
        for (std::size_t i = 0; i < params.size(); ++i) params[i].copy_(masters[i]);
      }
      if (fp16) {
        at::_foreach_sub_(steps, std::vector<torch::Tensor>(steps.size(), found_inf));
        at::_amp_update_scale_(scale[1], growth[1], found_inf, 2.0, 0.5, 2000);
      }
      if (overflow) EXPECT_EQ(inf.item<float>(), 1.0f);
      EXPECT_EQ(inf.item<float>(), found_inf.item<float>()) << "step " << step;

      std::vector<torch::Tensor> got;
      std::vector<torch::Tensor> mine = model->parameters();
      for (std::size_t i = 0; i < mine.size(); ++i) {
        // exp_avg, exp_avg_sq, master
        const std::vector<rt::TensorHandle> st = unwrap(adam->state(binding.handle(mine[i])));
        std::vector<torch::Tensor> host;
        for (rt::TensorHandle h : st) {
          host.push_back(torch::empty(mine[i].sizes(), torch::kFloat));
          check(runtime->read(h, host.back().data_ptr()));
        }
        const std::string name = "parameter " + std::to_string(i) + " ";
        note_bits(step, name + "gradient", mine[i].grad(), params[i].grad(), out);
        note_bits(step, name + "exp_avg", host[0], exp_avg[i], out);
        note_bits(step, name + "exp_avg_sq", host[1], exp_avg_sq[i], out);
        note_bits(step, name + "master", host[2], masters[i], out);
        got.push_back(host[2]);
      }
      compare_masters(got, masters, out);
      if (std::getenv("PARITY_DEBUG"))
        std::printf("step %d worst %g loss %g\n", step, out.worst_rel, norm.item<double>());
    }
    for (const torch::Tensor& s : steps) {
      EXPECT_EQ(s.item<float>(), kSteps - (fp16 ? 1 : 0));
    }
    EXPECT_EQ(adam->step_count(0), kSteps - (fp16 ? 1 : 0));
    adam.reset();
    for (torch::Tensor& p : model->parameters()) {
      binding.unregister(p.mutable_grad());
      binding.unregister(p);
    }
  }
  EXPECT_TRUE(runtime->allocator().leak_report().empty());
  return out;
}

const std::vector<Case>& cases() {
  static const std::vector<Case> all = [] {
    std::vector<Case> out;
    for (const char* policy : {"keep_on_gpu", "bulk", "layer_prefetch"}) {
      for (torch::Dtype dtype : {torch::kBFloat16, torch::kHalf}) {
        for (double max_norm : {0.0, 1.0}) out.push_back({policy, dtype, max_norm});
      }
    }
    return out;
  }();
  return all;
}

TEST(TorchParityTest, MastersFollowTorchsFusedAdamWOnTheCpuWithinFloat32Rounding) {
  for (const Case& c : cases()) {
    const Compare r = run(c, rt::DeviceKind::kSimulated, torch::kCPU, /*resync=*/true);
    EXPECT_LE(r.worst_rel, 2e-5) << c.policy;
    if (c.max_norm > 0) EXPECT_LE(r.worst_norm_rel, 1e-6) << c.policy;
  }
}

std::string describe(const Case& c, bool resync, const Compare& r) {
  return str_cat(c.policy, c.dtype == torch::kHalf ? " float16" : " bfloat16",
                 c.max_norm > 0 ? " clipped" : "", resync ? " (each step from one state)" : "",
                 ": bitwise ", r.bitwise ? "yes" : "no", ", worst ", r.worst_rel, ", norm ",
                 r.worst_norm_rel, ", first difference ",
                 r.first_diff_step == 0
                     ? std::string("none")
                     : str_cat("after step ", r.first_diff_step, " in ", r.first_diff));
}

// Each step started from one state (resync), then the 50-step trajectories.
TEST(TorchParityTest, GpuMastersAreBitwiseTorchsFusedAdamWWithoutClipping) {
  if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  for (bool resync : {true, false}) {
    for (const Case& c : cases()) {
      const Compare r = run(c, rt::DeviceKind::kCuda, torch::kCUDA, resync);
      std::printf("%s\n", describe(c, resync, r).c_str());
      if (c.max_norm > 0) {
        EXPECT_LE(r.worst_rel, 1e-6) << describe(c, resync, r);
        EXPECT_LE(r.worst_norm_rel, 1e-6) << describe(c, resync, r);
      } else {
        EXPECT_TRUE(r.bitwise) << describe(c, resync, r);
      }
    }
  }
}

#ifdef STRATA_HAS_CUDA
// The kernel alone, no model: 50 steps of fixed random gradients, strata's kernel on a bfloat16
// parameter with its float32 master and torch's _fused_adamw_ on a float32 copy, every state
// compared bit for bit after every step.
TEST(TorchParityTest, GpuKernelStepsAreBitwiseTorchsFusedAdamW) {
  if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  const auto f32 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat);
  for (torch::Dtype dtype : {torch::kBFloat16, torch::kFloat}) {
    torch::manual_seed(3);
    const std::int64_t n = 70001;  // odd: the kernel's scalar tail too
    torch::Tensor master = torch::randn({n}, f32);
    torch::Tensor param = master.to(dtype);
    if (dtype == torch::kFloat) param = master.clone();
    torch::Tensor m = torch::zeros({n}, f32), v = torch::zeros({n}, f32);
    torch::Tensor ref = master.clone(), ref_m = m.clone(), ref_v = v.clone();
    torch::Tensor steps = torch::zeros({}, f32);
    const bool low = dtype != torch::kFloat;
    const optim::ElemType et = low ? optim::ElemType::kBF16 : optim::ElemType::kF32;
    const optim::AdamHyper h{.lr = kLr, .weight_decay = kWeightDecay, .decoupled = true};
    int first_diff = 0;
    std::string what;
    for (int step = 1; step <= kSteps; ++step) {
      const torch::Tensor grad = (torch::randn({n}, f32) * 0.1).to(dtype);
      optim::AdamTensor t{.param = param.data_ptr(),
                          .grad = grad.data_ptr(),
                          .exp_avg = m.data_ptr<float>(),
                          .exp_avg_sq = v.data_ptr<float>(),
                          .numel = n,
                          .master = low ? master.data_ptr<float>() : nullptr,
                          .param_type = et,
                          .grad_type = et,
                          .step = step};
      ASSERT_EQ(
          optim::adam_step_cuda(&t, 1, optim::adam_scalars(h, step), nullptr, nullptr, nullptr),
          cudaSuccess);
      std::vector<torch::Tensor> g32 = {grad.to(torch::kFloat)}, p = {ref}, mm = {ref_m},
                                 vv = {ref_v}, st = {steps};
      at::_foreach_add_(st, 1);
      at::_fused_adamw_(p, g32, mm, vv, {}, st, kLr, 0.9, 0.999, kWeightDecay, 1e-8, false, false);
      torch::cuda::synchronize();
      const torch::Tensor mine = low ? master : param;
      for (auto [name, a, b] : {std::tuple{"exp_avg", m, ref_m}, std::tuple{"exp_avg_sq", v, ref_v},
                                std::tuple{"master", mine, ref}}) {
        if (first_diff == 0 && !same_bits(a, b)) {
          first_diff = step;
          const double worst = ((a.to(torch::kDouble) - b.to(torch::kDouble)).abs() /
                                b.to(torch::kDouble).abs().clamp_min(1e-30))
                                   .max()
                                   .item<double>();
          what = str_cat(name, " (largest relative difference ", worst, ")");
        }
      }
    }
    std::printf(
        "kernel %s: first difference %s\n", low ? "bfloat16" : "float32",
        first_diff == 0 ? "none" : str_cat("after step ", first_diff, " in ", what).c_str());
    EXPECT_EQ(first_diff, 0) << (low ? "bfloat16: " : "float32: ") << what;
  }
}
#endif

}  // namespace
}  // namespace strata::bridge
