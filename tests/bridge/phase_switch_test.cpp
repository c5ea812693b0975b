// A bound model read while a phase switch has it offloaded (seed 001: verl saved a state_dict of
// offloaded parameters and met "Expects tensor to be on the compute device"): under every policy,
// every parameter reads its values through the binding, a torch::save of the module gives them,
// strata holds no GPU memory, and after reload_all the model computes bitwise as before. On the
// simulated device with CPU tensors, and (Gpu*, label gpu) with CUDA tensors, which address the
// pinned memory they are offloaded to.
#include <torch/torch.h>

#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include "allocator/upstream.h"
#include "bridge/status.h"
#include "bridge/torch_runtime.h"
#include "gtest/gtest.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

namespace strata::bridge {
namespace {

using rt::Role;
using rt::Tier;

bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor ca = a.cpu().contiguous();
  const torch::Tensor cb = b.cpu().contiguous();
  return ca.scalar_type() == cb.scalar_type() && ca.sizes() == cb.sizes() &&
         std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

torch::nn::Sequential small_model() {
  return torch::nn::Sequential(torch::nn::Linear(64, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 8));
}

std::unique_ptr<rt::Runtime> make_runtime(const std::string& policy, rt::DeviceKind device,
                                          std::size_t pinned_budget = alloc::kNoBudget) {
  rt::RuntimeOptions options;
  options.device = device;
  options.policy = policy;
  options.policy_config.roles = rt::RoleSet::all();
  options.allocator.budgets[alloc::tier_index(Tier::kPinnedHost)] = pinned_budget;
  return unwrap(rt::Runtime::create(std::move(options), policy::builtin_policies()));
}

// Binds a model, offloads it, reads it every way a user would, and brings it back.
void read_while_offloaded(const std::string& policy, rt::DeviceKind kind, torch::Device device) {
  SCOPED_TRACE(policy);
  std::unique_ptr<rt::Runtime> runtime = make_runtime(policy, kind);
  TorchBinding binding(*runtime);
  torch::nn::Sequential model = small_model();
  model->to(device);
  const torch::Tensor x = torch::randn({5, 64}, device);
  const torch::Tensor y = model->forward(x).cpu();
  std::map<std::string, torch::Tensor> before;
  for (const auto& p : model->named_parameters())
    before[p.key()] = p.value().detach().cpu().clone();
  // In the GPU tier to begin with (on the simulated device too, where CPU tensors address it).
  binding.register_module(*model, {}, Tier::kGpu);
  if (device.is_cuda()) torch::cuda::synchronize();

  check(runtime->offload_all());
  EXPECT_EQ(runtime->stats().gpu_reserved_bytes, 0);
  for (const auto& p : model->named_parameters()) {
    EXPECT_NE(unwrap(runtime->info(binding.handle(p.value()))).tier, Tier::kGpu) << p.key();
    EXPECT_TRUE(binding.is_accessible(p.value())) << p.key();
    EXPECT_TRUE(bitwise_equal(p.value(), before[p.key()])) << p.key();
  }
  // A checkpoint of the module taken while it is away, loaded into a fresh one.
  std::stringstream file;
  torch::save(model, file);
  torch::nn::Sequential loaded = small_model();
  torch::load(loaded, file);
  for (const auto& p : loaded->named_parameters()) {
    EXPECT_TRUE(bitwise_equal(p.value(), before[p.key()])) << p.key();
  }
  // No step while offloaded, with a message that says why.
  const absl::Status refused = runtime->begin_step();
  EXPECT_EQ(refused.message(),
            "begin_step: tensors are offloaded (offload_all); call reload_all first");

  check(runtime->reload_all());
  EXPECT_TRUE(bitwise_equal(model->forward(x), y));
}

TEST(BridgePhaseSwitchTest, AnOffloadedModelReadsRightUnderEveryPolicy) {
  torch::manual_seed(20261124);
  for (const char* policy : {"keep_on_gpu", "bulk", "layer_prefetch"}) {
    read_while_offloaded(policy, rt::DeviceKind::kSimulated, torch::kCPU);
  }
}

class GpuBridgePhaseSwitchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (alloc::cuda_device_count() == 0 || !torch::cuda::is_available()) {
      GTEST_SKIP() << "no GPU on this machine";
    }
    torch::manual_seed(20261124);
  }
};

TEST_F(GpuBridgePhaseSwitchTest, AnOffloadedCudaModelReadsRightUnderEveryPolicy) {
  for (const char* policy : {"keep_on_gpu", "bulk", "layer_prefetch"}) {
    read_while_offloaded(policy, rt::DeviceKind::kCuda, torch::kCUDA);
  }
}

// Where pinned memory has no room the data goes to pageable memory, which a CUDA tensor cannot
// address: the binding says so, typed access throws instead of reading stale data, the runtime
// still reads the values, and reload_all brings the tensor back.
TEST_F(GpuBridgePhaseSwitchTest, ACudaTensorSpilledToPageableMemorySaysItIsAway) {
  std::unique_ptr<rt::Runtime> runtime =
      make_runtime("keep_on_gpu", rt::DeviceKind::kCuda, /*pinned_budget=*/1 << 20);
  TorchBinding binding(*runtime);
  torch::Tensor t = torch::randn({1 << 20}, torch::kCUDA);  // 4 MiB, above the pinned budget
  const torch::Tensor expected = t.cpu();
  const rt::TensorHandle h = binding.register_tensor(t, "w", 0, Role::kParameter);
  torch::cuda::synchronize();
  check(runtime->offload_all());
  ASSERT_EQ(unwrap(runtime->info(h)).tier, Tier::kPageableHost);
  EXPECT_FALSE(binding.is_accessible(t));
  EXPECT_THROW((void)t.data_ptr<float>(), c10::Error);
  torch::Tensor read = torch::empty({1 << 20});
  check(runtime->read(h, read.data_ptr()));
  EXPECT_TRUE(bitwise_equal(read, expected));
  check(runtime->reload_all());
  EXPECT_TRUE(binding.is_accessible(t));
  EXPECT_TRUE(bitwise_equal(t, expected));
}

}  // namespace
}  // namespace strata::bridge
