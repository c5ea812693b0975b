// A bound model that changes under the binding (See Note [Gradients the model replaced] in
// bridge/gradients.cpp): gradients cleared with zero_grad(set_to_none=true), LibTorch's default,
// keep training correct; a parameter left with no gradient, given new storage by set_data or moved
// by module->to() fails the next step with an error naming it; a resize is refused; registering a
// module twice says so. On the CPU, simulated device.
#include <memory>
#include <string>
#include <vector>

#include "bridge/status.h"
#include "bridge/torch_runtime.h"
#include "gtest/gtest.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "torch/torch.h"

namespace strata::bridge {
namespace {

// A two-layer model bound to a runtime, with strata's Adam over it.
struct Trained {
  std::unique_ptr<rt::Runtime> runtime;
  std::unique_ptr<TorchBinding> binding;
  torch::nn::Sequential model{nullptr};
  std::unique_ptr<optim::Adam> adam;

  explicit Trained(const std::string& policy) {
    rt::RuntimeOptions options;
    options.policy = policy;
    options.device = rt::DeviceKind::kSimulated;
    options.policy_config.roles = rt::RoleSet::all();
    runtime = unwrap(rt::Runtime::create(std::move(options), policy::builtin_policies()));
    binding = std::make_unique<TorchBinding>(*runtime);
    torch::manual_seed(3);
    model =
        torch::nn::Sequential(torch::nn::Linear(8, 4), torch::nn::Tanh(), torch::nn::Linear(4, 1));
    binding->register_module(*model, std::nullopt, rt::Tier::kGpu);
    for (torch::Tensor& p : model->parameters()) p.mutable_grad() = torch::zeros_like(p);
    binding->register_gradients(*model, rt::Tier::kGpu);
    optim::AdamOptions o;
    o.groups.resize(1);
    o.groups[0].hyper = {.lr = 0.05f};
    for (torch::Tensor& p : model->parameters()) {
      o.groups[0].params.push_back({binding->handle(p), binding->handle(p.grad())});
    }
    adam = unwrap(optim::Adam::create(*runtime, o));
  }
  ~Trained() {
    adam.reset();
    binding.reset();
  }

  // One step on fixed data; `set_to_none` clears gradients the way LibTorch's zero_grad() does by
  // default, else they are zeroed in place. Returns the loss, or throws the step's error.
  float step(bool set_to_none) {
    torch::manual_seed(11);
    // In the parameters' dtype: a module moved with to() computes in its new one.
    const torch::Tensor x = torch::randn({16, 8}).to(model->parameters()[0].scalar_type());
    const torch::Tensor y = x.sum(1, /*keepdim=*/true).tanh();
    model->zero_grad(set_to_none);
    check(runtime->begin_step());
    torch::Tensor loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    check(adam->step());
    check(runtime->end_step());
    return loss.item<float>();
  }
};

TEST(ModelChangesTest, ZeroGradSetToNoneKeepsTrainingAsZeroingInPlace) {
  Trained in_place("layer_prefetch"), to_none("layer_prefetch");
  std::vector<float> a, b;
  for (int i = 0; i < 8; ++i) {
    a.push_back(in_place.step(/*set_to_none=*/false));
    b.push_back(to_none.step(/*set_to_none=*/true));
  }
  EXPECT_EQ(a, b) << "clearing gradients with set_to_none changed the trajectory";
  EXPECT_LT(b.back(), b.front() * 0.9f) << "the loss did not go down: the step saw stale gradients";
  const auto pa = in_place.model->parameters(), pb = to_none.model->parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << i;
  // The new gradients were rebound: the parameters accumulate into strata's again.
  for (torch::Tensor& p : to_none.model->parameters()) {
    EXPECT_EQ(to_none.binding->handle(p.grad()), to_none.binding->handle(p.grad())) << "bound";
  }
}

// What a step throws, as text ("" when nothing).
template <typename F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(ModelChangesTest, AParameterLeftWithoutAGradientFailsTheStepNamingIt) {
  Trained t("keep_on_gpu");
  t.step(false);
  t.model->zero_grad(/*set_to_none=*/true);  // and no backward: no gradient at all
  check(t.runtime->begin_step());
  EXPECT_EQ(error_of([&] { check(t.adam->step()); }),
            "FAILED_PRECONDITION: Adam step failed before any kernel ran (nothing changed; it can "
            "be retried): parameter '0.weight' has no gradient: zero_grad(set_to_none=true) "
            "dropped the one strata holds and backward gave it none; strata steps every parameter "
            "it holds (torch would skip this one), so zero gradients in place (zero_grad(false)) "
            "or leave the parameter out of the optimizer");
  check(t.runtime->end_step());
}

TEST(ModelChangesTest, SetDataFailsTheNextStepNamingTheParameter) {
  Trained t("keep_on_gpu");
  t.step(false);
  torch::Tensor w = t.model->parameters()[2];  // 2.weight
  {
    torch::NoGradGuard no_grad;
    w.set_data(torch::zeros_like(w));
  }
  EXPECT_EQ(error_of([&] { t.step(false); }),
            "FAILED_PRECONDITION: Adam step failed before any kernel ran (nothing changed; it can "
            "be retried): parameter '2.weight' no longer uses the memory strata holds for it "
            "(set_data or module->to() gave it new storage), so the model computes with a copy "
            "the optimizer never steps; register the module with strata again");
  check(t.runtime->end_step());
}

TEST(ModelChangesTest, ModuleToFailsTheNextStepNamingTheParameter) {
  Trained t("bulk");
  t.step(false);
  t.model->to(torch::kFloat64);
  EXPECT_NE(error_of([&] { t.step(false); }).find("parameter '0.weight' no longer uses the memory"),
            std::string::npos);
  check(t.runtime->end_step());
}

TEST(ModelChangesTest, ABoundTensorCannotBeResized) {
  Trained t("keep_on_gpu");
  torch::Tensor w = t.model->parameters()[0];
  // The storage is marked not resizable: a resize would allocate through torch's allocator and
  // leave strata's copy behind, so torch itself refuses it.
  EXPECT_NE(error_of([&] {
              w.detach().resize_({100, 100});
            }).find("not resizable"),
            std::string::npos);
  EXPECT_EQ(w.sizes(), (std::vector<std::int64_t>{4, 8}));
  t.step(false);  // still trains
}

TEST(ModelChangesTest, RegisteringAModuleTwiceSaysWhereItIsRegistered) {
  Trained t("keep_on_gpu");
  EXPECT_EQ(error_of([&] { t.binding->register_module(*t.model); }),
            "ALREADY_EXISTS: cannot register '0.weight': its storage is already registered as "
            "'0.weight' with this TorchBinding");
}

}  // namespace
}  // namespace strata::bridge
