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
// within 1e-6 relative. On the CPU (simulated device) strata's kernel is compiled without fused
// multiply-adds and torch's CPU kernel computes its moments in float32, so each step, started from
// the same state, agrees within a few float32 roundings (1e-6 relative); the norms within 1e-6.
#include <torch/torch.h>

#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/_fused_adamw.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "allocator/upstream.h"
#include "bridge/grad_stats.h"
#include "bridge/status.h"
#include "bridge/torch_runtime.h"
#include "gtest/gtest.h"
#include "optim/adam.h"
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
  // Largest |strata - torch| / max(|torch|, lr) over master weights: a step moves a weight by
  // about lr, so its rounding is relative to the larger of the two.
  double worst_rel = 0;
  double worst_norm_rel = 0;
};

void compare_masters(const std::vector<torch::Tensor>& strata,
                     const std::vector<torch::Tensor>& ref, Compare& c) {
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const torch::Tensor a = strata[i].cpu().contiguous();
    const torch::Tensor b = ref[i].cpu().contiguous();
    if (std::memcmp(a.data_ptr(), b.data_ptr(), b.nbytes()) != 0) c.bitwise = false;
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
      for (torch::Tensor& p : model->parameters()) {
        const rt::TensorHandle master =
            unwrap(adam->state(binding.handle(p))).back();  // exp_avg, exp_avg_sq, master
        torch::Tensor host = torch::empty(p.sizes(), torch::kFloat);
        check(runtime->read(master, host.data_ptr()));
        got.push_back(host);
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
    EXPECT_LE(r.worst_rel, 1e-6) << c.policy;
    if (c.max_norm > 0) EXPECT_LE(r.worst_norm_rel, 1e-6) << c.policy;
  }
}

TEST(TorchParityTest, GpuMastersAreBitwiseTorchsFusedAdamWWithoutClipping) {
  if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  for (const Case& c : cases()) {
    const Compare r = run(c, rt::DeviceKind::kCuda, torch::kCUDA, /*resync=*/false);
    if (c.max_norm > 0) {
      EXPECT_LE(r.worst_rel, 1e-6) << c.policy;
      EXPECT_LE(r.worst_norm_rel, 1e-6) << c.policy;
    } else {
      EXPECT_TRUE(r.bitwise) << c.policy << ": worst relative difference " << r.worst_rel;
    }
  }
}

}  // namespace
}  // namespace strata::bridge
