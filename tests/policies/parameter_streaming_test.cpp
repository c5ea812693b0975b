// Parameters and gradients streamed through forward and backward (layer_prefetch and bulk with
// every role) on the simulated device in deferred mode with copies completing at random: a small
// model trained through every hook must end bitwise as under keep_on_gpu, with the layers' backward
// passes in the reverse order of forward and out of it (See Note [Backward out of order] in
// policies/parameter_streaming.cpp); and which tier every tensor is on at each hook.
#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <string>

#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using testing::make_runtime;
using testing::read_all;
using testing::spec;
using testing::where;

// A small "model" trained through every hook with host functions on the compute stream standing in
// for kernels: forward sums each layer's parameters into an activation, backward writes gradients
// from parameters and the activation, the optimizer updates parameters and moments Adam-like.
// Addresses come from on_moved, as the bridge gets them, and are read when a kernel is queued, as
// torch reads them. Returns every tensor's bytes at the end.
//
// Backward: the first `roots` layers are parallel roots, like two embeddings summed into the first
// block: their backward passes run once the layer above them is done, the first root first (the
// layer forwarded before the block, which after_backward holds, last), and their after_backward
// runs only at the end, as attach's hooks and ModelHooks::finish_backward do for layers whose input
// needs no gradient. With `before_backward`, each layer's backward begins with that hook.
struct Backward {
  int roots = 0;
  bool before_backward = false;
  // Called after each step's end_step, with what that step left queued still pending.
  std::function<void(int step)> after_step;
};

std::map<std::string, std::vector<unsigned char>> train(Runtime& rt, SimulatedDevice& dev,
                                                        int layers, std::size_t n, int steps,
                                                        std::mt19937* jiggle_rng,
                                                        Backward backward = {}) {
  std::map<std::uint64_t, void*> addr;
  for (TensorHandle h : rt.tensors()) addr[h.id] = rt.info(h)->data;
  rt.add_on_moved([&addr](TensorHandle h, Tier, void* p) { addr[h.id] = p; });
  auto jiggle = [&] {
    if (jiggle_rng == nullptr) return;
    for (int i = (*jiggle_rng)() % 8; i > 0; --i) {
      dev.run_one(reinterpret_cast<StreamHandle>((*jiggle_rng)() % 4));
    }
  };
  auto f = [&](int layer, Role role) {
    return static_cast<float*>(addr[rt.layer_tensors(layer, RoleSet{role})[0].id]);
  };
  StreamHandle s = rt.compute_stream();
  auto act = std::make_shared<float>(0.0f);
  for (int step = 0; step < steps; ++step) {
    {
      absl::Status b = rt.begin_step();
      EXPECT_TRUE(b.ok()) << b;
    }
    EXPECT_TRUE(dev.enqueue_host(s, [act] { *act = 0.0f; }).ok());
    for (int l = 0; l < layers; ++l) {
      {
        absl::Status bf = rt.before_forward(l);
        EXPECT_TRUE(bf.ok()) << bf;
      }
      float* p = f(l, Role::kParameter);
      EXPECT_TRUE(dev.enqueue_host(s,
                                   [p, n, act] {
                                     for (std::size_t i = 0; i < n; ++i) *act += p[i] * 1e-3f;
                                   })
                      .ok());
      jiggle();
    }
    auto layer_backward = [&](int l) {
      if (backward.before_backward) {
        absl::Status bb = rt.before_backward(l);
        EXPECT_TRUE(bb.ok()) << bb;
      }
      float* p = f(l, Role::kParameter);
      float* g = f(l, Role::kGradient);
      EXPECT_TRUE(dev.enqueue_host(s,
                                   [p, g, n, act] {
                                     for (std::size_t i = 0; i < n; ++i) g[i] += p[i] * 0.5f + *act;
                                   })
                      .ok());
      jiggle();
    };
    auto after_backward = [&](int l) {
      absl::Status ab = rt.after_backward(l);
      EXPECT_TRUE(ab.ok()) << ab;
      jiggle();
    };
    for (int l = layers - 1; l >= backward.roots; --l) {
      layer_backward(l);
      after_backward(l);
    }
    for (int l = 0; l < backward.roots; ++l) layer_backward(l);
    for (int l = backward.roots - 1; l >= 0; --l) after_backward(l);
    EXPECT_TRUE(rt.begin_optimizer_step().ok());
    for (int l : rt.optimizer_layer_order()) {
      absl::StatusOr<std::vector<void*>> ptrs = rt.acquire_layer(l, RoleSet::all(), Tier::kGpu, s);
      EXPECT_TRUE(ptrs.ok()) << ptrs.status();
      if (!ptrs.ok()) return {};
      auto* p = static_cast<float*>((*ptrs)[0]);
      auto* g = static_cast<float*>((*ptrs)[1]);
      auto* m = static_cast<float*>((*ptrs)[2]);
      auto* v = static_cast<float*>((*ptrs)[3]);
      EXPECT_TRUE(dev.enqueue_host(s,
                                   [p, g, m, v, n] {
                                     for (std::size_t i = 0; i < n; ++i) {
                                       m[i] = 0.9f * m[i] + 0.1f * g[i];
                                       v[i] = 0.99f * v[i] + 0.01f * g[i] * g[i];
                                       p[i] -= 0.01f * m[i] / (std::sqrt(v[i]) + 1e-8f);
                                     }
                                   })
                      .ok());
      jiggle();
      EXPECT_TRUE(rt.release_layer(l, RoleSet::all(), s).ok());
      jiggle();
    }
    EXPECT_TRUE(rt.end_optimizer_step().ok());
    EXPECT_TRUE(rt.end_step().ok());
    jiggle();
    if (backward.after_step) backward.after_step(step);
  }
  dev.run_pending();
  EXPECT_TRUE(rt.wait_all().ok());
  std::map<std::string, std::vector<unsigned char>> out;
  for (TensorHandle h : rt.tensors()) out[rt.info(h)->spec.name] = read_all(rt, h);
  return out;
}

void register_trainable(Runtime& rt, int layers, std::size_t n) {
  for (int l = 0; l < layers; ++l) {
    std::vector<float> init(n);
    for (std::size_t i = 0; i < n; ++i)
      init[i] = 0.01f * static_cast<float>((i * 7 + l) % 13) - 0.05f;
    ASSERT_TRUE(
        rt.register_tensor(spec(str_cat("l", l, ".p"), l, Role::kParameter, n), init.data()).ok());
    ASSERT_TRUE(rt.register_tensor(spec(str_cat("l", l, ".g"), l, Role::kGradient, n)).ok());
    ASSERT_TRUE(rt.register_tensor(spec(str_cat("l", l, ".m"), l, Role::kOptimizerState, n)).ok());
    ASSERT_TRUE(rt.register_tensor(spec(str_cat("l", l, ".v"), l, Role::kOptimizerState, n)).ok());
  }
}

// where() of register_trainable's model with its first `resident` layers on the GPU (G) and the
// others in pinned memory (P).
std::string first_layers_on_gpu(int layers, int resident) {
  std::string out;
  for (int l = 0; l < layers; ++l) {
    for (int role = 0; role < 4; ++role) {
      if (!out.empty()) out += ' ';
      out += l < resident ? "G" : "P";
    }
  }
  return out;
}

TEST(ParameterStreamingTest, AModelLargerThanTheGpuBudgetTrainsLikeKeepOnGpu) {
  constexpr int kLayers = 16;
  // Floats per tensor: a layer is 2 MiB of all four roles, one GPU segment (the budget counts
  // whole segments).
  constexpr std::size_t kN = 128 * 1024;
  constexpr std::size_t kLayerBytes = 4 * kN * 4;
  auto [ref_rt, ref_dev] = make_runtime("keep_on_gpu");
  register_trainable(*ref_rt, kLayers, kN);
  const auto want = train(*ref_rt, *ref_dev, kLayers, kN, 4, nullptr);
  ASSERT_FALSE(want.empty());

  for (int depth : {0, 1, 2}) {
    const std::size_t budget = (depth + 1) * kLayerBytes;
    ASSERT_LT(budget, kLayers * kN * 4) << "the parameters alone must not fit";
    // keep_on_gpu cannot hold this model in the budget: the allocator's out-of-memory error.
    auto [small, small_dev] = make_runtime("keep_on_gpu", {}, false, budget);
    absl::Status oom;
    for (int l = 0; l < kLayers && oom.ok(); ++l) {
      oom = small->register_tensor(spec(str_cat("l", l, ".p"), l, Role::kParameter, kN)).status();
      if (oom.ok())
        oom = small->register_tensor(spec(str_cat("l", l, ".m"), l, Role::kOptimizerState, kN))
                  .status();
    }
    EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(std::string(oom.message()).find("out of memory in tier gpu"), std::string::npos);

    std::mt19937 rng(77 + depth);
    auto [rt, dev] =
        make_runtime("layer_prefetch", {.prefetch_depth = depth, .roles = RoleSet::all()},
                     /*deferred=*/true, budget);
    register_trainable(*rt, kLayers, kN);
    const auto got = train(*rt, *dev, kLayers, kN, 4, &rng);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, bytes] : want) {
      EXPECT_EQ(got.at(name), bytes) << name << " differs from keep_on_gpu at depth " << depth;
    }
    RuntimeStats st = rt->stats();
    EXPECT_LE(st.staged_peak_bytes, static_cast<std::int64_t>(budget)) << depth;
    EXPECT_EQ(rt->allocator().stats(Tier::kGpu).allocated_bytes.peak, 0) << depth;
  }

  // bulk with everything resting on the host: not even parameters and gradients fit, so the whole
  // step streams a layer at a time (See Note [Bulk over budget], third case).
  for (std::size_t layers_in_budget : {1, 3}) {
    const std::size_t budget = layers_in_budget * kLayerBytes;
    std::mt19937 rng(91 + layers_in_budget);
    auto [rt, dev] = make_runtime("bulk", {.roles = RoleSet::all(), .offload_after_step = true},
                                  /*deferred=*/true, budget);
    register_trainable(*rt, kLayers, kN);
    // At setup bulk tries bringing everything back, then parameters and gradients
    // (See Note [Bulk over budget]); what the steps then do is what is checked.
    {
      absl::Status p = rt->prepare();
      ASSERT_TRUE(p.ok()) << p;
    }
    rt->allocator().reset_peak_stats();
    const auto got = train(*rt, *dev, kLayers, kN, 4, &rng);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, bytes] : want) {
      EXPECT_EQ(got.at(name), bytes) << name << " differs from keep_on_gpu under bulk, budget "
                                     << layers_in_budget << " layers";
    }
    EXPECT_GT(rt->stats().staged_peak_bytes, 0) << "bulk did not stream";
    EXPECT_LE(rt->stats().staged_peak_bytes, static_cast<std::int64_t>(budget));
    EXPECT_EQ(rt->allocator().stats(Tier::kGpu).allocated_bytes.peak, 0)
        << "bulk brought part of the model back in bulk";
    std::string all_pinned = "P";
    for (int i = 1; i < 4 * kLayers; ++i) all_pinned += " P";
    EXPECT_EQ(where(*rt), all_pinned) << "everything rests on the host after a step";
  }
}

// Two or three parallel roots (embeddings summed into the first block) run their backward right
// after the block's, the one after_backward does not hold first (See Note [Backward out of order]
// in policies/parameter_streaming.cpp). With before_backward, every depth, with and without layers
// resident beside the ring, trains bitwise as keep_on_gpu does while copies complete at random.
// (Without it the first root's gradients were accumulated into its slot before the fetch arrived,
// which then overwrote them.)
TEST(ParameterStreamingTest, ParallelRootsWithBeforeBackwardTrainLikeKeepOnGpu) {
  constexpr int kLayers = 8;
  constexpr std::size_t kN = 128 * 1024;  // 2 MiB a layer of four roles, one GPU segment
  constexpr std::size_t kLayerBytes = 4 * kN * 4;
  for (int roots : {0, 2, 3}) {
    auto [ref_rt, ref_dev] = make_runtime("keep_on_gpu");
    register_trainable(*ref_rt, kLayers, kN);
    const Backward backward{.roots = roots, .before_backward = true};
    const auto want = train(*ref_rt, *ref_dev, kLayers, kN, 3, nullptr, backward);
    ASSERT_FALSE(want.empty());
    for (int depth : {0, 1, 2}) {
      // The ring alone, then the ring and two resident layers.
      for (std::size_t resident : {0, 2}) {
        const std::size_t budget = (depth + 1 + resident) * kLayerBytes;
        std::mt19937 rng(1000 + 100 * roots + 10 * depth + static_cast<int>(resident));
        auto [rt, dev] =
            make_runtime("layer_prefetch", {.prefetch_depth = depth, .roles = RoleSet::all()},
                         /*deferred=*/true, budget);
        dev->set_random_completion(rng());
        register_trainable(*rt, kLayers, kN);
        const auto got = train(*rt, *dev, kLayers, kN, 3, &rng, backward);
        ASSERT_EQ(got.size(), want.size());
        for (const auto& [name, bytes] : want) {
          EXPECT_EQ(got.at(name), bytes) << name << ": roots " << roots << ", depth " << depth
                                         << ", resident layers " << resident;
        }
        EXPECT_LE(rt->stats().staged_peak_bytes, static_cast<std::int64_t>(budget));
      }
    }
  }
}

// What the ring leaves of the budget holds whole layers, which then never stream
// (See Note [Resident layers] in policies/ring_plan.cpp); the numbers stay keep_on_gpu's.
TEST(ParameterStreamingTest, LayersThatFitBesideTheRingStayOnTheGpu) {
  constexpr int kLayers = 8;
  constexpr std::size_t kN = 256 * 1024;  // 1 MiB tensors: 4 MiB a layer, two per small segment
  constexpr std::size_t kLayerBytes = 4 * kN * 4;
  auto [ref_rt, ref_dev] = make_runtime("keep_on_gpu");
  register_trainable(*ref_rt, kLayers, kN);
  const auto want = train(*ref_rt, *ref_dev, kLayers, kN, 3, nullptr);
  ASSERT_FALSE(want.empty());

  std::int64_t streamed_h2d = 0;
  for (std::size_t resident_layers : {0, 2}) {
    std::mt19937 rng(5 + resident_layers);
    const std::size_t budget = (2 + resident_layers) * kLayerBytes;  // K = 1: a ring of two
    auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1, .roles = RoleSet::all()},
                                  /*deferred=*/true, budget);
    register_trainable(*rt, kLayers, kN);
    const auto got = train(*rt, *dev, kLayers, kN, 3, &rng);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, bytes] : want) {
      EXPECT_EQ(got.at(name), bytes) << name << " with " << resident_layers << " resident layers";
    }
    const std::string expected = first_layers_on_gpu(kLayers, static_cast<int>(resident_layers));
    EXPECT_EQ(where(*rt), expected) << resident_layers;
    const RuntimeStats st = rt->stats();
    EXPECT_LE(st.gpu_reserved_peak_bytes, static_cast<std::int64_t>(budget));
    if (resident_layers == 0) {
      streamed_h2d = st.migrated_bytes_h2d;
    } else {
      // Registration put everything in pinned memory, so the resident layers crossed the link
      // once, at the first step, and never again.
      const std::int64_t per_layer = streamed_h2d / kLayers;
      EXPECT_LT(st.migrated_bytes_h2d, streamed_h2d - per_layer) << "resident layers streamed";
    }
  }

  // bulk streaming the whole step keeps nothing resident: it moves everything to the host after
  // each step, so a resident layer would cross the link twice a step instead of once.
  std::mt19937 rng(17);
  auto [bulk, bulk_dev] =
      make_runtime("bulk", {.roles = RoleSet::all(), .offload_after_step = true},
                   /*deferred=*/true, 3 * kLayerBytes);
  register_trainable(*bulk, kLayers, kN);
  ASSERT_TRUE(bulk->prepare().ok());  // the ways that do not fit are tried here, at setup
  bulk->allocator().reset_peak_stats();
  const auto got = train(*bulk, *bulk_dev, kLayers, kN, 3, &rng);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, bytes] : want) EXPECT_EQ(got.at(name), bytes) << name << " under bulk";
  EXPECT_GT(bulk->stats().staged_peak_bytes, 0) << "bulk did not stream";
  EXPECT_EQ(bulk->allocator().stats(Tier::kGpu).allocated_bytes.peak, 0)
      << "bulk's streaming step kept layers in the main pool";
}

// Runtime::set_gpu_budget between steps (strata.optim's gpu_budget="auto"): a budget raised from
// the ring alone to the ring and two layers makes the first two layers resident at once
// (See Note [Resident layers]); the numbers stay keep_on_gpu's. It is refused during a step, below
// what strata holds, and at 0.
TEST(ParameterStreamingTest, ABudgetSetBetweenStepsMakesLayersResident) {
  constexpr int kLayers = 8;
  constexpr std::size_t kN = 256 * 1024;
  constexpr std::size_t kLayerBytes = 4 * kN * 4;
  auto [ref_rt, ref_dev] = make_runtime("keep_on_gpu");
  register_trainable(*ref_rt, kLayers, kN);
  const auto want = train(*ref_rt, *ref_dev, kLayers, kN, 3, nullptr);

  std::mt19937 rng(31);
  auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1, .roles = RoleSet::all()},
                                /*deferred=*/true, 2 * kLayerBytes);
  register_trainable(*rt, kLayers, kN);
  ASSERT_TRUE(rt->prepare().ok());
  const std::string streamed = where(*rt);
  EXPECT_EQ(streamed.find('G'), std::string::npos) << streamed;
  ASSERT_TRUE(rt->begin_step().ok());
  EXPECT_EQ(rt->set_gpu_budget(4 * kLayerBytes).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(rt->end_step().ok());
  EXPECT_EQ(rt->gpu_budget(), 2 * kLayerBytes);
  EXPECT_EQ(rt->set_gpu_budget(0).code(), absl::StatusCode::kInvalidArgument);

  // After the first step, with its last write-backs still queued (the deferred device runs copies
  // only when told), as strata.optim's gpu_budget="auto" sets it.
  const std::string expected = first_layers_on_gpu(kLayers, 2);
  Backward b;
  b.after_step = [&](int step) {
    if (step != 0) return;
    const absl::Status set = rt->set_gpu_budget(4 * kLayerBytes);
    ASSERT_TRUE(set.ok()) << set;
    EXPECT_EQ(where(*rt), expected);
    const absl::Status below = rt->set_gpu_budget(kLayerBytes);
    EXPECT_EQ(below.code(), absl::StatusCode::kInvalidArgument) << below;
    EXPECT_EQ(rt->gpu_budget(), 4 * kLayerBytes);
  };
  const auto got = train(*rt, *dev, kLayers, kN, 3, &rng, b);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, bytes] : want) EXPECT_EQ(got.at(name), bytes) << name;
  EXPECT_EQ(where(*rt), expected);
  EXPECT_LE(rt->stats().gpu_reserved_peak_bytes, static_cast<std::int64_t>(4 * kLayerBytes));
}

// A role registered after a first step (gradients, in a training loop that registers them once
// backward made them; here the second moments, so that each layer's tensors keep train()'s order)
// finds layers resident that settled without it (See Note [Ring under a budget] in
// policies/ring_plan.cpp). The ring still gets its K + 1 slots, those layers going home first,
// and training stays keep_on_gpu's.
TEST(ParameterStreamingTest, ARoleRegisteredLaterDoesNotShrinkTheRing) {
  constexpr int kLayers = 8;
  constexpr std::size_t kN = 256 * 1024;  // 1 MiB tensors, 4 MiB a layer of every role
  constexpr std::size_t kLayerBytes = 4 * kN * 4;
  auto [ref_rt, ref_dev] = make_runtime("keep_on_gpu");
  register_trainable(*ref_rt, kLayers, kN);
  const auto want = train(*ref_rt, *ref_dev, kLayers, kN, 3, nullptr);

  // K = 1: a ring of two whole layers and two resident layers fill the budget. Without the second
  // moments, three layers of three roles fit beside the ring, which would leave room for one slot.
  const std::size_t budget = 4 * kLayerBytes;
  std::mt19937 rng(23);
  auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1, .roles = RoleSet::all()},
                                /*deferred=*/true, budget);
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> init(kN);
    for (std::size_t i = 0; i < kN; ++i)
      init[i] = 0.01f * static_cast<float>((i * 7 + l) % 13) - 0.05f;
    ASSERT_TRUE(
        rt->register_tensor(spec(str_cat("l", l, ".p"), l, Role::kParameter, kN), init.data())
            .ok());
    ASSERT_TRUE(rt->register_tensor(spec(str_cat("l", l, ".g"), l, Role::kGradient, kN)).ok());
    ASSERT_TRUE(
        rt->register_tensor(spec(str_cat("l", l, ".m"), l, Role::kOptimizerState, kN)).ok());
  }
  // Settles: the ring, then three whole layers and the first tensor of a fourth (10 MiB).
  ASSERT_TRUE(rt->begin_step().ok());
  ASSERT_TRUE(rt->end_step().ok());
  dev->run_pending();
  // where() lists the tensors in registration order: l0.p l0.g l0.m l1.p ...
  EXPECT_EQ(rt->stats().staging_bytes, static_cast<std::int64_t>(2 * 3 * kN * 4));
  EXPECT_EQ(where(*rt), "G G G G G G G G G G P P P P P P P P P P P P P P");
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(
        rt->register_tensor(spec(str_cat("l", l, ".v"), l, Role::kOptimizerState, kN)).ok());
  }
  const auto got = train(*rt, *dev, kLayers, kN, 3, &rng);
  EXPECT_EQ(rt->stats().staging_bytes, static_cast<std::int64_t>(2 * kLayerBytes));
  EXPECT_LE(rt->stats().gpu_reserved_peak_bytes, static_cast<std::int64_t>(budget));
  // Two whole layers resident: their first three tensors, and their second moments (listed last).
  EXPECT_EQ(where(*rt), "G G G G G G P P P P P P P P P P P P P P P P P P G G P P P P P P");
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, bytes] : want) EXPECT_EQ(got.at(name), bytes) << name;
}

TEST(ParameterStreamingTest, ForwardHoldsOneLayerAndKeepsTheLastForBackward) {
  auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1, .roles = RoleSet::all()});
  register_trainable(*rt, 4, 100);  // per layer: p g m v
  ASSERT_TRUE(rt->begin_step().ok());
  ASSERT_TRUE(rt->before_forward(0).ok());
  EXPECT_EQ(where(*rt), "S P P P S P P P P P P P P P P P");
  ASSERT_TRUE(rt->before_forward(1).ok());
  EXPECT_EQ(where(*rt), "P P P P S P P P S S P P P P P P");
  ASSERT_TRUE(rt->before_forward(2).ok());
  EXPECT_EQ(where(*rt), "P P P P P P P P S S P P S S P P");
  ASSERT_TRUE(rt->before_forward(3).ok());  // layers 2 and 3 stay for backward
  EXPECT_EQ(where(*rt), "P P P P P P P P S S P P S S P P");
  ASSERT_TRUE(rt->after_backward(3).ok());  // gradients of 3 written back, layer 1 fetched
  EXPECT_EQ(where(*rt), "P P P P S S P P S S P P P P P P");
  ASSERT_TRUE(rt->after_backward(2).ok());
  EXPECT_EQ(where(*rt), "S S P P S S P P P P P P P P P P");
  ASSERT_TRUE(rt->after_backward(1).ok());
  ASSERT_TRUE(rt->after_backward(0).ok());
  EXPECT_EQ(where(*rt), "P P P P P P P P P P P P P P P P");
  ASSERT_TRUE(rt->end_step().ok());
}

TEST(ParameterStreamingTest, FrozenLayersTakeNoSlotAndNothingLandsInTheMainPool) {
  // Layers 1 and 3 have no optimizer states (frozen); the window must not shrink because of them.
  auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1});
  for (int l = 0; l < 6; ++l) {
    ASSERT_TRUE(rt->register_tensor(spec(str_cat("w", l), l, Role::kParameter, 100)).ok());
    if (l == 1 || l == 3) continue;
    ASSERT_TRUE(rt->register_tensor(spec(str_cat("m", l), l, Role::kOptimizerState, 100)).ok());
    ASSERT_TRUE(rt->register_tensor(spec(str_cat("v", l), l, Role::kOptimizerState, 100)).ok());
  }
  const std::int64_t gpu_before = rt->allocator().stats(Tier::kGpu).allocated_bytes.current;
  for (int step = 0; step < 3; ++step) testing::empty_optimizer_step(*rt);
  EXPECT_EQ(rt->allocator().stats(Tier::kGpu).allocated_bytes.peak, gpu_before)
      << "a state was fetched into the main GPU pool";
  EXPECT_EQ(rt->stats().prefetch_hits + rt->stats().prefetch_waits, 3 * 8);
  for (TensorHandle h : rt->tensors()) {
    TensorInfo i = *rt->info(h);
    if (i.spec.role != Role::kParameter) {
      EXPECT_EQ(i.tier, Tier::kPinnedHost) << i.spec.name;
    }
  }
}

TEST(ParameterStreamingTest, AnEvaluationForwardThenTrainingStaysInTheRing) {
  auto [rt, dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1, .roles = RoleSet::all()});
  register_trainable(*rt, 5, 100);
  // Evaluation: forward only, twice in one step, then once in a step of its own.
  ASSERT_TRUE(rt->begin_step().ok());
  for (int pass = 0; pass < 2; ++pass) {
    for (int l = 0; l < 5; ++l) ASSERT_TRUE(rt->before_forward(l).ok()) << pass << " " << l;
  }
  ASSERT_TRUE(rt->end_step().ok());
  ASSERT_TRUE(rt->begin_step().ok());
  for (int l = 0; l < 5; ++l) ASSERT_TRUE(rt->before_forward(l).ok()) << l;
  ASSERT_TRUE(rt->end_step().ok());
  // Training step.
  ASSERT_TRUE(rt->begin_step().ok());
  for (int l = 0; l < 5; ++l) ASSERT_TRUE(rt->before_forward(l).ok());
  for (int l = 4; l >= 0; --l) ASSERT_TRUE(rt->after_backward(l).ok());
  testing::empty_optimizer_step(*rt);
  ASSERT_TRUE(rt->end_step().ok());
  EXPECT_EQ(rt->allocator().stats(Tier::kGpu).allocated_bytes.peak, 0);
  EXPECT_EQ(where(*rt), "P P P P P P P P P P P P P P P P P P P P");
  // Nothing is left held: a phase switch and unregistering work.
  ASSERT_TRUE(rt->offload_all().ok());
  for (TensorHandle h : rt->tensors()) ASSERT_TRUE(rt->unregister(h).ok());
}

}  // namespace
}  // namespace strata::rt
