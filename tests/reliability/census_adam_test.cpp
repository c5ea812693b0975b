// The bad-input census of RELIABILITY.md for Adam: what create and set_lr refuse, a step after a
// tensor went away, and checkpoints that lie (See Note [Untrusted checkpoints] in
// optim/adam_checkpoint.cpp). Each check expects its whole message (tests/census.h) and that
// nothing changed: every tensor's bytes, the bytes live per tier, the step counters.
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "base/units.h"
#include "gtest/gtest.h"
#include "optim/adam.h"
#include "tests/census.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::optim {
namespace {

using rt::Role;
using rt::TensorHandle;
using rt::Tier;
using rt::testing::make_runtime;
using rt::testing::read_all;
using rt::testing::spec;
using strata::kMiB;
using strata::testing::expect_refused;
constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
constexpr auto kDataLoss = absl::StatusCode::kDataLoss;

// Every tensor's bytes and the live bytes per tier.
std::map<std::string, std::vector<unsigned char>> bytes_of(rt::Runtime& rt) {
  std::map<std::string, std::vector<unsigned char>> out;
  EXPECT_TRUE(rt.wait_all().ok());
  for (TensorHandle h : rt.tensors()) out[rt.info(h)->spec.name] = read_all(rt, h);
  for (Tier t : alloc::kAllTiers) {
    out[std::string(alloc::tier_name(t))] = {
        static_cast<unsigned char>(rt.allocator().stats(t).allocated_bytes.current % 251)};
  }
  return out;
}

class AdamCensusTest : public ::testing::Test {
 protected:
  void SetUp() override {
    made_ = make_runtime("keep_on_gpu", {}, false, 16 * kMiB);
    std::vector<float> values(1000);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.5f * i;
    w_ = *rt().register_tensor(spec("w", 0, Role::kParameter, 1000), values.data());
    g_ = *rt().register_tensor(spec("w.grad", 0, Role::kGradient, 1000), values.data());
    before_ = bytes_of(rt());
  }
  void TearDown() override {
    EXPECT_EQ(bytes_of(rt()), before_) << "a refused call changed something";
  }
  rt::Runtime& rt() { return *made_.rt; }
  absl::Status create(std::vector<std::pair<TensorHandle, TensorHandle>> params,
                      AdamHyper hyper = {}) {
    AdamOptions o;
    o.groups.push_back({.params = std::move(params), .hyper = hyper});
    return Adam::create(rt(), o).status();
  }
  // An Adam over w, stepped once; the census then compares against this state.
  std::unique_ptr<Adam> stepped_adam(AdamHyper hyper = {}) {
    AdamOptions o;
    o.groups.push_back({.params = {{w_, g_}}, .hyper = hyper});
    std::unique_ptr<Adam> adam = *Adam::create(rt(), o);
    EXPECT_TRUE(adam->step().ok());
    before_ = bytes_of(rt());
    return adam;
  }

  rt::testing::Made made_;
  TensorHandle w_, g_;
  std::map<std::string, std::vector<unsigned char>> before_;
};

TEST_F(AdamCensusTest, Create) {
  TensorHandle short_grad = *rt().register_tensor(spec("s.grad", 0, Role::kGradient, 999));
  TensorHandle dbl =
      *rt().register_tensor(spec("d", 0, Role::kParameter, 1000, rt::DType::kFloat64));
  TensorHandle half =
      *rt().register_tensor(spec("h", 0, Role::kParameter, 1000, rt::DType::kFloat16));
  TensorHandle bf16_grad =
      *rt().register_tensor(spec("b.grad", 0, Role::kGradient, 1000, rt::DType::kBFloat16));
  before_ = bytes_of(rt());
  expect_refused("Adam: a gradient whose shape differs", create({{w_, short_grad}}), kInvalid,
                 "Adam: gradient 's.grad' does not match parameter 'w' in shape or layer");
  expect_refused("Adam: a dtype it does not step", create({{dbl, g_}}), kInvalid,
                 "Adam: parameter 'd' is float64; Adam steps float32, bfloat16 and float16 "
                 "tensors");
  expect_refused("Adam: a gradient in another low-precision dtype than its parameter's",
                 create({{half, bf16_grad}}), kInvalid,
                 "Adam: gradient 'b.grad' is bfloat16 and its parameter 'h' float16; a gradient "
                 "is in its parameter's dtype or float32");
  expect_refused("Adam: a gradient of the wrong role", create({{w_, w_}}), kInvalid,
                 "Adam: gradient 'w' has role parameter, not gradient");
  expect_refused("Adam: a parameter listed twice", create({{w_, g_}, {w_, g_}}), kInvalid,
                 "Adam: parameter 'w' is listed twice");
  expect_refused("Adam: a parameter without gradient", create({{w_, TensorHandle{}}}), kInvalid,
                 "Adam: parameter 'w' has no gradient");
  expect_refused("Adam: an unregistered parameter", create({{TensorHandle{999}, g_}}),
                 absl::StatusCode::kNotFound, "tensor handle 999 is not registered");
  ASSERT_TRUE(rt().unregister(short_grad).ok());
  ASSERT_TRUE(rt().unregister(half).ok());
  before_ = bytes_of(rt());
}

TEST_F(AdamCensusTest, HyperparametersTorchWouldRefuse) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::tuple<std::string, AdamHyper, std::string>> cases = {
      {"Adam: a negative lr", {.lr = -0.1f}, "lr -0.1 is invalid; use a finite lr >= 0"},
      {"Adam: a NaN lr", {.lr = nan}, "lr nan is invalid; use a finite lr >= 0"},
      {"Adam: an infinite lr", {.lr = inf}, "lr inf is invalid; use a finite lr >= 0"},
      {"Adam: beta1 of 1", {.beta1 = 1.0f}, "beta1 1 is invalid; use 0 <= beta1 < 1"},
      {"Adam: a negative beta2", {.beta2 = -0.5f}, "beta2 -0.5 is invalid; use 0 <= beta2 < 1"},
      {"Adam: a NaN beta2", {.beta2 = nan}, "beta2 nan is invalid; use 0 <= beta2 < 1"},
      {"Adam: eps of 0", {.eps = 0.0f}, "eps 0 is invalid; use a finite eps > 0"},
      {"Adam: a negative weight decay",
       {.weight_decay = -1.0f},
       "weight_decay -1 is invalid; use a finite weight_decay >= 0"},
  };
  for (const auto& [name, hyper, message] : cases) {
    expect_refused(name, create({{w_, g_}}, hyper), kInvalid, str_cat("Adam: group 0: ", message));
  }
}

TEST_F(AdamCensusTest, ALayerLargerThanTheGpuBudget) {
  ASSERT_TRUE(rt().allocator().set_budget(Tier::kGpu, 2 * kMiB).ok());
  TensorHandle p = *rt().register_tensor(spec("p", 5, Role::kParameter, 160 * 1024));
  TensorHandle g = *rt().register_tensor(spec("p.grad", 5, Role::kGradient, 160 * 1024));
  before_ = bytes_of(rt());
  expect_refused("Adam: a layer larger than the GPU budget", create({{p, g}}),
                 absl::StatusCode::kResourceExhausted,
                 "Adam: layer 5 needs 2.50 MiB on the GPU for its step (parameters, gradients "
                 "and moments; the kernel reads GPU memory only), more than the GPU budget of "
                 "2.00 MiB");
  ASSERT_TRUE(rt().allocator().set_budget(Tier::kGpu, 16 * kMiB).ok());
  ASSERT_TRUE(rt().unregister(p).ok());
  ASSERT_TRUE(rt().unregister(g).ok());
  before_ = bytes_of(rt());
}

// A state name already taken fails create part way; the states it registered before are gone again
// (See Note [Adam owns its states]).
TEST_F(AdamCensusTest, AStateNameAlreadyTaken) {
  TensorHandle v = *rt().register_tensor(spec("v", 1, Role::kParameter, 10));
  TensorHandle vg = *rt().register_tensor(spec("v.grad", 1, Role::kGradient, 10));
  TensorHandle taken = *rt().register_tensor(spec("v.exp_avg_sq", 1, Role::kOther, 10));
  before_ = bytes_of(rt());
  expect_refused("Adam: a state name already taken", create({{w_, g_}, {v, vg}}),
                 absl::StatusCode::kAlreadyExists,
                 "register_tensor: a tensor named 'v.exp_avg_sq' is registered already");
  EXPECT_FALSE(rt().find("w.exp_avg").ok()) << "a state registered before the failure stayed";
  for (TensorHandle h : {v, vg, taken}) ASSERT_TRUE(rt().unregister(h).ok());
  before_ = bytes_of(rt());
}

TEST_F(AdamCensusTest, SetLrAndStep) {
  std::unique_ptr<Adam> adam = stepped_adam();
  expect_refused("Adam: set_lr of a group that does not exist", adam->set_lr(3, 0.1f), kInvalid,
                 "Adam: no parameter group 3");
  expect_refused("Adam: set_lr to NaN", adam->set_lr(0, std::nanf("")), kInvalid,
                 "Adam: group 0: lr nan is invalid; use a finite lr >= 0");
  const std::vector<TensorHandle> states = *adam->state(w_);
  ASSERT_TRUE(rt().unregister(states[1]).ok());
  before_ = bytes_of(rt());
  expect_refused("Adam: a step after a tensor was unregistered", adam->step(),
                 absl::StatusCode::kFailedPrecondition,
                 "Adam: tensor 'w.exp_avg_sq' (layer 0) was unregistered after the optimizer was "
                 "made");
  EXPECT_EQ(adam->step_count(0), 1);
  // What skip_parameters and the per-parameter counts refuse (See Note [Per-parameter steps] in
  // optim/adam.h).
  expect_refused("Adam: skip_parameters naming a tensor that is not a parameter of it",
                 adam->skip_parameters({g_}), absl::StatusCode::kNotFound,
                 "Adam: handle " + std::to_string(g_.id) + " is not a parameter of this optimizer");
  EXPECT_FALSE(adam->skipped_this_step(w_)) << "a refused call skipped a parameter";
  expect_refused("Adam: a negative step count of one parameter", adam->set_step_count_of(w_, -1),
                 kInvalid, "Adam: parameter 'w': step count -1 is negative");
  EXPECT_EQ(*adam->step_count_of(w_), 1);
  std::stringstream out;
  expect_refused("Adam: a checkpoint once a state is gone", adam->save(out),
                 absl::StatusCode::kFailedPrecondition,
                 "Adam checkpoint: a state of parameter 'w.exp_avg_sq' was unregistered after the "
                 "optimizer was made; nothing to save");
  adam.reset();
  before_ = bytes_of(rt());
}

// The checkpoint format (adam_checkpoint.cpp): header 14 bytes, the state dtype (1 byte), group
// count, per group 51 bytes
// (step, five float64 hyperparameters, three flags), parameter count, per parameter its step,
// tensor count, then per tensor {name length, name, size, bytes}, then the checksum. The optimizer
// here has one parameter.
constexpr std::size_t kDTypeAt = 14;
constexpr std::size_t kGroupAt = 19;
constexpr std::size_t kFlagsAt = kGroupAt + 48;
constexpr std::size_t kParamsAt = kGroupAt + 51;
constexpr std::size_t kCountAt = kParamsAt + 4 + 8;

std::uint64_t fnv(const std::string& s, std::size_t n) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(s[i])) * 1099511628211ull;
  return h;
}

// A copy of `good` with `bytes` written at `at` and the checksum made right again, so the check
// that refuses it is the one about the field.
template <typename T>
std::string edited(const std::string& good, std::size_t at, T value) {
  std::string s = good;
  std::memcpy(s.data() + at, &value, sizeof(T));
  const std::uint64_t sum = fnv(s, s.size() - 8);
  std::memcpy(s.data() + s.size() - 8, &sum, 8);
  return s;
}

TEST_F(AdamCensusTest, CheckpointsThatLie) {
  std::unique_ptr<Adam> adam = stepped_adam();
  std::stringstream saved;
  ASSERT_TRUE(adam->save(saved).ok());
  const std::string good = saved.str();
  auto load = [&](const std::string& bytes) {
    std::stringstream in(bytes);
    return adam->load(in);
  };
  const std::string truncated = "Adam checkpoint is truncated or not a strata Adam checkpoint";
  expect_refused("Adam checkpoint: truncated", load(good.substr(0, good.size() / 2)), kDataLoss,
                 truncated);
  expect_refused("Adam checkpoint: not one at all", load("not a checkpoint at all"), kDataLoss,
                 truncated);
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x40;
  expect_refused("Adam checkpoint: a bad checksum", load(flipped), kDataLoss,
                 "Adam checkpoint: checksum mismatch (corrupt)");
  expect_refused("Adam checkpoint: another group count",
                 load(edited<std::uint32_t>(good, kDTypeAt + 1, 3)), kInvalid,
                 "Adam checkpoint has 3 parameter groups; this optimizer has 1");
  // See Note [Compressed moments] in optim/state_codec.h.
  expect_refused("Adam checkpoint: a state dtype strata does not know",
                 load(edited<std::uint8_t>(good, kDTypeAt, 9)), kDataLoss,
                 "Adam checkpoint is corrupt: state dtype 9 is none strata knows");
  expect_refused("Adam checkpoint: moments stored otherwise than the optimizer's",
                 load(edited<std::uint8_t>(good, kDTypeAt, 2)), kInvalid,
                 "Adam checkpoint holds int8 moments; this optimizer stores them as float32: make "
                 "it with state_dtype int8 to resume, or load a state dict in torch's format, "
                 "which converts");
  expect_refused("Adam checkpoint: a negative step counter",
                 load(edited<std::int64_t>(good, kGroupAt, -5)), kDataLoss,
                 "Adam checkpoint is corrupt: group 0 has a negative step counter");
  expect_refused("Adam checkpoint: a hyperparameter torch would refuse",
                 load(edited<double>(good, kGroupAt + 8, -1.0)), kInvalid,
                 "Adam checkpoint: Adam: group 0: lr -1 is invalid; use a finite lr >= 0");
  expect_refused("Adam checkpoint: a flag neither 0 nor 1",
                 load(edited<std::uint8_t>(good, kFlagsAt, 7)), kDataLoss,
                 "Adam checkpoint is corrupt: group 0 has a flag that is neither 0 nor 1");
  expect_refused("Adam checkpoint: amsgrad other than the optimizer's",
                 load(edited<std::uint8_t>(good, kFlagsAt + 1, 1)), kInvalid,
                 "Adam checkpoint: group 0 was saved with amsgrad on; this optimizer has it off");
  expect_refused("Adam checkpoint: a parameter count that lies",
                 load(edited<std::uint32_t>(good, kParamsAt, 7)), kInvalid,
                 "Adam checkpoint has 7 parameters; this optimizer has 1");
  expect_refused("Adam checkpoint: a negative step of one parameter",
                 load(edited<std::int64_t>(good, kParamsAt + 4, -2)), kDataLoss,
                 "Adam checkpoint is corrupt: parameter 0 has a negative step");
  expect_refused("Adam checkpoint: a state count that lies",
                 load(edited<std::uint32_t>(good, kCountAt, 0xFFFFFFFFu)), kInvalid,
                 "Adam checkpoint has 4294967295 state tensors; this optimizer has 2");
  expect_refused("Adam checkpoint: a name length that lies",
                 load(edited<std::uint32_t>(good, kCountAt + 4, 0x7FFFFFFFu)), kDataLoss,
                 "Adam checkpoint is corrupt: a state name of 2147483647 bytes");
  // The first state's name, "w.exp_avg", edited into one that is not registered, and into the
  // name of a registered tensor that is not one of the optimizer's states: a checkpoint must not
  // write either.
  const std::size_t name_at = kCountAt + 8;
  ASSERT_EQ(good.substr(name_at, 9), "w.exp_avg");
  expect_refused("Adam checkpoint: a state this optimizer does not have",
                 load(edited<char>(good, name_at + 1, '_')), kInvalid,
                 "Adam checkpoint has state 'w_exp_avg', which this optimizer does not");
  TensorHandle other = *rt().register_tensor(spec("w.notmine", 0, Role::kOther, 1000));
  before_ = bytes_of(rt());
  std::string names_other = good;
  names_other.replace(name_at, 9, "w.notmine");
  const std::uint64_t resealed = fnv(names_other, names_other.size() - 8);
  std::memcpy(names_other.data() + names_other.size() - 8, &resealed, 8);
  expect_refused("Adam checkpoint: a tensor that is not one of its states", load(names_other),
                 kInvalid, "Adam checkpoint has state 'w.notmine', which this optimizer does not");
  ASSERT_TRUE(rt().unregister(other).ok());
  before_ = bytes_of(rt());
  // A size other than the state's.
  expect_refused("Adam checkpoint: a state of another size",
                 load(edited<std::uint64_t>(good, name_at + 9, 8)), kInvalid,
                 "Adam checkpoint: state 'w.exp_avg' has 8 bytes; here it has 4000");
  // The second state named like the first.
  const std::size_t second = name_at + 9 + 8 + 4000;
  std::string twice = good;
  ASSERT_EQ(twice.substr(second, 4), std::string("\x0c\0\0\0", 4));  // "w.exp_avg_sq"
  twice.replace(second, 4 + 12, std::string("\x09\0\0\0", 4) + "w.exp_avg");
  const std::uint64_t sum = fnv(twice, twice.size() - 8);
  std::memcpy(twice.data() + twice.size() - 8, &sum, 8);
  expect_refused("Adam checkpoint: a state twice", load(twice), kInvalid,
                 "Adam checkpoint has state 'w.exp_avg' twice");
  EXPECT_EQ(adam->step_count(0), 1);
  adam.reset();
  before_ = bytes_of(rt());
}

}  // namespace
}  // namespace strata::optim
