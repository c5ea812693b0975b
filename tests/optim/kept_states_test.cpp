// See Note [Undo in the host kernel] in optim/kept_states.h: every rule's host kernel, given
// StepTensor::keep, writes each state's bytes from before the step to the undo buffer, and steps
// exactly as it does without one. Over Adam (float32, bfloat16 and int8 moments, amsgrad) and
// Lion, float32 parameters that are their own master and bfloat16 ones with a master, tensors
// that are not whole pieces or blocks, split over threads.
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/stream_copy.h"
#include "base/thread_pool.h"
#include "gtest/gtest.h"
#include "optim/kept_states.h"
#include "optim/step_rule.h"

namespace strata::optim {
namespace {

using Bytes = std::vector<std::uint64_t>;  // 8-byte aligned storage

struct Case {
  std::string rule;
  rt::DType param;
  StateType moments;
  bool amsgrad;
};

// One parameter's buffers: the parameter (unless a float32 one, stepped as its own master), its
// gradient, and each declared state.
struct Tensor {
  std::int64_t numel = 0;
  Bytes param, grad;
  std::vector<Bytes> states;
  std::vector<std::size_t> state_bytes;
  std::vector<StateLayout> layouts;
  int master_at = -1;
};

Bytes bytes_for(std::size_t n) { return Bytes((n + 7) / 8, 0); }

Tensor make_tensor(const StepRule& rule, const Case& c, const AdamHyper& h, std::int64_t numel,
                   std::mt19937& rng) {
  Tensor t;
  t.numel = numel;
  std::normal_distribution<float> d(0.0f, 1.0f);
  const std::vector<StateDecl> decls = rule.states(h, c.param, rt::StepPlace::kHost, c.moments);
  std::vector<float> values(static_cast<std::size_t>(numel));
  for (float& v : values) v = d(rng);
  for (std::size_t k = 0; k < decls.size(); ++k) {
    const std::size_t bytes = static_cast<std::size_t>(state_bytes(decls[k], numel));
    t.states.push_back(bytes_for(bytes));
    t.state_bytes.push_back(bytes);
    t.layouts.push_back(decls[k].int8_blocks                     ? StateLayout::kInt8Blocks
                        : decls[k].dtype == rt::DType::kBFloat16 ? StateLayout::kBF16
                                                                 : StateLayout::kF32);
    if (decls[k].from_parameter) {
      t.master_at = static_cast<int>(k);
      std::memcpy(t.states[k].data(), values.data(), values.size() * sizeof(float));
    }
  }
  if (c.param == rt::DType::kBFloat16) {
    t.param = bytes_for(values.size() * 2);
    auto* p = reinterpret_cast<std::uint16_t*>(t.param.data());
    for (std::size_t i = 0; i < values.size(); ++i) p[i] = float_to_bf16(values[i]);
  }
  return t;
}

StepTensor step_tensor(Tensor& t, const Case& c, std::int64_t step) {
  StepTensor s;
  s.numel = t.numel;
  s.grad = t.grad.data();
  for (std::size_t k = 0; k < t.states.size(); ++k) s.states[k] = t.states[k].data();
  s.master = static_cast<float*>(s.states[t.master_at]);
  s.param = c.param == rt::DType::kFloat32 ? static_cast<void*>(s.master) : t.param.data();
  s.param_type = c.param == rt::DType::kFloat32 ? ElemType::kF32 : ElemType::kBF16;
  s.grad_type = s.param_type;
  s.state_type = c.moments;
  s.seed = 1234u + static_cast<std::uint32_t>(t.numel);
  s.step = step;
  return s;
}

void new_gradients(std::vector<Tensor>& model, const Case& c, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 0.1f);
  for (Tensor& t : model) {
    const std::size_t n = static_cast<std::size_t>(t.numel);
    if (c.param == rt::DType::kFloat32) {
      t.grad = bytes_for(n * 4);
      auto* g = reinterpret_cast<float*>(t.grad.data());
      for (std::size_t i = 0; i < n; ++i) g[i] = d(rng);
    } else {
      t.grad = bytes_for(n * 2);
      auto* g = reinterpret_cast<std::uint16_t*>(t.grad.data());
      for (std::size_t i = 0; i < n; ++i) g[i] = float_to_bf16(d(rng));
    }
  }
}

void step(const StepRule& rule, std::vector<Tensor>& model, const Case& c, const AdamHyper& h,
          std::int64_t n, std::vector<KeptStates>* keep, ThreadPool& pool) {
  std::vector<StepTensor> list;
  for (std::size_t i = 0; i < model.size(); ++i) {
    list.push_back(step_tensor(model[i], c, n));
    if (keep != nullptr) list.back().keep = &(*keep)[i];
  }
  rule.step_host(list.data(), list.size(), h, 0.5f, &pool);
}

std::string name(const Case& c) {
  return c.rule + " " + std::string(rt::dtype_name(c.param)) + " moments " +
         std::string(state_dtype_name(c.moments)) + (c.amsgrad ? " amsgrad" : "");
}

TEST(KeptStatesTest, HostKernelsKeepTheStatesAndStepTheSameBits) {
  const std::vector<Case> cases = {
      {"adam", rt::DType::kFloat32, StateType::kF32, false},
      {"adam", rt::DType::kBFloat16, StateType::kF32, false},
      {"adam", rt::DType::kFloat32, StateType::kF32, true},
      {"adam", rt::DType::kBFloat16, StateType::kBF16, false},
      {"adam", rt::DType::kFloat32, StateType::kI8, false},
      {"adam", rt::DType::kBFloat16, StateType::kI8, false},
      {"lion", rt::DType::kFloat32, StateType::kF32, false},
      {"lion", rt::DType::kBFloat16, StateType::kF32, false},
  };
  // Tensors of a few pieces and a part, one of exactly a piece, one shorter than an int8 block.
  const std::vector<std::int64_t> sizes = {3 * kKeepPiece + 777, kKeepPiece, 100, 70'001};
  ThreadPool pool(3);
  for (const Case& c : cases) {
    SCOPED_TRACE(name(c));
    absl::StatusOr<std::shared_ptr<const StepRule>> rule = make_step_rule(c.rule);
    ASSERT_TRUE(rule.ok());
    const AdamHyper h{.lr = 1e-3, .weight_decay = 0.01, .amsgrad = c.amsgrad};
    std::mt19937 rng(7);
    std::vector<Tensor> kept, plain;
    for (std::int64_t n : sizes) kept.push_back(make_tensor(**rule, c, h, n, rng));
    plain = kept;
    // Two steps to give every state values, then the step that keeps them.
    for (std::int64_t n = 1; n <= 3; ++n) {
      std::mt19937 grads(100 + static_cast<unsigned>(n));
      new_gradients(kept, c, grads);
      for (std::size_t i = 0; i < kept.size(); ++i) plain[i].grad = kept[i].grad;
      if (n < 3) {
        step(**rule, kept, c, h, n, nullptr, pool);
        step(**rule, plain, c, h, n, nullptr, pool);
        continue;
      }
      const std::vector<Tensor> before = kept;
      std::vector<std::vector<Bytes>> undo(kept.size());
      std::vector<KeptStates> keep(kept.size());
      for (std::size_t i = 0; i < kept.size(); ++i) {
        for (std::size_t k = 0; k < kept[i].states.size(); ++k) {
          undo[i].push_back(Bytes(kept[i].states[k].size(), 0xabababababababab));
          keep[i].states[keep[i].count++] = {kept[i].states[k].data(), undo[i][k].data(),
                                             kept[i].layouts[k]};
        }
      }
      step(**rule, kept, c, h, n, &keep, pool);
      step(**rule, plain, c, h, n, nullptr, pool);
      for (std::size_t i = 0; i < kept.size(); ++i) {
        SCOPED_TRACE("tensor of " + std::to_string(kept[i].numel));
        EXPECT_EQ(kept[i].param, plain[i].param);
        for (std::size_t k = 0; k < kept[i].states.size(); ++k) {
          const std::size_t b = kept[i].state_bytes[k];
          EXPECT_EQ(std::memcmp(kept[i].states[k].data(), plain[i].states[k].data(), b), 0)
              << "state " << k << " stepped differently with keep";
          EXPECT_EQ(std::memcmp(undo[i][k].data(), before[i].states[k].data(), b), 0)
              << "state " << k << " was not kept as it was";
          EXPECT_NE(std::memcmp(kept[i].states[k].data(), before[i].states[k].data(), b), 0)
              << "state " << k << " did not change: the test would not see a late keep";
        }
      }
    }
  }
}

TEST(KeptStatesTest, StreamCopyCopiesEveryAlignment) {
  std::vector<std::uint8_t> src(1000);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 7 + 3);
  for (std::size_t dst_at = 0; dst_at < 20; ++dst_at) {
    for (std::size_t src_at = 0; src_at < 3; ++src_at) {
      for (std::size_t bytes : {0, 1, 15, 16, 17, 63, 64, 65, 200, 900}) {
        std::vector<std::uint8_t> dst(1000, 0xee);
        stream_copy(dst.data() + dst_at, src.data() + src_at, bytes);
        for (std::size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= dst_at && i < dst_at + bytes;
          ASSERT_EQ(dst[i], inside ? src[i - dst_at + src_at] : 0xee)
              << "at " << i << ", copy of " << bytes << " to +" << dst_at << " from +" << src_at;
        }
      }
    }
  }
}

}  // namespace
}  // namespace strata::optim
