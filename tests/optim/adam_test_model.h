// tests/optim/adam_test_model.h: the model the Adam suites train through the runtime (four layers
// of float32 parameters of odd sizes, two parameter groups), its initial values and gradients (from
// LibTorch's generator), and a few steps of it, shared by adam_test.cpp and
// adam_checkpoint_test.cpp.
//
// Example:
//   rt::Runtime runtime = make_runtime("layer_prefetch");
//   Model m = register_model(runtime, initial_values());
//   Adam adam = *Adam::create(runtime, options_for(m, /*decoupled=*/true, /*amsgrad=*/false));
//   run_steps(runtime, adam, m, 5);
#pragma once

#include <torch/torch.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "gtest/gtest.h"
#include "optim/adam.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::optim::adam_testing {

using rt::Role;
using rt::RoleSet;
using rt::TensorHandle;
using rt::Tier;
using rt::testing::make_runtime;
using rt::testing::read_all;
using rt::testing::spec;

inline constexpr int kLayers = 4;
inline constexpr std::size_t kNumel[kLayers] = {257, 1000, 3, 4096};

struct Model {
  std::vector<TensorHandle> params, grads;
};

inline Model register_model(rt::Runtime& runtime, const std::vector<std::vector<float>>& init) {
  Model m;
  for (int l = 0; l < kLayers; ++l) {
    m.params.push_back(*runtime.register_tensor(
        spec(str_cat("l", l, ".w"), l, Role::kParameter, kNumel[l]), init[l].data()));
    m.grads.push_back(
        *runtime.register_tensor(spec(str_cat("l", l, ".w.grad"), l, Role::kGradient, kNumel[l])));
  }
  return m;
}

inline std::vector<std::vector<float>> initial_values() {
  std::vector<std::vector<float>> out;
  for (int l = 0; l < kLayers; ++l) {
    torch::manual_seed(l);
    torch::Tensor t = torch::randn({static_cast<long>(kNumel[l])});
    out.emplace_back(t.data_ptr<float>(), t.data_ptr<float>() + kNumel[l]);
  }
  return out;
}

inline std::vector<float> gradient(int layer, int step) {
  torch::manual_seed(1000 * step + layer);
  torch::Tensor g = torch::randn({static_cast<long>(kNumel[layer])}) * 0.1;
  return {g.data_ptr<float>(), g.data_ptr<float>() + kNumel[layer]};
}

// Groups: layers 0-1 one set of hyperparameters, layers 2-3 another.
inline AdamOptions options_for(const Model& m, bool decoupled, bool amsgrad) {
  AdamOptions o;
  o.groups.resize(2);
  o.groups[0].hyper = {
      .lr = 1e-2f, .weight_decay = 0.05f, .decoupled = decoupled, .amsgrad = amsgrad};
  o.groups[1].hyper = {.lr = 3e-3f,
                       .beta1 = 0.8f,
                       .beta2 = 0.99f,
                       .eps = 1e-6f,
                       .weight_decay = 0.0f,
                       .decoupled = decoupled,
                       .amsgrad = amsgrad};
  for (int l = 0; l < kLayers; ++l)
    o.groups[l < 2 ? 0 : 1].params.push_back({m.params[l], m.grads[l]});
  return o;
}

inline void run_steps(rt::Runtime& runtime, Adam& adam, const Model& m, int steps) {
  for (int step = 1; step <= steps; ++step) {
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(runtime.write(m.grads[l], gradient(l, step).data()).ok());
    }
    ASSERT_TRUE(runtime.begin_step().ok());
    absl::Status s = adam.step();
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_TRUE(runtime.end_step().ok());
  }
}

inline std::vector<float> as_floats(rt::Runtime& runtime, TensorHandle h) {
  std::vector<unsigned char> raw = read_all(runtime, h);
  std::vector<float> out(raw.size() / 4);
  std::memcpy(out.data(), raw.data(), raw.size());
  return out;
}

// The parameters and optimizer states by name, as bytes.
inline std::map<std::string, std::vector<unsigned char>> states_of(rt::Runtime& runtime) {
  std::map<std::string, std::vector<unsigned char>> out;
  for (TensorHandle h : runtime.tensors()) {
    rt::TensorInfo i = *runtime.info(h);
    if (i.spec.role == Role::kOptimizerState || i.spec.role == Role::kParameter) {
      out[i.spec.name] = read_all(runtime, h);
    }
  }
  return out;
}

}  // namespace strata::optim::adam_testing
