// Compressed moments (See Note [Compressed moments] in optim/state_codec.h): the int8 and bfloat16
// encodings' round-trip error within their bounds, decoded moments encoding back to the same
// bytes, stochastic rounding unbiased and picking a neighbour only, a moment that should decay
// decaying; the host kernel stepping parameters exactly as float32 moments of the decoded values
// would, the same bits for every thread split; the CUDA kernel (Gpu*, label gpu) bitwise the host
// kernel; and through Adam: exact resume from a checkpoint and from a state dict's float32 values,
// and bad state dtypes, amsgrad, mismatched checkpoints and state values refused with nothing
// changed.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <vector>

#include "allocator/upstream.h"
#include "gtest/gtest.h"
#include "optim/adam.h"
#include "optim/adam_kernels.h"
#include "optim/state_codec.h"
#include "tests/runtime/runtime_test_util.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::optim {
namespace {

// Values over 20 binades, both signs (square: non-negative), with exact zeros here and there.
std::vector<float> spread(std::size_t n, std::uint64_t seed, bool square) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> e(-20.0f, 0.0f);
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float x = std::exp2(e(rng));
    out[i] = rng() % 37 == 0 ? 0.0f : (square || rng() % 2 ? x : -x);
  }
  return out;
}

std::size_t stored_bytes(StateType type, std::int64_t numel) {
  return static_cast<std::size_t>(type == StateType::kI8
                                      ? int8_state_bytes(numel)
                                      : numel * (type == StateType::kBF16 ? 2 : 4));
}

float block_absmax(const std::vector<float>& v, std::size_t i) {
  const std::size_t b0 = i / kStateBlock * kStateBlock;
  float a = 0.0f;
  for (std::size_t k = b0; k < std::min(v.size(), b0 + kStateBlock); ++k) a = absmax_of(a, v[k]);
  return a;
}

// The most an encoding to nearest may be off: half a gap (1/16 of the value for int8, 2^-8 for
// bfloat16), or half the smallest step below the small-float range (relative to the block's
// absmax: 2^-18 for exp_avg, 2^-34 for exp_avg_sq); stochastic rounding doubles both. The slack
// covers the division by the absmax and the multiplication back, rounded once each.
double bound(StateType type, bool square, float x, float absmax, bool stochastic) {
  const double k = (stochastic ? 2.0 : 1.0) * (1.0 + 1e-6);
  if (type == StateType::kBF16) return k * std::abs(x) * std::exp2(-8.0);
  return k * (std::abs(x) / 16.0 + absmax * std::exp2(square ? -34.0 : -18.0));
}

TEST(CompressedStatesTest, EncodingToNearestIsWithinHalfAGap) {
  for (StateType type : {StateType::kBF16, StateType::kI8}) {
    for (bool square : {false, true}) {
      for (std::int64_t n : {1, 255, 256, 257, 5000}) {
        const std::vector<float> x = spread(static_cast<std::size_t>(n), n, square);
        std::vector<unsigned char> stored(stored_bytes(type, n));
        std::vector<float> back(x.size());
        encode_moment(type, square, x.data(), n, stored.data());
        decode_moment(type, square, stored.data(), n, back.data());
        for (std::size_t i = 0; i < x.size(); ++i) {
          const float absmax = block_absmax(x, i);
          ASSERT_LE(std::abs(back[i] - x[i]), bound(type, square, x[i], absmax, false))
              << "type " << static_cast<int>(type) << " square " << square << " n " << n << " i "
              << i << " x " << x[i];
          if (square && x[i] > 0.0f) {
            ASSERT_GT(back[i], 0.0f) << "a nonzero exp_avg_sq never decodes to zero";
          }
          if (x[i] == 0.0f) {
            ASSERT_EQ(back[i], 0.0f);
          }
        }
        // Decoded values encode back to the same bytes.
        std::vector<unsigned char> again(stored.size());
        encode_moment(type, square, back.data(), n, again.data());
        ASSERT_EQ(again, stored) << "type " << static_cast<int>(type) << " square " << square;
      }
    }
  }
}

// The random bits are part of what a checkpoint resumes (See Note [Compressed moments]): these
// values were drawn before the hash was split into a key a block and a mix an element, and every
// later version must draw them again; state_key and state_mix compose to the same function.
TEST(CompressedStatesTest, TheRandomBitsAreTheSameInEveryVersion) {
  struct Draw {
    std::uint32_t seed;
    std::int64_t step, i;
    std::uint32_t stream, bits;
  };
  constexpr Draw kDraws[] = {{0u, 1, 0, 0, 0x9BB31115u},
                             {305441741u, 7, 255, 1, 0x60430815u},
                             {42u, 1000, 70001, 0, 0x287E3A00u},
                             {42u, 1000, 70001, 1, 0x595CB7A7u},
                             {3735928559u, 3, (std::int64_t{1} << 32) + 5, 0, 0x3EE9AB99u},
                             {3735928559u, 3, (std::int64_t{1} << 33) + 511, 1, 0xC619430Fu}};
  for (const Draw& d : kDraws) {
    EXPECT_EQ(state_random_bits(d.seed, d.step, d.i, d.stream), d.bits) << d.i;
    const auto u = static_cast<std::uint64_t>(d.i);
    EXPECT_EQ(state_mix(static_cast<std::uint32_t>(u),
                        state_key(d.seed, d.step, static_cast<std::uint32_t>(u >> 32), d.stream)),
              d.bits);
  }
}

TEST(CompressedStatesTest, StochasticRoundingPicksANeighbourAndIsUnbiased) {
  constexpr int kDraws = 40000;
  std::mt19937_64 rng(5);
  // int8: values between codes, across the normal and the small range, both maps.
  for (float y : {0.7f, 0.3141f, 0.01f, 3.0e-5f, 2.0e-6f}) {
    for (bool square : {false, true}) {
      const std::uint32_t down = square ? encode_exp_avg_sq(y, 0) : encode_exp_avg(y, 0);
      const float lo = square ? decode_exp_avg_sq(down) : decode_exp_avg(down);
      const float hi = square ? decode_exp_avg_sq(down + 1) : decode_exp_avg(down + 1);
      ASSERT_LE(lo, y);
      ASSERT_GT(hi, y);
      double sum = 0;
      for (int d = 0; d < kDraws; ++d) {
        const auto r = static_cast<std::uint32_t>(rng());
        const float got = square ? decode_exp_avg_sq(encode_exp_avg_sq(y, r))
                                 : decode_exp_avg(encode_exp_avg(y, r));
        ASSERT_TRUE(got == lo || got == hi) << y;
        sum += got;
      }
      // The mean's standard error is at most half a gap over sqrt(kDraws).
      EXPECT_NEAR(sum / kDraws, y, 4 * (hi - lo) / (2 * std::sqrt(kDraws))) << y << " " << square;
    }
  }
  // bfloat16.
  for (float y : {0.2497f, -1.0e-3f, 3.3e-9f}) {
    const float lo = bf16_to_float(float_to_bf16_stochastic(y, 0));
    const float hi = bf16_to_float(float_to_bf16_stochastic(y, 0xffff));
    double sum = 0;
    for (int d = 0; d < kDraws; ++d) {
      const float got =
          bf16_to_float(float_to_bf16_stochastic(y, static_cast<std::uint32_t>(rng())));
      ASSERT_TRUE(got == lo || got == hi) << y;
      sum += got;
    }
    EXPECT_NEAR(sum / kDraws, y, 4 * std::abs(hi - lo) / (2 * std::sqrt(kDraws))) << y;
  }
}

// One tensor of each kind the kernel takes, with its buffers.
struct Host {
  std::int64_t n;
  ElemType param_type, grad_type;
  StateType state;
  std::vector<unsigned char> param, grad, m, v;
  std::vector<float> master;

  Host(std::int64_t numel, ElemType p, ElemType g, StateType s, std::uint64_t seed)
      : n(numel), param_type(p), grad_type(g), state(s) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> d(0.0f, 1.0f);
    param.resize(static_cast<std::size_t>(n) * elem_size(p));
    grad.resize(static_cast<std::size_t>(n) * elem_size(g));
    if (p != ElemType::kF32) master.resize(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      const float w = d(rng);
      store_elem(param.data(), p, i, w);
      if (!master.empty()) master[static_cast<std::size_t>(i)] = load_elem(param.data(), p, i);
    }
    std::vector<float> m0(static_cast<std::size_t>(n)), v0(m0.size());
    for (std::size_t i = 0; i < m0.size(); ++i) {
      m0[i] = d(rng) * 0.01f * (i % 97 == 0 ? 100.0f : 1.0f);
      v0[i] = std::abs(d(rng)) * 1e-4f;
    }
    m.resize(stored_bytes(s, n));
    v.resize(m.size());
    encode_moment(s, false, m0.data(), n, m.data());
    encode_moment(s, true, v0.data(), n, v.data());
  }
  void new_gradients(std::mt19937_64& rng) {
    std::normal_distribution<float> d(0.0f, 0.05f);
    for (std::int64_t i = 0; i < n; ++i) store_elem(grad.data(), grad_type, i, d(rng));
  }
  AdamTensor tensor(std::int64_t step) {
    AdamTensor t;
    t.param = param.data();
    t.grad = grad.data();
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.master = master.empty() ? nullptr : master.data();
    t.numel = n;
    t.param_type = param_type;
    t.grad_type = grad_type;
    t.state_type = state;
    t.seed = static_cast<std::uint32_t>(n * 2654435761u);
    t.step = step;
    return t;
  }
  std::vector<float> moment(bool square) const {
    std::vector<float> out(static_cast<std::size_t>(n));
    decode_moment(state, square, (square ? v : m).data(), n, out.data());
    return out;
  }
};

struct Pair {
  ElemType p, g;
};
constexpr Pair kPairs[] = {{ElemType::kF32, ElemType::kF32},
                           {ElemType::kBF16, ElemType::kBF16},
                           {ElemType::kBF16, ElemType::kF32},
                           {ElemType::kF16, ElemType::kF16},
                           {ElemType::kF16, ElemType::kF32}};

// The parameters step exactly as float32 moments holding the decoded values step them (the update
// takes the moments before they are rounded), and the new moments decode within one gap of the
// float32 step's.
TEST(CompressedStatesTest, ParametersStepAsWithTheDecodedMomentsInFloat32) {
  ThreadPool pool(2);
  const AdamHyper h{.lr = 1e-2, .weight_decay = 0.01};
  for (StateType type : {StateType::kBF16, StateType::kI8}) {
    for (const Pair& pair : kPairs) {
      for (std::int64_t n : {1, 200, 256, 1000, 70001}) {
        Host c(n, pair.p, pair.g, type, 3);
        std::mt19937_64 rng(9);
        for (int step = 1; step <= 3; ++step) {
          c.new_gradients(rng);
          // The float32 twin: the same parameter, gradient and decoded moments.
          Host f = c;
          f.state = StateType::kF32;
          const std::vector<float> m0 = c.moment(false), v0 = c.moment(true);
          f.m.assign(reinterpret_cast<const unsigned char*>(m0.data()),
                     reinterpret_cast<const unsigned char*>(m0.data() + m0.size()));
          f.v.assign(reinterpret_cast<const unsigned char*>(v0.data()),
                     reinterpret_cast<const unsigned char*>(v0.data() + v0.size()));
          AdamTensor tc = c.tensor(step), tf = f.tensor(step);
          const AdamScalars s = adam_scalars(h, step);
          adam_step_cpu(&tc, 1, s, 0.5f, &pool);
          adam_step_cpu(&tf, 1, s, 0.5f, &pool);
          ASSERT_EQ(c.param, f.param) << n;
          ASSERT_EQ(c.master, f.master) << n;
          for (bool square : {false, true}) {
            const std::vector<float> got = c.moment(square);
            std::vector<float> want(got.size());
            std::memcpy(want.data(), (square ? f.v : f.m).data(), want.size() * sizeof(float));
            for (std::size_t i = 0; i < got.size(); ++i) {
              ASSERT_LE(std::abs(got[i] - want[i]),
                        bound(type, square, want[i], block_absmax(want, i), true))
                  << "type " << static_cast<int>(type) << " n " << n << " i " << i;
            }
          }
        }
      }
    }
  }
}

TEST(CompressedStatesTest, ThreadSplitsGiveTheSameBits) {
  const AdamHyper h{.lr = 3e-3, .weight_decay = 0.1};
  for (StateType type : {StateType::kBF16, StateType::kI8}) {
    std::vector<std::vector<Host>> runs;
    for (int threads : {0, 1, 3}) {
      std::vector<Host> xs;
      for (std::int64_t n : {70001, 3, 65537, 130000, 255}) {
        xs.emplace_back(n, ElemType::kBF16, ElemType::kF32, type, n);
      }
      std::mt19937_64 rng(4);
      std::unique_ptr<ThreadPool> pool =
          threads > 0 ? std::make_unique<ThreadPool>(threads) : nullptr;
      for (int step = 1; step <= 2; ++step) {
        std::vector<AdamTensor> ts;
        for (Host& x : xs) {
          x.new_gradients(rng);
          ts.push_back(x.tensor(step));
        }
        adam_step_cpu(ts.data(), ts.size(), adam_scalars(h, step), 1.0f, pool.get());
      }
      runs.push_back(std::move(xs));
    }
    for (std::size_t r = 1; r < runs.size(); ++r) {
      for (std::size_t k = 0; k < runs[0].size(); ++k) {
        EXPECT_EQ(runs[r][k].m, runs[0][k].m) << r << " " << k;
        EXPECT_EQ(runs[r][k].v, runs[0][k].v) << r << " " << k;
        EXPECT_EQ(runs[r][k].master, runs[0][k].master) << r << " " << k;
      }
    }
  }
}

// exp_avg_sq at beta2 = 0.999 decays by 1e-3 a step without gradients: below half a gap of either
// encoding, so rounding to nearest would hold it where it is. Stochastically rounded, the moments
// of a block whose first element keeps a gradient (its absmax stays) decay as float32's do.
TEST(CompressedStatesTest, AMomentWithoutGradientsDecays) {
  constexpr std::int64_t kN = 8 * kStateBlock;
  constexpr int kSteps = 500;
  const AdamHyper h{.lr = 0.0};
  for (StateType type : {StateType::kBF16, StateType::kI8}) {
    Host x(kN, ElemType::kF32, ElemType::kF32, type, 1);
    std::vector<float> v0(kN, 0.25f), zero(kN, 0.0f);
    for (std::int64_t b = 0; b < kN; b += kStateBlock) v0[static_cast<std::size_t>(b)] = 1.0f;
    encode_moment(type, true, v0.data(), kN, x.v.data());
    encode_moment(type, false, zero.data(), kN, x.m.data());
    std::vector<float> g(kN, 0.0f);
    for (std::int64_t b = 0; b < kN; b += kStateBlock) g[static_cast<std::size_t>(b)] = 1.0f;
    std::memcpy(x.grad.data(), g.data(), g.size() * sizeof(float));
    for (int step = 1; step <= kSteps; ++step) {
      AdamTensor t = x.tensor(step);
      adam_step_cpu(&t, 1, adam_scalars(h, step), 1.0f, nullptr);
    }
    const std::vector<float> v = x.moment(true);
    double sum = 0;
    int count = 0;
    for (std::int64_t i = 0; i < kN; ++i) {
      if (i % kStateBlock == 0) continue;
      sum += v[static_cast<std::size_t>(i)];
      ++count;
    }
    const double want = 0.25 * std::pow(0.999, kSteps);
    EXPECT_NEAR(sum / count, want, 0.05 * want) << "type " << static_cast<int>(type);
  }
}

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

#ifdef STRATA_HAS_CUDA
class GpuCompressedStatesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (alloc::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  }
};

// A device copy of `bytes` from host, `offset` bytes into its allocation (kept in `allocations`).
void* upload(const void* host, std::size_t bytes, std::vector<void*>& allocations,
             std::size_t offset = 0) {
  void* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, std::max<std::size_t>(bytes, 1) + offset), cudaSuccess);
  allocations.push_back(d);
  void* at = static_cast<unsigned char*>(d) + offset;
  EXPECT_EQ(cudaMemcpy(at, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  return at;
}

void download(void* host, const void* d, std::size_t bytes) {
  EXPECT_EQ(cudaMemcpy(host, d, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

// The CUDA kernel's bits are the host kernel's, given the device's bias corrections (See Note
// [Bias corrections from the device] in optim/adam_kernels.h): parameters, masters, codes and
// scales, over tensors that cross the kernel's chunks and end in part blocks, with a loss scale
// and a step found_inf skips; every kind of tensor also with its parameter and gradient one
// element off the alignment that lets the kernel load four elements at once.
TEST_F(GpuCompressedStatesTest, GpuKernelIsBitwiseTheHostKernel) {
  ThreadPool pool(3);
  const AdamHyper h{.lr = 1e-2, .weight_decay = 0.05};
  for (StateType type : {StateType::kBF16, StateType::kI8}) {
    std::vector<Host> cpu;
    std::vector<bool> off;  // the parameter and gradient one element past their allocation's start
    for (bool shifted : {false, true}) {
      for (const Pair& pair : kPairs) {
        for (std::int64_t n : {1, 300, 70001, 131072 + 77}) {
          cpu.emplace_back(n, pair.p, pair.g, type, n);
          off.push_back(shifted);
        }
      }
    }
    std::vector<Host> gpu = cpu;
    std::vector<std::array<void*, 5>> dev(cpu.size());
    std::vector<void*> allocations;
    for (std::size_t k = 0; k < cpu.size(); ++k) {
      Host& x = gpu[k];
      dev[k] = {
          upload(x.param.data(), x.param.size(), allocations, off[k] ? elem_size(x.param_type) : 0),
          upload(x.grad.data(), x.grad.size(), allocations, off[k] ? elem_size(x.grad_type) : 0),
          upload(x.m.data(), x.m.size(), allocations), upload(x.v.data(), x.v.size(), allocations),
          x.master.empty() ? nullptr : upload(x.master.data(), x.master.size() * 4, allocations)};
    }
    float* scalars = nullptr;  // grad_scale, found_inf, then 2 floats of bias corrections a tensor
    ASSERT_EQ(
        cudaMallocHost(reinterpret_cast<void**>(&scalars), (2 + 2 * cpu.size()) * sizeof(float)),
        cudaSuccess);
    std::int64_t* skipped = nullptr;
    ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&skipped), cpu.size() * sizeof(std::int64_t)),
              cudaSuccess);
    std::fill(skipped, skipped + cpu.size(), 0);
    std::vector<std::int64_t> host_skipped(cpu.size(), 0);
    std::mt19937_64 rng(12);
    for (int step = 1; step <= 4; ++step) {
      const bool inf = step == 2;
      scalars[0] = 256.0f;
      scalars[1] = inf ? 1.0f : 0.0f;
      std::vector<AdamTensor> host, device;
      std::vector<BiasRequest> requests;
      for (std::size_t k = 0; k < cpu.size(); ++k) {
        cpu[k].new_gradients(rng);
        ASSERT_EQ(
            cudaMemcpy(dev[k][1], cpu[k].grad.data(), cpu[k].grad.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
        AdamTensor t = cpu[k].tensor(step);
        t.skipped = &host_skipped[k];
        host.push_back(t);
        AdamTensor d = t;
        d.param = dev[k][0];
        d.grad = dev[k][1];
        d.exp_avg = dev[k][2];
        d.exp_avg_sq = dev[k][3];
        d.master = static_cast<float*>(dev[k][4]);
        d.skipped = skipped + k;
        device.push_back(d);
        requests.push_back({adam_scalars(h, 1), step - host_skipped[k]});
      }
      const AdamScalars s = adam_scalars(h, step);
      ASSERT_EQ(adam_step_cuda(device.data(), device.size(), s, scalars, scalars + 1, nullptr),
                cudaSuccess);
      ASSERT_EQ(adam_bias_corrections_cuda(requests.data(), static_cast<int>(requests.size()),
                                           scalars + 2, nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      if (inf) {
        adam_count_skipped_cpu(host.data(), host.size());
        continue;
      }
      for (std::size_t k = 0; k < host.size(); ++k) host[k].bias = scalars + 2 + 2 * k;
      adam_step_cpu(host.data(), host.size(), s, 1.0f / scalars[0], &pool);
    }
    for (std::size_t k = 0; k < cpu.size(); ++k) {
      const Host& want = cpu[k];
      Host got = want;
      download(got.param.data(), dev[k][0], got.param.size());
      download(got.m.data(), dev[k][2], got.m.size());
      download(got.v.data(), dev[k][3], got.v.size());
      if (!got.master.empty()) download(got.master.data(), dev[k][4], got.master.size() * 4);
      EXPECT_EQ(got.param, want.param) << "type " << static_cast<int>(type) << " tensor " << k;
      EXPECT_EQ(got.master, want.master) << "type " << static_cast<int>(type) << " tensor " << k;
      EXPECT_EQ(got.m, want.m) << "type " << static_cast<int>(type) << " tensor " << k;
      EXPECT_EQ(got.v, want.v) << "type " << static_cast<int>(type) << " tensor " << k;
      EXPECT_EQ(skipped[k], 1);
    }
    for (void* p : allocations) cudaFree(p);
    cudaFreeHost(scalars);
    cudaFreeHost(skipped);
  }
}
#endif

}  // namespace
}  // namespace strata::optim
