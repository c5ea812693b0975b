// A LibTorch model trained with strata from outside strata's tree (find_package(strata)): its
// parameters and gradients bound layer by layer, Adam states streamed by layer_prefetch, on the
// GPU when there is one and on the simulated device otherwise. Prints the losses and exits 1 unless
// the loss fell and nothing leaked.
#include <torch/torch.h>

#include <cstdio>
#include <memory>

#include "bridge/model_hooks.h"
#include "bridge/status.h"
#include "bridge/torch_runtime.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

int main() {
  using namespace strata;
  const bool cuda = torch::cuda::is_available();
  rt::RuntimeOptions options;
  options.policy = "layer_prefetch";
  options.device = cuda ? rt::DeviceKind::kCuda : rt::DeviceKind::kSimulated;
  options.allocator.track_allocations = true;
  auto runtime =
      bridge::unwrap(rt::Runtime::create(std::move(options), policy::builtin_policies()));
  float first = 0, last = 0;
  {
    bridge::TorchBinding binding(*runtime);
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Linear(32, 64), torch::nn::Tanh(),
                                torch::nn::Linear(64, 1));
    const torch::Device device = cuda ? torch::kCUDA : torch::kCPU;
    model->to(device);
    binding.register_module(*model, {}, rt::Tier::kGpu);
    for (torch::Tensor& p : model->parameters()) p.mutable_grad() = torch::zeros_like(p);
    binding.register_gradients(*model, rt::Tier::kGpu);
    optim::AdamOptions ao;
    ao.groups.resize(1);
    ao.groups[0].hyper = {.lr = 1e-2, .weight_decay = 0.01};
    for (torch::Tensor& p : model->parameters()) {
      ao.groups[0].params.push_back({binding.handle(p), binding.handle(p.grad())});
    }
    auto adam = bridge::unwrap(optim::Adam::create(*runtime, std::move(ao)));
    bridge::ModelHooks hooks(*runtime);
    std::vector<std::vector<torch::Tensor>> grads(3);
    for (const auto& p : model->named_parameters()) {
      grads[p.key()[0] == '0' ? 0 : 2].push_back(p.value().grad());
    }
    hooks.set_layer_gradients(grads);
    const torch::Tensor x = torch::randn({64, 32}, device);
    const torch::Tensor y = x.sum(1, true).sin();
    for (int step = 0; step < 50; ++step) {
      for (torch::Tensor& g : model->parameters()) g.mutable_grad().zero_();
      hooks.begin_step();
      for (int l = 0; l < 3; ++l) hooks.before_forward(l);
      torch::Tensor loss = torch::mse_loss(model->forward(x), y);
      loss.backward();
      hooks.finish_backward();
      bridge::check(adam->step());
      hooks.end_step();
      (step == 0 ? first : last) = loss.item<float>();
    }
    adam.reset();
    for (torch::Tensor& p : model->parameters()) {
      binding.unregister(p.mutable_grad());
      binding.unregister(p);
    }
  }
  const bool leak_free = runtime->allocator().leak_report().empty();
  std::printf("strata consumer (%s): loss %.6f -> %.6f, leak report %s\n",
              cuda ? "cuda" : "simulated", first, last, leak_free ? "empty" : "NOT empty");
  return last < first && leak_free ? 0 : 1;
}
