// Adam with compressed moments (See Note [Compressed moments] in optim/state_codec.h): exact resume
// from a checkpoint and from a state dict's float32 values; bad state dtypes, amsgrad, mismatched
// checkpoints and state values refused with nothing changed; int8 moments in a quarter of the host
// memory.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "optim/adam.h"
#include "optim/state_codec.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::optim {
namespace {

// Adam over two layers on the simulated device, `steps` steps from step `from`, with the moments
// stored as `type`; returns every state and parameter's bytes.
using Bytes = std::map<std::string, std::vector<unsigned char>>;
struct Trainer {
  rt::testing::Made made;
  std::unique_ptr<Adam> adam;
  std::vector<rt::TensorHandle> params, grads;
  static constexpr std::size_t kNumel = 3000;

  Trainer(StateType type, const char* policy) {
    made = rt::testing::make_runtime(
        policy, {.prefetch_depth = 1, .roles = rt::RoleSet::optimizer_states()}, true);
    AdamOptions o;
    o.state_dtype = type;
    o.groups.push_back({.params = {}, .hyper = {.lr = 1e-2, .weight_decay = 0.01}});
    for (int l = 0; l < 2; ++l) {
      std::vector<std::uint16_t> w(kNumel);
      for (std::size_t i = 0; i < kNumel; ++i) {
        w[i] = float_to_bf16(0.01f * static_cast<float>((i * 13 + l) % 101) - 0.5f);
      }
      auto p =
          made.rt->register_tensor(rt::testing::spec(str_cat("l", l, ".w"), l, rt::Role::kParameter,
                                                     kNumel, rt::DType::kBFloat16),
                                   w.data());
      auto g = made.rt->register_tensor(rt::testing::spec(
          str_cat("l", l, ".g"), l, rt::Role::kGradient, kNumel, rt::DType::kBFloat16));
      EXPECT_TRUE(p.ok() && g.ok());
      params.push_back(*p);
      grads.push_back(*g);
      o.groups[0].params.push_back({*p, *g});
    }
    auto made_adam = Adam::create(*made.rt, o);
    EXPECT_TRUE(made_adam.ok()) << made_adam.status();
    if (made_adam.ok()) adam = std::move(*made_adam);
  }
  void train(int from, int steps) {
    rt::Runtime& runtime = *made.rt;
    std::vector<std::uint16_t> g(kNumel);
    for (int step = from; step < from + steps; ++step) {
      for (int l = 0; l < 2; ++l) {
        for (std::size_t i = 0; i < kNumel; ++i) {
          g[i] = float_to_bf16(0.003f * static_cast<float>((i + step * 7 + l) % 29) - 0.04f);
        }
        ASSERT_TRUE(runtime.write(grads[static_cast<std::size_t>(l)], g.data()).ok());
      }
      ASSERT_TRUE(runtime.begin_step().ok());
      for (int l = 0; l < 2; ++l) ASSERT_TRUE(runtime.before_forward(l).ok());
      for (int l = 1; l >= 0; --l) ASSERT_TRUE(runtime.after_backward(l).ok());
      ASSERT_TRUE(adam->step().ok());
      ASSERT_TRUE(runtime.end_step().ok());
    }
    ASSERT_TRUE(runtime.wait_all().ok());
  }
  Bytes bytes() {
    Bytes out;
    for (rt::TensorHandle h : made.rt->tensors()) {
      const std::string name = made.rt->info(h)->spec.name;
      if (name.find(".g") == std::string::npos) out[name] = rt::testing::read_all(*made.rt, h);
    }
    return out;
  }
};

TEST(CompressedStatesTest, ResumingFromACheckpointOrAStateDictIsExact) {
  for (StateType type : {StateType::kBF16, StateType::kI8}) {
    SCOPED_TRACE(state_dtype_name(type));
    Trainer whole(type, "layer_prefetch");
    whole.train(1, 6);
    // Stopped after 3 steps; resumed from the checkpoint in a new process's optimizer.
    Trainer first(type, "layer_prefetch");
    first.train(1, 3);
    std::stringstream file;
    ASSERT_TRUE(first.adam->save(file).ok());
    const Bytes at_three = first.bytes();
    // The model's parameters travel beside the optimizer's checkpoint; the state dict's values
    // (float32, decoded) too.
    std::vector<std::vector<std::pair<std::string, std::vector<float>>>> values;
    for (rt::TensorHandle p : first.params) values.push_back(*first.adam->read_state_values(p));
    {
      Trainer resumed(type, "bulk");
      for (std::size_t l = 0; l < 2; ++l) {
        const std::string name = str_cat("l", l, ".w");
        ASSERT_TRUE(resumed.made.rt->write(resumed.params[l], at_three.at(name).data()).ok());
      }
      ASSERT_TRUE(resumed.adam->load(file).ok());
      resumed.train(4, 3);
      EXPECT_EQ(resumed.bytes(), whole.bytes()) << "from the checkpoint";
    }
    Trainer from_dict(type, "keep_on_gpu");
    for (std::size_t l = 0; l < 2; ++l) {
      const std::string name = str_cat("l", l, ".w");
      ASSERT_TRUE(from_dict.made.rt->write(from_dict.params[l], at_three.at(name).data()).ok());
      ASSERT_TRUE(from_dict.adam->write_state_values(from_dict.params[l], values[l]).ok());
      ASSERT_TRUE(from_dict.adam->set_step_count_of(from_dict.params[l], 3).ok());
    }
    EXPECT_EQ(from_dict.bytes(), at_three) << "a state dict's float32 values load the same bytes";
    from_dict.train(4, 3);
    EXPECT_EQ(from_dict.bytes(), whole.bytes()) << "from the state dict";
  }
}

TEST(CompressedStatesTest, BadChoicesAndMismatchedStatesAreRefusedAndChangeNothing) {
  for (const char* bad : {"fp8", "int4", "", "Float32"}) {
    absl::StatusOr<StateType> t = parse_state_dtype(bad);
    ASSERT_FALSE(t.ok()) << bad;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find("float32, bfloat16 or int8"), std::string::npos);
  }
  // amsgrad keeps a third moment only float32 holds.
  {
    rt::testing::Made made = rt::testing::make_runtime("keep_on_gpu");
    auto p = made.rt->register_tensor(
        rt::testing::spec("w", 0, rt::Role::kParameter, 16, rt::DType::kFloat32));
    auto g = made.rt->register_tensor(
        rt::testing::spec("w.grad", 0, rt::Role::kGradient, 16, rt::DType::kFloat32));
    AdamOptions o;
    o.state_dtype = StateType::kI8;
    o.groups.push_back({.params = {{*p, *g}}, .hyper = {.amsgrad = true}});
    absl::StatusOr<std::unique_ptr<Adam>> adam = Adam::create(*made.rt, o);
    ASSERT_FALSE(adam.ok());
    EXPECT_NE(adam.status().message().find("amsgrad"), std::string::npos);
    EXPECT_EQ(made.rt->tensors().size(), 2u) << "no state registered";
  }
  // A checkpoint of int8 moments into float32 ones and back: refused, naming the fix.
  Trainer int8(StateType::kI8, "layer_prefetch");
  int8.train(1, 2);
  Trainer f32(StateType::kF32, "layer_prefetch");
  f32.train(1, 2);
  for (auto [from, into] : {std::pair{&int8, &f32}, std::pair{&f32, &int8}}) {
    std::stringstream file;
    ASSERT_TRUE(from->adam->save(file).ok());
    const Bytes before = into->bytes();
    absl::Status s = into->adam->load(file);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("state_dtype"), std::string::npos) << s;
    EXPECT_EQ(into->bytes(), before);
  }
  // State values of the wrong size, or under a name the parameter has no state of.
  const Bytes before = int8.bytes();
  std::vector<std::pair<std::string, std::vector<float>>> values = {
      {"exp_avg", std::vector<float>(Trainer::kNumel, 1.0f)},
      {"exp_avg_sq", std::vector<float>(Trainer::kNumel - 1, 1.0f)}};
  EXPECT_EQ(int8.adam->write_state_values(int8.params[0], values).code(),
            absl::StatusCode::kInvalidArgument);
  values[1] = {"max_exp_avg_sq", std::vector<float>(Trainer::kNumel, 1.0f)};
  EXPECT_EQ(int8.adam->write_state_values(int8.params[0], values).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(int8.bytes(), before);
}

// Host memory for the moments: an int8 moment takes 1.016 bytes an element, a float32 one 4 (3000
// elements end in a part block: 3.85x here, 3.94x for large tensors).
TEST(CompressedStatesTest, Int8MomentsTakeAQuarterOfTheHostMemory) {
  std::map<StateType, std::size_t> pinned;
  for (StateType type : {StateType::kF32, StateType::kI8}) {
    Trainer t(type, "layer_prefetch");
    std::size_t bytes = 0;
    for (rt::TensorHandle h : t.made.rt->tensors()) {
      const rt::TensorInfo info = *t.made.rt->info(h);
      if (info.spec.state == "exp_avg" || info.spec.state == "exp_avg_sq") bytes += info.bytes;
    }
    pinned[type] = bytes;
  }
  EXPECT_EQ(pinned[StateType::kI8],
            4 * static_cast<std::size_t>(int8_state_bytes(Trainer::kNumel)));
  EXPECT_GE(static_cast<double>(pinned[StateType::kF32]) / pinned[StateType::kI8], 3.8);
}

}  // namespace
}  // namespace strata::optim
