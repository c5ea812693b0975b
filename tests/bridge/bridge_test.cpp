// Tests of the LibTorch bridge: Status <-> c10::Error at the boundary, dtype mapping, registering
// tensors and modules (values kept bit for bit, the tensor's data pointer following the runtime's
// copy through offload and reload), refusals with their exact messages, unregistering.
// Everything but the Gpu* tests runs on the CPU against the simulated device; the Gpu* tests need
// a GPU and run under the CTest label gpu.
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "allocator/upstream.h"
#include "bridge/status.h"
#include "bridge/torch_runtime.h"
#include "gtest/gtest.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"
#include "torch/torch.h"

namespace strata::bridge {
namespace {

using rt::Role;
using rt::Tier;

// Succeeds when fn throws a c10::Error (or a subclass) whose what() contains `expected`.
template <typename F>
::testing::AssertionResult throws_c10(F&& fn, std::string_view expected) {
  try {
    fn();
  } catch (const c10::Error& e) {
    if (std::string_view(e.what()).find(expected) != std::string_view::npos) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure()
           << "message '" << e.what_without_backtrace() << "' lacks '" << expected << "'";
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-c10 exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "nothing thrown (expected '" << expected << "')";
}

bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor ca = a.cpu().contiguous();
  const torch::Tensor cb = b.cpu().contiguous();
  return ca.scalar_type() == cb.scalar_type() && ca.sizes() == cb.sizes() &&
         std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

// Random values plus the ones a careless copy loses: NaN, +-Inf, -0 and a denormal.
torch::Tensor awkward_values(std::vector<std::int64_t> shape, torch::Device device = torch::kCPU) {
  torch::Tensor t = torch::randn(shape);
  float* p = t.data_ptr<float>();
  p[0] = std::numeric_limits<float>::quiet_NaN();
  p[1] = std::numeric_limits<float>::infinity();
  p[2] = -std::numeric_limits<float>::infinity();
  p[3] = -0.0f;
  p[4] = std::numeric_limits<float>::denorm_min();
  return t.to(device);
}

std::unique_ptr<rt::Runtime> make_runtime(const std::string& policy,
                                          rt::DeviceKind device = rt::DeviceKind::kSimulated) {
  rt::RuntimeOptions options;
  options.device = device;
  options.policy = policy;
  // bulk moves every role at a phase switch, not just optimizer states.
  options.policy_config.roles = rt::RoleSet::all();
  return unwrap(rt::Runtime::create(std::move(options), policy::builtin_policies()));
}

rt::TensorInfo info(rt::Runtime& runtime, rt::TensorHandle h) { return unwrap(runtime.info(h)); }

// The runtime's own copy of a tensor's values, read through the runtime.
torch::Tensor runtime_values(rt::Runtime& runtime, rt::TensorHandle h) {
  const rt::TensorInfo i = info(runtime, h);
  torch::Tensor out = torch::empty(i.spec.shape, torch::dtype(dtype_to_torch(i.spec.dtype)));
  check(runtime.read(h, out.data_ptr()));
  return out;
}

// --- Status <-> c10::Error ---

TEST(BridgeStatusTest, CheckThrowsTheStatusMessageWithItsCode) {
  EXPECT_NO_THROW(check(absl::OkStatus()));
  try {
    check(absl::InvalidArgumentError("x"));
    FAIL() << "nothing thrown";
  } catch (const c10::ValueError& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()), "INVALID_ARGUMENT: x");
    EXPECT_NE(std::string_view(e.what()).find("INVALID_ARGUMENT: x"), std::string_view::npos);
  }
  EXPECT_TRUE(
      throws_c10([] { check(absl::NotFoundError("no tensor 'w'")); }, "NOT_FOUND: no tensor 'w'"));
  EXPECT_THROW(check(absl::ResourceExhaustedError("gpu: out of memory")), c10::OutOfMemoryError);
  EXPECT_THROW(check(absl::UnimplementedError("later")), c10::NotImplementedError);
  EXPECT_THROW(check(absl::FailedPreconditionError("held")), c10::Error);
}

TEST(BridgeStatusTest, UnwrapReturnsTheValueOrThrows) {
  EXPECT_EQ(unwrap(absl::StatusOr<int>(3)), 3);
  EXPECT_EQ(*unwrap(absl::StatusOr<std::unique_ptr<int>>(std::make_unique<int>(4))), 4);
  EXPECT_TRUE(throws_c10([] { unwrap(absl::StatusOr<int>(absl::AlreadyExistsError("taken"))); },
                         "ALREADY_EXISTS: taken"));
}

TEST(BridgeStatusTest, CaptureExceptionsTurnsThrowsIntoInternalErrors) {
  const absl::Status torch_error = capture_exceptions([] { TORCH_CHECK(false, "boom"); });
  EXPECT_EQ(torch_error.code(), absl::StatusCode::kInternal);
  EXPECT_NE(std::string(torch_error.message()).find("boom"), std::string::npos);
  EXPECT_EQ(std::string(torch_error.message()).find("most recent call first"), std::string::npos)
      << "the C++ backtrace does not belong in a Status: " << torch_error;

  const absl::Status std_error = capture_exceptions([] { throw std::runtime_error("bad"); });
  EXPECT_EQ(std_error, absl::InternalError("exception: bad"));
  EXPECT_EQ(capture_exceptions([] { throw 7; }), absl::InternalError("unknown exception"));

  EXPECT_TRUE(capture_exceptions([] {}).ok());
  EXPECT_EQ(capture_exceptions([] { return absl::NotFoundError("n"); }), absl::NotFoundError("n"));
  const absl::StatusOr<int> value = capture_exceptions([] { return 5; });
  ASSERT_TRUE(value.ok());
  EXPECT_EQ(*value, 5);
  const absl::StatusOr<int> failed =
      capture_exceptions([]() -> int { throw std::logic_error("no value"); });
  EXPECT_EQ(failed.status(), absl::InternalError("exception: no value"));
}

// --- dtypes ---

TEST(BridgeDTypeTest, MapsEverySupportedDTypeBothWays) {
  const std::pair<c10::ScalarType, rt::DType> pairs[] = {
      {torch::kFloat32, rt::DType::kFloat32},   {torch::kFloat16, rt::DType::kFloat16},
      {torch::kBFloat16, rt::DType::kBFloat16}, {torch::kFloat64, rt::DType::kFloat64},
      {torch::kInt64, rt::DType::kInt64},       {torch::kInt32, rt::DType::kInt32},
      {torch::kUInt8, rt::DType::kUInt8}};
  for (const auto& [torch_type, dtype] : pairs) {
    EXPECT_EQ(unwrap(dtype_from_torch(torch_type)), dtype) << c10::toString(torch_type);
    EXPECT_EQ(dtype_to_torch(dtype), torch_type) << rt::dtype_name(dtype);
  }
  EXPECT_EQ(dtype_from_torch(torch::kComplexFloat).status(),
            absl::InvalidArgumentError("unsupported dtype ComplexFloat; strata takes float32, "
                                       "float16, bfloat16, float64, int64, int32 and uint8"));
  EXPECT_EQ(dtype_from_torch(torch::kBool).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(BridgeDTypeTest, AddressabilityFollowsTheDevice) {
  const c10::Device cpu(c10::kCPU);
  const c10::Device cuda(c10::kCUDA, 0);
  EXPECT_TRUE(is_addressable(cuda, Tier::kGpu, false));
  EXPECT_TRUE(is_addressable(cuda, Tier::kPinnedHost, false));
  EXPECT_FALSE(is_addressable(cuda, Tier::kPageableHost, false));
  EXPECT_FALSE(is_addressable(cpu, Tier::kGpu, false));
  EXPECT_TRUE(is_addressable(cpu, Tier::kGpu, true));
  EXPECT_TRUE(is_addressable(cpu, Tier::kPinnedHost, false));
  EXPECT_TRUE(is_addressable(cpu, Tier::kPageableHost, false));
  EXPECT_EQ(current_stream(cpu), nullptr);
}

// --- tensors ---

class BridgeTest : public ::testing::Test {
 protected:
  void use(const std::string& policy) {
    binding_.reset();
    runtime_ = make_runtime(policy);
    binding_ = std::make_unique<TorchBinding>(*runtime_);
  }
  void SetUp() override {
    torch::manual_seed(20261122);
    use("keep_on_gpu");
  }
  // The binding goes before the runtime it points into.
  void TearDown() override { binding_.reset(); }

  std::unique_ptr<rt::Runtime> runtime_;
  std::unique_ptr<TorchBinding> binding_;
};

TEST_F(BridgeTest, RegisterKeepsTheValuesAndPointsAtTheRuntimeCopy) {
  torch::Tensor t = awkward_values({64, 33});
  const torch::Tensor expected = t.clone();
  torch::Tensor alias = t.detach();  // shares the storage, so it follows too

  const rt::TensorHandle h = binding_->register_tensor(t, "w", 3, Role::kParameter);
  const rt::TensorInfo i = info(*runtime_, h);
  EXPECT_EQ(i.spec.name, "w");
  EXPECT_EQ(i.spec.layer, 3);
  EXPECT_EQ(i.spec.role, Role::kParameter);
  EXPECT_EQ(i.spec.dtype, rt::DType::kFloat32);
  EXPECT_EQ(i.spec.shape, (std::vector<std::int64_t>{64, 33}));
  EXPECT_EQ(t.data_ptr(), i.data);
  EXPECT_EQ(alias.data_ptr(), i.data);
  EXPECT_TRUE(bitwise_equal(t, expected));
  EXPECT_TRUE(bitwise_equal(runtime_values(*runtime_, h), expected));
  EXPECT_TRUE(binding_->is_accessible(t));
  EXPECT_EQ(binding_->handle(t), h);
  EXPECT_EQ(binding_->handle(alias), h);
  EXPECT_EQ(binding_->size(), 1u);

  // Torch now writes the runtime's copy.
  t.mul_(2);
  EXPECT_TRUE(bitwise_equal(runtime_values(*runtime_, h), expected * 2));
}

TEST_F(BridgeTest, HomeDefaultsToPinnedHostForACpuTensor) {
  use("bulk");
  torch::Tensor t = torch::randn({16});
  const rt::TensorHandle h = binding_->register_tensor(t, "m", 0, Role::kOptimizerState);
  EXPECT_EQ(info(*runtime_, h).spec.home, Tier::kPinnedHost);
  torch::Tensor g = torch::randn({16});
  const rt::TensorHandle hg = binding_->register_tensor(g, "g", 0, Role::kGradient, Tier::kGpu);
  EXPECT_EQ(info(*runtime_, hg).spec.home, Tier::kGpu);
}

TEST_F(BridgeTest, DataPointerFollowsOffloadAndReload) {
  use("bulk");
  torch::Tensor t = awkward_values({1000, 37});
  const torch::Tensor expected = t.clone();
  const torch::Tensor view = t.view({-1});
  const rt::TensorHandle h = binding_->register_tensor(t, "w", 0, Role::kParameter, Tier::kGpu);
  ASSERT_EQ(info(*runtime_, h).tier, Tier::kGpu);

  for (int cycle = 0; cycle < 3; ++cycle) {
    SCOPED_TRACE(cycle);
    void* on_gpu = t.data_ptr();
    check(runtime_->offload_all());
    rt::TensorInfo i = info(*runtime_, h);
    EXPECT_NE(i.tier, Tier::kGpu);
    EXPECT_EQ(t.data_ptr(), i.data);
    EXPECT_NE(t.data_ptr(), on_gpu);
    EXPECT_EQ(view.data_ptr(), i.data);
    EXPECT_TRUE(binding_->is_accessible(t));  // host memory
    EXPECT_TRUE(bitwise_equal(t, expected));

    check(runtime_->reload_all());
    i = info(*runtime_, h);
    EXPECT_EQ(i.tier, Tier::kGpu);
    EXPECT_EQ(t.data_ptr(), i.data);
    EXPECT_TRUE(binding_->is_accessible(t));  // simulated GPU memory is host memory
    EXPECT_TRUE(bitwise_equal(t, expected));
    EXPECT_TRUE(bitwise_equal(view.view({1000, 37}), expected));
  }
}

TEST_F(BridgeTest, ATensorDroppedByTheUserStillFollowsItsData) {
  use("bulk");
  torch::Tensor t = torch::randn({256});
  const torch::Tensor expected = t.clone();
  const rt::TensorHandle h = binding_->register_tensor(t, "w", 0, Role::kParameter, Tier::kGpu);
  torch::Tensor first_half = t.narrow(0, 0, 128);  // a view: it keeps the storage, not `t`
  t = torch::Tensor();
  check(runtime_->offload_all());
  check(runtime_->reload_all());
  EXPECT_EQ(first_half.data_ptr(), info(*runtime_, h).data);
  EXPECT_TRUE(bitwise_equal(first_half, expected.narrow(0, 0, 128)));
}

TEST_F(BridgeTest, RefusesUnsupportedDTypesAndLayoutsWithTheirMessages) {
  torch::Tensor complex = torch::randn({4}, torch::kComplexFloat);
  EXPECT_TRUE(throws_c10([&] { binding_->register_tensor(complex, "c", 0, Role::kOther); },
                         "INVALID_ARGUMENT: cannot register 'c': unsupported dtype ComplexFloat; "
                         "strata takes float32, float16, bfloat16, float64, int64, int32 and "
                         "uint8"));
  EXPECT_THROW(binding_->register_tensor(complex, "c", 0, Role::kOther), c10::ValueError);

  torch::Tensor transposed = torch::randn({4, 3}).t();
  EXPECT_TRUE(throws_c10([&] { binding_->register_tensor(transposed, "t", 0, Role::kOther); },
                         "INVALID_ARGUMENT: cannot register 't': the tensor is not contiguous "
                         "(sizes [3, 4], strides [1, 3]); register a contiguous one, e.g. "
                         "t.contiguous()"));

  torch::Tensor part = torch::randn({8}).narrow(0, 2, 4);
  EXPECT_TRUE(throws_c10([&] { binding_->register_tensor(part, "p", 0, Role::kOther); },
                         "INVALID_ARGUMENT: cannot register 'p': the tensor is a view of part of "
                         "its storage (offset 2 elements, 16 of 32 bytes)"));

  torch::Tensor undefined;
  EXPECT_TRUE(throws_c10([&] { binding_->register_tensor(undefined, "u", 0, Role::kOther); },
                         "INVALID_ARGUMENT: cannot register 'u': the tensor is undefined"));

  EXPECT_TRUE(runtime_->tensors().empty());
  EXPECT_EQ(binding_->size(), 0u);
}

TEST_F(BridgeTest, RefusesATensorRegisteredTwiceOrANameTaken) {
  torch::Tensor t = torch::randn({8});
  binding_->register_tensor(t, "w", 0, Role::kParameter);
  torch::Tensor alias = t.detach();
  EXPECT_TRUE(throws_c10([&] { binding_->register_tensor(alias, "w2", 0, Role::kParameter); },
                         "ALREADY_EXISTS: cannot register 'w2': its storage is already "
                         "registered as 'w'"));

  // A second binding of the same runtime (not how it is meant to be used) still sees that the
  // storage holds runtime memory.
  {
    TorchBinding other(*runtime_);
    EXPECT_TRUE(throws_c10([&] { other.register_tensor(alias, "w3", 0, Role::kParameter); },
                           "ALREADY_EXISTS: cannot register 'w3': its storage already belongs "
                           "to a strata runtime"));
  }

  torch::Tensor u = torch::randn({8});
  EXPECT_TRUE(throws_c10([&] { binding_->register_tensor(u, "w", 0, Role::kParameter); },
                         "ALREADY_EXISTS"));
  EXPECT_EQ(runtime_->tensors().size(), 1u);
}

TEST_F(BridgeTest, UnregisterLeavesNoData) {
  torch::Tensor t = torch::randn({32});
  torch::Tensor alias = t.detach();
  binding_->register_tensor(t, "w", 0, Role::kParameter);
  binding_->unregister(t);

  EXPECT_EQ(t.device(), torch::Device(torch::kCPU));
  EXPECT_EQ(t.sizes(), torch::IntArrayRef({32}));
  EXPECT_FALSE(binding_->is_accessible(t));
  EXPECT_TRUE(runtime_->tensors().empty());
  const std::string gone =
      "strata: tensor 'w' was unregistered and its data freed (unregister_keeping_values keeps "
      "the values)";
  EXPECT_TRUE(throws_c10([&] { (void)t.data_ptr(); }, gone));
  EXPECT_TRUE(throws_c10([&] { (void)t.sum(); }, gone));
  EXPECT_TRUE(throws_c10([&] { alias.mul_(2); }, gone));
  EXPECT_TRUE(throws_c10([&] { binding_->handle(t); },
                         "NOT_FOUND: no handle for Float [32] on cpu: not registered with this "
                         "TorchBinding"));
  EXPECT_TRUE(throws_c10([&] { binding_->unregister(t); }, "NOT_FOUND"));
  EXPECT_TRUE(throws_c10([&] { binding_->register_tensor(t, "w", 0, Role::kParameter); },
                         "FAILED_PRECONDITION: cannot register 'w': " + gone));
}

TEST_F(BridgeTest, UnregisterKeepingValuesGivesTheTensorBackToTorch) {
  use("bulk");
  torch::Tensor t = awkward_values({300});
  const torch::Tensor expected = t.clone();
  binding_->register_tensor(t, "w", 0, Role::kParameter, Tier::kGpu);
  check(runtime_->offload_all());
  binding_->unregister_keeping_values(t);

  EXPECT_TRUE(runtime_->tensors().empty());
  ASSERT_NE(t.storage().data(), nullptr);
  EXPECT_TRUE(bitwise_equal(t, expected));
  t.add_(1);  // an ordinary tensor again: writable and resizable
  t.resize_({600});
  EXPECT_EQ(t.numel(), 600);
}

TEST_F(BridgeTest, DestroyingTheBindingDetachesItsTensors) {
  torch::Tensor t = torch::randn({32});
  binding_->register_tensor(t, "w", 0, Role::kParameter);
  binding_.reset();
  EXPECT_EQ(runtime_->tensors().size(), 1u);  // the runtime still holds the data
  EXPECT_TRUE(throws_c10([&] { (void)t.sum(); },
                         "strata: the TorchBinding that bound tensor 'w' is gone; its data stays "
                         "with the runtime"));
}

// --- modules ---

struct Net : torch::nn::Module {
  Net() {
    fc = register_module("fc", torch::nn::Linear(3, 5));
    act = register_module("act", torch::nn::ReLU());
    scale = register_parameter("scale", torch::ones({5}));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::ReLU act{nullptr};
  torch::Tensor scale;
};

torch::nn::Sequential small_model() {
  return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
}

std::vector<std::string> names_of(rt::Runtime& runtime, const std::vector<rt::TensorHandle>& hs) {
  std::vector<std::string> out;
  for (rt::TensorHandle h : hs) out.push_back(info(runtime, h).spec.name);
  return out;
}

TEST_F(BridgeTest, RegisterModuleMakesOneLayerPerChild) {
  torch::nn::Sequential model = small_model();
  const torch::Tensor x = torch::randn({5, 4});
  const torch::Tensor y = model->forward(x);

  const std::vector<rt::TensorHandle> hs = binding_->register_module(*model);
  EXPECT_EQ(names_of(*runtime_, hs),
            (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));
  const std::vector<int> expected_layers = {0, 0, 2, 2};
  for (std::size_t i = 0; i < hs.size(); ++i) {
    const rt::TensorInfo in = info(*runtime_, hs[i]);
    EXPECT_EQ(in.spec.layer, expected_layers[i]) << in.spec.name;
    EXPECT_EQ(in.spec.role, Role::kParameter);
  }
  EXPECT_EQ(runtime_->layers(), (std::vector<int>{0, 2}));  // ReLU, layer 1, has none
  EXPECT_TRUE(runtime_->layer_tensors(1, rt::RoleSet::all()).empty());
  for (const auto& p : model->named_parameters()) {
    EXPECT_EQ(p.value().data_ptr(), info(*runtime_, binding_->handle(p.value())).data) << p.key();
  }
  EXPECT_TRUE(bitwise_equal(model->forward(x), y));
}

TEST_F(BridgeTest, ParametersOfTheModuleItselfGoAfterTheLastChild) {
  Net net;
  const std::vector<rt::TensorHandle> hs = binding_->register_module(net);
  EXPECT_EQ(names_of(*runtime_, hs), (std::vector<std::string>{"fc.weight", "fc.bias", "scale"}));
  EXPECT_EQ(info(*runtime_, binding_->handle(net.scale)).spec.layer, 2);
  EXPECT_EQ(runtime_->layers(), (std::vector<int>{0, 2}));
}

TEST_F(BridgeTest, RegisterModuleWithAGrouping) {
  torch::nn::Sequential model = small_model();
  const std::vector<rt::TensorHandle> hs =
      binding_->register_module(*model, {{{"2.weight", "2.bias"}, {"0.weight"}}});
  EXPECT_EQ(names_of(*runtime_, hs), (std::vector<std::string>{"2.weight", "2.bias", "0.weight"}));
  auto params = model->named_parameters();
  EXPECT_EQ(info(*runtime_, binding_->handle(params["2.weight"])).spec.layer, 0);
  EXPECT_EQ(info(*runtime_, binding_->handle(params["2.bias"])).spec.layer, 0);
  EXPECT_EQ(info(*runtime_, binding_->handle(params["0.weight"])).spec.layer, 1);
  // Named in no group: left to torch.
  EXPECT_FALSE(binding_->is_accessible(params["0.bias"]));
  EXPECT_THROW(binding_->handle(params["0.bias"]), c10::Error);
}

TEST_F(BridgeTest, RegisterModuleRefusesABadGroupingBeforeRegisteringAnything) {
  torch::nn::Sequential model = small_model();
  EXPECT_TRUE(throws_c10(
      [&] {
        binding_->register_module(*model, {{{"0.weight"}, {"nope"}}});
      },
      "INVALID_ARGUMENT: register_module: no parameter named 'nope' (group 1); "
      "the module's parameters are 0.weight, 0.bias, 2.weight, 2.bias"));
  EXPECT_TRUE(throws_c10(
      [&] {
        binding_->register_module(*model, {{{"0.weight"}, {"2.bias", "0.weight"}}});
      },
      "INVALID_ARGUMENT: register_module: parameter '0.weight' is in group 0 and in group 1"));
  EXPECT_TRUE(runtime_->tensors().empty());
  EXPECT_EQ(binding_->size(), 0u);
}

TEST_F(BridgeTest, RegisterModuleIsAllOrNothing) {
  torch::nn::Sequential model = small_model();
  std::vector<torch::Tensor> before;
  for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
  // The runtime already holds a tensor named like the third parameter.
  const rt::TensorSpec taken{.name = "2.weight", .dtype = rt::DType::kFloat32, .shape = {1}};
  const rt::TensorHandle other = unwrap(runtime_->register_tensor(taken));

  EXPECT_TRUE(throws_c10([&] { binding_->register_module(*model); }, "ALREADY_EXISTS"));
  EXPECT_EQ(runtime_->tensors(), std::vector<rt::TensorHandle>{other});
  EXPECT_EQ(binding_->size(), 0u);
  const std::vector<torch::Tensor> after = model->parameters();
  for (std::size_t i = 0; i < after.size(); ++i) {
    ASSERT_NE(after[i].storage().data(), nullptr) << i;
    EXPECT_TRUE(bitwise_equal(after[i], before[i])) << i;
  }
}

TEST_F(BridgeTest, RegisterGradientsFollowsTheParametersLayers) {
  torch::nn::Sequential model = small_model();
  EXPECT_TRUE(throws_c10([&] { binding_->register_gradients(*model); },
                         "FAILED_PRECONDITION: register_gradients: parameter '0.weight' has no "
                         "gradient"));
  EXPECT_TRUE(runtime_->tensors().empty());

  const torch::Tensor x = torch::randn({5, 4});
  model->forward(x).sum().backward();
  binding_->register_module(*model, {{{"2.weight", "2.bias"}, {"0.weight", "0.bias"}}});
  const std::vector<rt::TensorHandle> hs = binding_->register_gradients(*model);
  EXPECT_EQ(names_of(*runtime_, hs), (std::vector<std::string>{"0.weight.grad", "0.bias.grad",
                                                               "2.weight.grad", "2.bias.grad"}));
  for (const auto& p : model->named_parameters()) {
    const rt::TensorInfo g = info(*runtime_, binding_->handle(p.value().grad()));
    EXPECT_EQ(g.spec.role, Role::kGradient);
    EXPECT_EQ(g.spec.layer, info(*runtime_, binding_->handle(p.value())).spec.layer) << p.key();
  }

  // Autograd accumulates into the bound gradients in place.
  std::vector<torch::Tensor> once;
  for (const auto& p : model->parameters()) once.push_back(p.grad().clone());
  model->forward(x).sum().backward();
  const std::vector<torch::Tensor> params = model->parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const rt::TensorHandle h = binding_->handle(params[i].grad());
    EXPECT_EQ(params[i].grad().data_ptr(), info(*runtime_, h).data) << i;
    EXPECT_TRUE(torch::allclose(runtime_values(*runtime_, h), once[i] * 2)) << i;
  }
}

// --- on a GPU ---

class GpuBridgeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (alloc::cuda_device_count() == 0 || !torch::cuda::is_available()) {
      GTEST_SKIP() << "no GPU on this machine";
    }
    torch::manual_seed(20261122);
  }
};

TEST_F(GpuBridgeTest, CudaTensorFollowsOffloadAndReload) {
  std::unique_ptr<rt::Runtime> runtime = make_runtime("bulk", rt::DeviceKind::kCuda);
  TorchBinding binding(*runtime);
  torch::Tensor t = awkward_values({1 << 20}, torch::kCUDA);
  const torch::Tensor expected = t.cpu();
  // GPU arithmetic returns the canonical NaN, so results are compared with the same op on an
  // unbound copy, on the GPU.
  const torch::Tensor unbound = t.clone();

  const rt::TensorHandle h = binding.register_tensor(t, "w", 0, Role::kParameter);
  EXPECT_EQ(info(*runtime, h).tier, Tier::kGpu);
  EXPECT_EQ(t.data_ptr(), info(*runtime, h).data);
  EXPECT_TRUE(bitwise_equal(t, expected));

  torch::cuda::synchronize();
  check(runtime->offload_all());
  rt::TensorInfo i = info(*runtime, h);
  EXPECT_EQ(i.tier, Tier::kPinnedHost);
  EXPECT_EQ(t.data_ptr(), i.data);
  EXPECT_TRUE(binding.is_accessible(t));
  EXPECT_TRUE(bitwise_equal(runtime_values(*runtime, h), expected));
  // A kernel reads the pinned copy through unified addressing.
  EXPECT_TRUE(bitwise_equal(t * 1, unbound * 1));
  // And a copy to the host (cudaMemcpy from the pinned address) reads it too.
  EXPECT_TRUE(bitwise_equal(t, expected));

  check(runtime->reload_all());
  i = info(*runtime, h);
  EXPECT_EQ(i.tier, Tier::kGpu);
  EXPECT_EQ(t.data_ptr(), i.data);
  EXPECT_TRUE(bitwise_equal(t, expected));
  EXPECT_TRUE(bitwise_equal(t * 2, unbound * 2));
  torch::cuda::synchronize();
  binding.unregister(t);
  EXPECT_EQ(t.device(), torch::Device(torch::kCUDA, 0));
  EXPECT_TRUE(throws_c10([&] { (void)(t * 2); }, "strata: tensor 'w' was unregistered"));
}

TEST_F(GpuBridgeTest, CudaModuleWorksAfterAPhaseSwitch) {
  std::unique_ptr<rt::Runtime> runtime = make_runtime("bulk", rt::DeviceKind::kCuda);
  TorchBinding binding(*runtime);
  torch::nn::Sequential model = small_model();
  model->to(torch::kCUDA);
  const torch::Tensor x = torch::randn({5, 4}, torch::kCUDA);
  const torch::Tensor y = model->forward(x).cpu();

  binding.register_module(*model);
  torch::cuda::synchronize();
  check(runtime->offload_all());
  check(runtime->reload_all());
  EXPECT_TRUE(bitwise_equal(model->forward(x), y));
}

TEST_F(GpuBridgeTest, CpuTensorOnTheGpuTierIsNotAccessible) {
  std::unique_ptr<rt::Runtime> runtime = make_runtime("keep_on_gpu", rt::DeviceKind::kCuda);
  TorchBinding binding(*runtime);
  torch::Tensor t = awkward_values({4096});
  const torch::Tensor expected = t.clone();
  const rt::TensorHandle h = binding.register_tensor(t, "w", 0, Role::kParameter, Tier::kGpu);
  ASSERT_EQ(info(*runtime, h).tier, Tier::kGpu);
  EXPECT_FALSE(binding.is_accessible(t));
  EXPECT_EQ(t.storage().data(), nullptr);
  // Typed access checks; an untyped kernel would dereference the null pointer (see the Note).
  EXPECT_TRUE(throws_c10([&] { (void)t.data_ptr<float>(); }, "data is not allocated yet"));
  EXPECT_TRUE(bitwise_equal(runtime_values(*runtime, h), expected));

  binding.unregister_keeping_values(t);
  EXPECT_TRUE(bitwise_equal(t, expected));
}

TEST_F(GpuBridgeTest, CudaTensorNeedsARuntimeOnTheGpu) {
  std::unique_ptr<rt::Runtime> runtime = make_runtime("keep_on_gpu", rt::DeviceKind::kSimulated);
  TorchBinding binding(*runtime);
  torch::Tensor t = torch::randn({16}, torch::kCUDA);
  EXPECT_TRUE(throws_c10([&] { binding.register_tensor(t, "w", 0, Role::kParameter); },
                         "INVALID_ARGUMENT: cannot register 'w': a CUDA tensor needs a runtime on "
                         "a CUDA device; this runtime's GPU is simulated"));
  EXPECT_TRUE(runtime->tensors().empty());
}

}  // namespace
}  // namespace strata::bridge
