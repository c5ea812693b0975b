// The bad-input census of RELIABILITY.md at the LibTorch boundary: what TorchBinding refuses when
// a tensor or module is bound, each with its whole message (tests/census.h). The binding throws
// c10 errors whose message is "CODE: message" (bridge/status.h); the check reads the code back
// from it. Nothing changes: the runtime holds nothing after a refusal.
#include <string>

#include "bridge/grad_stats.h"
#include "bridge/status.h"
#include "bridge/torch_runtime.h"
#include "gtest/gtest.h"
#include "policies/builtin.h"
#include "tests/census.h"
#include "torch/torch.h"

namespace strata::bridge {
namespace {

using rt::Role;
using strata::testing::expect_refused;

// What fn threw, as the Status the binding turned into a c10 error; OK if it threw nothing.
template <typename F>
absl::Status thrown(F&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    for (auto code : {absl::StatusCode::kInvalidArgument, absl::StatusCode::kFailedPrecondition,
                      absl::StatusCode::kAlreadyExists, absl::StatusCode::kNotFound,
                      absl::StatusCode::kResourceExhausted}) {
      const std::string prefix = str_cat(absl::StatusCodeToString(code), ": ");
      if (what.rfind(prefix, 0) == 0) return absl::Status(code, what.substr(prefix.size()));
    }
    return absl::UnknownError(what);
  }
  return absl::OkStatus();
}

class BridgeCensusTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rt::RuntimeOptions options;
    options.policy = "keep_on_gpu";
    options.device = rt::DeviceKind::kSimulated;
    options.allocator.track_allocations = true;
    runtime_ = unwrap(rt::Runtime::create(std::move(options), policy::builtin_policies()));
    binding_ = std::make_unique<TorchBinding>(*runtime_);
  }
  void TearDown() override {
    binding_.reset();
    EXPECT_TRUE(runtime_->tensors().empty());
    EXPECT_TRUE(runtime_->allocator().leak_report().empty());
  }
  absl::Status bind(torch::Tensor t, const std::string& name) {
    return thrown([&] { binding_->register_tensor(t, name, 0, Role::kParameter); });
  }

  std::unique_ptr<rt::Runtime> runtime_;
  std::unique_ptr<TorchBinding> binding_;
};

TEST_F(BridgeCensusTest, TensorsItRefuses) {
  const auto invalid = absl::StatusCode::kInvalidArgument;
  expect_refused("bind a tensor on a device the kernel cannot read",
                 bind(torch::empty({4}, torch::Device(torch::kMeta)), "m"), invalid,
                 "cannot register 'm': strata takes CPU and CUDA tensors, not one on meta");
  expect_refused("bind an undefined tensor", bind(torch::Tensor(), "u"), invalid,
                 "cannot register 'u': the tensor is undefined");
  expect_refused("bind a dtype strata does not store",
                 bind(torch::zeros({4}, torch::kComplexFloat), "c"), invalid,
                 "cannot register 'c': unsupported dtype ComplexFloat; strata takes float32, "
                 "float16, bfloat16, float64, int64, int32 and uint8");
  expect_refused("bind a tensor that is not contiguous", bind(torch::zeros({4, 6}).t(), "t"),
                 invalid,
                 "cannot register 't': the tensor is not contiguous (sizes [6, 4], strides [1, "
                 "6]); register a contiguous one, e.g. t.contiguous()");
  expect_refused("bind a view of part of a storage", bind(torch::zeros({8}).slice(0, 2, 6), "v"),
                 invalid,
                 "cannot register 'v': the tensor is a view of part of its storage (offset 2 "
                 "elements, 16 of 32 bytes); register a tensor that owns its storage, e.g. "
                 "t.clone()");
  torch::Tensor once = torch::zeros({4});
  ASSERT_TRUE(bind(once, "once").ok());
  expect_refused("bind a storage twice", bind(once.view({2, 2}), "again"),
                 absl::StatusCode::kAlreadyExists,
                 "cannot register 'again': its storage is already registered as 'once'");
  binding_->unregister(once);
  expect_refused("unregister a tensor not bound", thrown([&] {
                   torch::Tensor stray = torch::zeros({3});
                   binding_->unregister(stray);
                 }),
                 absl::StatusCode::kNotFound,
                 "cannot unregister Float [3] on cpu: not registered with this TorchBinding");
}

TEST_F(BridgeCensusTest, ModulesItRefuses) {
  torch::nn::Sequential model(torch::nn::Linear(3, 2), torch::nn::Linear(2, 1));
  expect_refused("register_module with a name it does not have", thrown([&] {
                   binding_->register_module(*model, {{{"0.weight", "9.bias"}}});
                 }),
                 absl::StatusCode::kInvalidArgument,
                 "register_module: no parameter named '9.bias' (group 0); the module's parameters "
                 "are 0.weight, 0.bias, 1.weight, 1.bias");
  expect_refused("register_module with a name in two groups", thrown([&] {
                   binding_->register_module(*model, {{{"0.weight"}, {"0.weight"}}});
                 }),
                 absl::StatusCode::kInvalidArgument,
                 "register_module: parameter '0.weight' is in group 0 and in group 1");
  expect_refused("register_gradients before they exist",
                 thrown([&] { binding_->register_gradients(*model); }),
                 absl::StatusCode::kFailedPrecondition,
                 "register_gradients: parameter '0.weight' has no gradient; run a backward pass "
                 "(or set its .grad()) first");
}

// Gradient clipping's and loss scaling's layer-by-layer totals (bridge/grad_stats.h).
TEST(GradientStatsCensusTest, MisuseSaysWhatWasExpected) {
  GradientStats stats;
  expect_refused("gradient totals before any layer was added",
                 thrown([&] { (void)stats.total_norm(); }), absl::StatusCode::kFailedPrecondition,
                 "GradientStats: no layer's gradients were added this step (add_layer after "
                 "each layer's backward)");
  stats.add_layer(3, {torch::ones({4})});
  expect_refused("a layer's gradients added twice in one step",
                 thrown([&] { stats.add_layer(3, {torch::ones({4})}); }),
                 absl::StatusCode::kFailedPrecondition,
                 "GradientStats: layer 3 was added twice in one step; reset() between steps");
  EXPECT_FLOAT_EQ(stats.total_norm().item<float>(), 2.0f);
  expect_refused("found_inf without the inf check (Note [Opt-in inf check])",
                 thrown([&] { (void)stats.found_inf(); }), absl::StatusCode::kFailedPrecondition,
                 "GradientStats: found_inf needs set_check_non_finite(true) before the step's "
                 "layers are added; 0 of 1 layers were checked");
}

}  // namespace
}  // namespace strata::bridge
