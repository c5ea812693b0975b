// The overlapped step (See Note [Overlapped step] in optim/adam.h, See Note [Undo log] in
// runtime/undo_log.cpp and See Note [Overlapped backward] in policies/state_streaming.cpp): a small
// model trained through every hook, with Adam stepping each layer during backward (step_layer) and
// finish_step validating, ends bitwise where the sequential step (Adam::step after backward) ends,
// under every policy and parameter dtype, over steps where clipping triggers and steps where it
// does not, with a step whose gradients hold inf, and with gradient accumulation; on the simulated
// device in deferred mode with copies completing in random order. Host functions on the compute
// stream stand in for forward and backward; each layer's gradients and their part of the norm are
// computed as its backward runs, as bridge::GradientStats takes them.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "optim/adam.h"
#include "optim/adam_math.h"
#include "tests/optim/overlap_model.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::optim {
namespace {

using namespace overlap;  // NOLINT: the tests' shared model
using rt::DType;
using rt::Role;
using rt::RoleSet;
using rt::TensorHandle;

// Trains `steps` steps; with `overlapped`, the runtime is made for overlap and each layer steps in
// backward unless `step_in_backward` is false (the client steps after backward this time, as
// strata.optim does while clipping fires). Returns every tensor's bytes and each group's step
// count.
// `after_step(step, runtime, adam)` runs after each step has ended (a test's own checks and changes
// between steps).
Bytes train(const Case& setup, bool overlapped, int steps, std::uint64_t seed, Outcomes* outcomes,
            bool step_in_backward = true,
            const std::function<void(int, rt::Runtime&, Adam&)>& after_step = {}) {
  rt::PolicyConfig config = setup.config;
  config.overlap = overlapped ? rt::Overlap::kBackward : rt::Overlap::kNone;
  rt::testing::Made made =
      rt::testing::make_runtime(setup.policy, config, /*deferred=*/true, setup.gpu_budget);
  if (made.rt == nullptr) return {};
  rt::Runtime& runtime = *made.rt;
  rt::SimulatedDevice& dev = *made.device;
  std::unique_ptr<LoopModel> model = make_loop_model(runtime, setup);
  if (model == nullptr) return {};
  Adam& adam = *model->adam;
  const std::vector<Pairs>& of_layer = model->of_layer;
  std::map<std::uint64_t, void*>& addr = model->addr;
  const ElemType type = elem(setup.dtype);
  const std::size_t numel = setup.numel;
  const float max_norm = overlap::max_norm(setup);
  std::mt19937 rng(static_cast<std::uint32_t>(seed));
  auto jiggle = [&] {
    for (int i = static_cast<int>(rng() % 8); i > 0; --i) {
      dev.run_one(reinterpret_cast<rt::StreamHandle>(rng() % 4));
    }
  };
  const rt::StreamHandle s = runtime.compute_stream();
  // Device scalars (host memory on the simulated device), read where the kernels run.
  auto act = std::make_shared<float>(0.0f);
  auto sum_sq = std::make_shared<double>(0.0);
  auto non_finite = std::make_shared<bool>(false);
  auto loss_scale = std::make_shared<float>(setup.dtype == DType::kFloat16 ? 1024.0f : 1.0f);
  auto grad_scale = std::make_shared<float>(1.0f);
  auto found_inf = std::make_shared<float>(0.0f);
  const bool scaled = setup.dtype == DType::kFloat16;
  auto ok = [](const absl::Status& st) {
    EXPECT_TRUE(st.ok()) << st;
    return st.ok();
  };

  for (int step = 1; step <= steps; ++step) {
    // Every fourth step's gradients are ten times larger: the clip triggers there only.
    const float boost = step % 4 == 0 ? 10.0f : 1.0f;
    for (int micro = 0; micro < setup.micro_batches; ++micro) {
      const bool last = micro + 1 == setup.micro_batches;
      if (!ok(runtime.begin_step())) return {};
      EXPECT_TRUE(dev.enqueue_host(s, [act] { *act = 0.0f; }).ok());
      for (int l = 0; l < kLayers; ++l) {
        if (!ok(runtime.before_forward(l))) return {};
        for (auto [p, g] : of_layer[static_cast<std::size_t>(l)]) {
          const void* pp = addr[p.id];
          EXPECT_TRUE(dev.enqueue_host(
                             s,
                             [pp, type, act, numel] {
                               for (std::size_t i = 0; i < numel; i += 7 * (numel / 1024)) {
                                 *act += load_elem(pp, type, static_cast<std::int64_t>(i)) * 1e-3f;
                               }
                             })
                          .ok());
        }
        jiggle();
      }
      if (last) {
        EXPECT_TRUE(dev.enqueue_host(s,
                                     [sum_sq, non_finite] {
                                       *sum_sq = 0.0;
                                       *non_finite = false;
                                     })
                        .ok());
      }
      for (int l = kLayers - 1; l >= 0; --l) {
        int t = 0;
        for (auto [p, g] : of_layer[static_cast<std::size_t>(l)]) {
          const void* pp = addr[p.id];
          float* gp = static_cast<float*>(addr[g.id]);
          // Only loss scaling checks for inf; unscaled, an inf would make everything NaN.
          const bool inf = scaled && last && step == kInfStep && l == 1 && t == 0;
          const float ls = *loss_scale;
          EXPECT_TRUE(dev.enqueue_host(
                             s,
                             [=] {
                               for (std::size_t i = 0; i < numel; ++i) {
                                 const float w = load_elem(pp, type, static_cast<std::int64_t>(i));
                                 const float v =
                                     boost * (0.01f * static_cast<float>((i * 5 + l + micro) % 11) -
                                              0.05f + 0.1f * w + *act);
                                 gp[i] = (micro == 0 ? 0.0f : gp[i]) + v * ls;
                               }
                               if (inf) gp[3] = std::numeric_limits<float>::infinity();
                               if (!last) return;
                               // This tensor's part of the norm, once it is final.
                               double sq = 0;
                               for (std::size_t i = 0; i < numel; ++i) {
                                 const double x = gp[i] / ls;
                                 sq += x * x;
                                 if (!std::isfinite(gp[i])) *non_finite = true;
                               }
                               *sum_sq += sq;
                             })
                          .ok());
          ++t;
        }
        jiggle();
        if (!ok(runtime.after_backward(l))) return {};
        if (overlapped && step_in_backward && last) {
          if (!ok(adam.step_layer(l, scaled ? loss_scale.get() : nullptr))) return {};
        }
        jiggle();
      }
      if (!last) {
        if (!ok(runtime.end_step())) return {};
        continue;
      }
      // grad_scale as GradientStats::grad_scale takes it: the loss scale over the clip coefficient.
      EXPECT_TRUE(dev.enqueue_host(s,
                                   [=] {
                                     const float norm = static_cast<float>(std::sqrt(*sum_sq));
                                     const float coef = std::min(1.0f, max_norm / (norm + 1e-6f));
                                     *grad_scale = *loss_scale / coef;
                                     *found_inf = *non_finite ? 1.0f : 0.0f;
                                   })
                      .ok());
      for (int l : adam.overlapped_layers()) {
        const std::vector<int>& host = adam.host_layers();
        outcomes->host_in_backward += std::count(host.begin(), host.end(), l) > 0 ? 1 : 0;
      }
      const std::vector<int> host_before = adam.host_layers();
      absl::StatusOr<Adam::StepOutcome> outcome =
          adam.finish_step(grad_scale.get(), scaled ? found_inf.get() : nullptr);
      if (!ok(outcome.status())) return {};
      outcomes->count(*outcome);
      outcomes->moves += adam.host_layers() != host_before ? 1 : 0;
      outcomes->placement = adam.placement();
      EXPECT_EQ(runtime.undo_tensors(), 0u);
      if (!ok(runtime.end_step())) return {};
      if (after_step) after_step(step, runtime, adam);
      jiggle();
    }
  }
  dev.run_pending();
  return collect(runtime, adam, outcomes);
}

std::vector<Case> cases() {
  std::vector<Case> out = basic_cases();
  // Resident layers beside a streamed one (See Note [Resident layers]): both ways of keeping
  // the undo.
  const rt::PolicyConfig all{.prefetch_depth = 1, .roles = RoleSet::all()};
  out.push_back({"layer_prefetch", all, DType::kBFloat16, 1, std::size_t{20} << 20, 128 << 10});
  // The same with the undo kept on the GPU where the budget has room, on pinned memory beyond.
  rt::PolicyConfig all_gpu_undo = all;
  all_gpu_undo.undo_on_gpu = true;
  out.push_back(
      {"layer_prefetch", all_gpu_undo, DType::kBFloat16, 1, std::size_t{20} << 20, 128 << 10});
  return out;
}

// See Note [Staged for a step not taken in backward] in policies/state_streaming.cpp: a runtime
// made for overlap whose client steps after backward ends bitwise where the sequential runtime
// does, and moves the same bytes: the layers staged for backward while forward ran are stepped
// first, not sent home and fetched again.
TEST(OverlapTest, AStepAfterBackwardUnderOverlapMovesNoByteMoreThanTheSequentialStep) {
  constexpr int kSteps = 6;
  for (const Case& setup : basic_cases()) {
    SCOPED_TRACE(describe(setup));
    Outcomes seq, after;
    const Bytes want = train(setup, /*overlap=*/false, kSteps, 3, &seq);
    const Bytes got = train(setup, /*overlap=*/true, kSteps, 4, &after, /*step_in_backward=*/false);
    ASSERT_FALSE(want.empty());
    EXPECT_EQ(after.sequential, kSteps);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, bytes] : want) EXPECT_TRUE(got.at(name) == bytes) << name;
    if (setup.policy == "layer_prefetch" && !setup.config.roles.contains(Role::kParameter)) {
      // Micro-batches before the last still fetch what backward would step first, for nothing,
      // and drop it without a copy back.
      if (setup.micro_batches == 1) EXPECT_EQ(after.h2d_bytes, seq.h2d_bytes);
      EXPECT_EQ(after.d2h_bytes, seq.d2h_bytes);
    }
  }
}

// See Note [A share of the step in backward] in optim/adam_overlap.cpp: with half the states
// that cross the link allowed in backward, the first two of the four layers backward reaches step
// there and the other two in finish_step; the run ends bitwise where the sequential one does,
// under every policy and dtype, with resident layers beside streamed ones, and under hybrid (whose
// host layers, crossing no link, are not left). Under layer_prefetch a step that held moves the
// bytes of a sequential step: the layers staged for backward and left to finish_step are stepped
// from the ring, not written home and fetched again (See Note [Staged for a step not taken in
// backward] in policies/state_streaming.cpp). A redone step moves more, as it does stepping wholly
// in backward.
TEST(OverlapTest, AShareOfTheStepInBackwardIsBitwiseAndMovesNoByteMore) {
  constexpr int kSteps = 9;
  for (const Case& setup : cases()) {
    SCOPED_TRACE(describe(setup));
    Outcomes seq, ovl;
    struct Step {
      std::size_t in_backward;
      std::int64_t h2d, d2h;
      Adam::BackwardBytes bytes;
    };
    std::vector<Step> steps;
    std::int64_t h2d = 0, d2h = 0;
    const Bytes want = train(setup, /*overlap=*/false, kSteps, 5, &seq);
    const Bytes got =
        train(setup, /*overlap=*/true, kSteps, 6, &ovl, /*step_in_backward=*/true,
              [&](int, rt::Runtime& runtime, Adam& adam) {
                const rt::RuntimeStats stats = runtime.stats();
                steps.push_back({adam.overlapped_layers().size(), stats.migrated_bytes_h2d - h2d,
                                 stats.migrated_bytes_d2h - d2h, adam.backward_bytes()});
                h2d = stats.migrated_bytes_h2d;
                d2h = stats.migrated_bytes_d2h;
                ASSERT_TRUE(adam.set_backward_share(0.5).ok());
              });
    expect_same(want, got, seq, ovl, kSteps);
    ASSERT_EQ(steps.size(), static_cast<std::size_t>(kSteps));
    const bool states_stream =
        setup.policy == "layer_prefetch" && setup.gpu_budget == alloc::kNoBudget;
    if (setup.policy == "keep_on_gpu") EXPECT_EQ(steps.back().bytes.link_states, 0u);
    if (!states_stream) continue;
    // Between steps every state rests on the host: the whole of them crosses the link, and the
    // parameters rest on the GPU unless they stream too.
    const std::size_t states =
        kLayers * kTensorsPerLayer * setup.numel * 4 * (setup.dtype == DType::kFloat32 ? 2 : 3);
    EXPECT_EQ(steps.back().bytes.link_states, states);
    const bool params_stream = setup.config.roles.contains(Role::kParameter);
    EXPECT_EQ(steps.back().bytes.resting, params_stream ? 0u
                                                        : kLayers * kTensorsPerLayer * setup.numel *
                                                              rt::dtype_size(setup.dtype));
    // Every layer in backward at the first step, or none where it was redone; then two, or none
    // where it was redone.
    EXPECT_TRUE(steps[0].in_backward == 0 || steps[0].in_backward == kLayers);
    int held = 0;
    for (std::size_t s = 1; s < steps.size(); ++s) {
      EXPECT_TRUE(steps[s].in_backward == 0 || steps[s].in_backward == 2) << s;
      if (steps[s].in_backward != 2) continue;
      ++held;
      if (!params_stream && setup.micro_batches == 1) {
        EXPECT_EQ(steps[s].h2d, seq.h2d_bytes / kSteps) << s;
        EXPECT_EQ(steps[s].d2h, seq.d2h_bytes / kSteps) << s;
      }
    }
    EXPECT_GT(held, 0);
  }
  for (const Case& setup : hybrid_cases()) {
    SCOPED_TRACE(describe(setup));
    Outcomes ref, ovl;
    std::vector<std::size_t> in_backward;
    const Bytes want = train(reference(setup), /*overlap=*/false, kSteps, 1, &ref);
    expect_same_tensors(want, train(setup, /*overlap=*/true, kSteps, 7, &ovl, true,
                                    [&](int, rt::Runtime&, Adam& adam) {
                                      in_backward.push_back(adam.overlapped_layers().size());
                                      ASSERT_TRUE(adam.set_backward_share(0.5).ok());
                                    }));
    if (setup.config.hybrid_fraction == 0.5) {
      // Two layers on the host, two streamed: the host ones and one streamed in backward.
      EXPECT_NE(std::count(in_backward.begin(), in_backward.end(), 3u), 0) << describe(setup);
    }
  }
}

// See Note [A share of the step in backward]: a share outside [0, 1] is refused, and the one set
// stays.
TEST(OverlapTest, ABackwardShareOutsideZeroToOneIsRefused) {
  rt::testing::Made made = rt::testing::make_runtime(
      "layer_prefetch", {.prefetch_depth = 1, .overlap = rt::Overlap::kBackward}, false,
      alloc::kNoBudget);
  ASSERT_NE(made.rt, nullptr);
  std::unique_ptr<LoopModel> model = make_loop_model(*made.rt, basic_cases()[3]);
  ASSERT_NE(model, nullptr);
  Adam& adam = *model->adam;
  ASSERT_TRUE(adam.set_backward_share(0.25).ok());
  for (double bad : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    const absl::Status s = adam.set_backward_share(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("not in [0, 1]"), std::string_view::npos) << s;
  }
  EXPECT_EQ(adam.backward_share(), 0.25);
}

TEST(OverlapTest, OverlappedStepIsBitwiseTheSequentialStep) {
  constexpr int kSteps = 12;
  for (const Case& setup : cases()) {
    SCOPED_TRACE(describe(setup));
    Outcomes seq, ovl;
    const Bytes want = train(setup, /*overlap=*/false, kSteps, 1, &seq);
    const Bytes got = train(setup, /*overlap=*/true, kSteps, 2, &ovl);
    expect_same(want, got, seq, ovl, kSteps);
    // Staged tensors keep their home for the undo. What rests on the GPU is kept on the GPU while
    // there is room (undo_on_gpu), else copied off it, but only for a layer with something staged:
    // a layer resting wholly on the GPU then steps after backward (See Note [Resting layers] in
    // optim/adam_overlap.cpp), keeping nothing.
    const bool streams_all = setup.config.roles.contains(Role::kParameter);
    const bool undo_fits_gpu = setup.config.undo_on_gpu && setup.gpu_budget == alloc::kNoBudget;
    // keep_on_gpu, and bulk, which brings everything to the GPU before forward.
    const bool wholly_resting = setup.policy != "layer_prefetch";
    if (wholly_resting && !undo_fits_gpu) {
      EXPECT_EQ(ovl.undo_peak_bytes, 0);
    } else {
      EXPECT_GT(ovl.undo_peak_bytes, 0);
    }
    if (setup.policy == "layer_prefetch" && !streams_all && !undo_fits_gpu) {
      // The parameters, resting on the GPU beside their layer's staged states.
      EXPECT_GT(ovl.undo_copied_bytes, 0);
    } else {
      EXPECT_EQ(ovl.undo_copied_bytes, 0);
    }
  }
}

// See Note [Host-stepped layers] in optim/adam_host_step.cpp: a hybrid run, sequential and
// overlapped, ends bitwise where layer_prefetch does, over steps where clipping triggers and a step
// whose gradients hold inf; with Adam and with Lion.
TEST(OverlapTest, HybridStepIsBitwiseTheLayerPrefetchStep) {
  constexpr int kSteps = 8;
  for (const Case& setup : hybrid_cases()) {
    SCOPED_TRACE(describe(setup));
    Outcomes ref, seq, ovl;
    const Bytes want = train(reference(setup), /*overlap=*/false, kSteps, 1, &ref);
    const int masters = expect_same_tensors(want, train(setup, /*overlap=*/false, kSteps, 2, &seq));
    expect_same_tensors(want, train(setup, /*overlap=*/true, kSteps, 3, &ovl));
    // Overlapped, the host layers step during backward too, redone where clipping fired.
    if (setup.config.hybrid_fraction) {
      EXPECT_GT(ovl.host_in_backward, 0);
      EXPECT_GT(ovl.redone, 0);
    }
    // Host layers move their gradients and parameters, never their states.
    if (setup.config.hybrid_fraction == 0.0) {
      EXPECT_LT(seq.h2d_bytes, ref.h2d_bytes);
      EXPECT_EQ(seq.h2d_bytes, 0) << "no state streams when every layer steps on the host";
    }
    if (setup.dtype == DType::kFloat32 && setup.config.hybrid_fraction) EXPECT_GT(masters, 0);
  }
}

// See Note [Measured split] in policies/split_search.h: without a forced fraction the hybrid moves
// layers between the host and the GPU over the run's steps, as their times say, and every step
// stays bitwise layer_prefetch's: sequential and overlapped (the host steps' buffers and undo made
// again after each move), with resident layers under a budget (a layer going to the host leaves
// the main pool), with Adam and Lion; its line says how the steps it compared were taken. A
// float32 layer keeps a master on the host only: it gets one from its parameter when it moves
// there and gives it up when it leaves (See Note [Float32 masters follow the split] in
// optim/adam_placement.cpp), so at the end the masters are those of the layers on the host, each
// its parameter's value.
TEST(OverlapTest, HybridMeasuredSplitMovesStepsAndStaysBitwise) {
  constexpr int kSteps = 24;  // 4 layers, one at a time: every split measured and the search done
  std::vector<Case> setups;
  const rt::PolicyConfig states{.prefetch_depth = 1, .roles = RoleSet::optimizer_states()};
  for (const char* rule : {"adam", "lion"}) {
    for (DType d : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      setups.push_back({"hybrid", states, d});
      setups.back().rule = rule;
    }
  }
  setups.push_back({"hybrid", states, DType::kBFloat16, 1, std::size_t{20} << 20, 128 << 10});
  for (const Case& setup : setups) {
    SCOPED_TRACE(describe(setup));
    Outcomes ref, seq, ovl;
    const Bytes want = train(reference(setup), /*overlap=*/false, kSteps, 1, &ref);
    std::size_t host_layers = 0;
    auto count_host = [&](int, rt::Runtime&, Adam& adam) {
      host_layers = adam.host_layers().size();
    };
    for (bool overlapped : {false, true}) {
      Outcomes& o = overlapped ? ovl : seq;
      const int masters = expect_same_tensors(
          want, train(setup, overlapped, kSteps, overlapped ? 3 : 2, &o, true, count_host));
      EXPECT_GE(o.moves, 1);
      EXPECT_NE(o.placement.find("measured steps chose"), std::string::npos) << o.placement;
      // Its splits compared by steps taken one way, the redone ones left out.
      EXPECT_NE(o.placement.find(overlapped ? "over steps taken in backward"
                                            : "over steps taken after backward"),
                std::string::npos)
          << o.placement;
      const std::size_t want_masters = setup.dtype == DType::kFloat32 ? host_layers : 0;
      EXPECT_EQ(masters, static_cast<int>(want_masters * kTensorsPerLayer)) << o.placement;
    }
  }
}

// See Note [Measured split]: when the search ends, a run that steps in backward keeps the pinned
// pool's cached segments (its steps there write states back to fresh pinned blocks and keep the
// old ones for a redo: See Note [Undo log] in runtime/undo_log.cpp, which the cache serves), so no
// segment goes back to the system after the first step. States of a little over 1 MiB, so that
// their blocks have segments of their own, which a trim would free.
TEST(OverlapTest, HybridSearchEndKeepsThePinnedCacheForStepsInBackward) {
  constexpr int kSteps = 32;
  const rt::PolicyConfig states{.prefetch_depth = 1, .roles = RoleSet::optimizer_states()};
  Case setup{"hybrid", states, DType::kBFloat16, 1, alloc::kNoBudget, (std::size_t{1} << 18) + 128};
  Outcomes got;
  int ended_at = 0;
  // Segments freed since the first step (the setup's rate measurement gives its buffers back).
  std::int64_t freed_at_first = 0, freed_at_end = 0, freed_last = 0;
  train(setup, /*overlapped=*/true, kSteps, 7, &got, true,
        [&](int step, rt::Runtime& runtime, Adam& adam) {
          freed_last = runtime.allocator().stats(rt::Tier::kPinnedHost).num_segment_frees;
          if (step == 1) freed_at_first = freed_last;
          if (ended_at == 0 && adam.placement().find("measured steps chose") != std::string::npos) {
            ended_at = step;
            freed_at_end = freed_last;
          }
        });
  ASSERT_GT(ended_at, 0) << got.placement;
  ASSERT_LT(ended_at, kSteps - 4) << "too few steps after the search";
  EXPECT_EQ(freed_at_end, freed_at_first) << "the search's end gave pinned segments back";
  EXPECT_EQ(freed_last, freed_at_first) << "pinned segments went back to the system";
}

// See Note [Measured split]: a move the optimizer cannot follow (no pinned memory for the host
// buffers of the layers moved, the pinned budget held at what the first step left) stops the
// search, and the policy moves back. Every step still succeeds, the optimizer and the policy step
// each layer in the same place, and the run ends bitwise layer_prefetch's.
TEST(OverlapTest, HybridMeasuredSplitThatCannotMoveStopsAndStaysBitwise) {
  constexpr int kSteps = 16;
  const rt::PolicyConfig states{.prefetch_depth = 1, .roles = RoleSet::optimizer_states()};
  // The cost model's split, none of the 4 layers on the host (rates given with a slow host): the
  // search walks up. A float32 layer's move needs its masters too (See Note [Float32 masters
  // follow the split] in optim/adam_placement.cpp).
  const rt::StepRates slow_host{.link_h2d_gbps = 50,
                                .link_d2h_gbps = 50,
                                .link_both_gbps = 40,
                                .host_params_per_s = 1,
                                .link_h2d_loaded_gbps = 40,
                                .link_d2h_loaded_gbps = 40};
  for (auto [dtype, overlapped] : {std::pair{DType::kBFloat16, false},
                                   {DType::kBFloat16, true},
                                   {DType::kFloat32, false},
                                   {DType::kFloat32, true}}) {
    Case setup{"hybrid", states, dtype, 1, alloc::kNoBudget, 256 << 10};
    setup.step_rates = slow_host;
    SCOPED_TRACE(str_cat(describe(setup), overlapped ? " overlapped" : " sequential"));
    Outcomes ref, got;
    const Bytes want = train(reference(setup), /*overlap=*/false, kSteps, 1, &ref);
    bool consistent = true;
    const Bytes bytes = train(
        setup, overlapped, kSteps, 2, &got, true, [&](int step, rt::Runtime& runtime, Adam& adam) {
          alloc::TieredAllocator& a = runtime.allocator();
          if (step == 1) {
            ASSERT_TRUE(a.trim(rt::Tier::kPinnedHost).ok());
            const auto held =
                static_cast<std::size_t>(a.stats(rt::Tier::kPinnedHost).reserved_bytes.current);
            ASSERT_TRUE(a.set_budget(rt::Tier::kPinnedHost, held).ok());
          }
          const std::vector<int>& host = adam.host_layers();
          for (int l = 0; l < kLayers; ++l) {
            const bool on_host = std::find(host.begin(), host.end(), l) != host.end();
            consistent = consistent && on_host == (runtime.step_place(l) == rt::StepPlace::kHost);
          }
        });
    expect_same_tensors(want, bytes);
    EXPECT_NE(got.placement.find("the measured split stopped"), std::string::npos) << got.placement;
    EXPECT_TRUE(consistent);
  }
}

// See Note [Step rules] in optim/step_rule.h: Lion steps through the machinery Adam does, its
// overlapped step bitwise its sequential step over clipped steps and the inf step (its hybrid
// cases are HybridStepIsBitwiseTheLayerPrefetchStep's).
TEST(OverlapTest, LionOverlappedStepIsBitwiseItsSequentialStep) {
  constexpr int kSteps = 8;
  for (const Case& setup : lion_cases()) {
    SCOPED_TRACE(describe(setup));
    Outcomes seq, ovl;
    const Bytes want = train(setup, /*overlap=*/false, kSteps, 1, &seq);
    expect_same(want, train(setup, /*overlap=*/true, kSteps, 2, &ovl), seq, ovl, kSteps, 1);
    EXPECT_EQ(want.count("l0.w0.exp_avg_sq"), 0u) << "Lion keeps one moment";
    EXPECT_EQ(want.count("l0.w0.exp_avg"), 1u);
  }
}

// See Note [Compressed moments] in optim/state_codec.h: with bfloat16 and int8 moments (1044
// elements a parameter: a part block at the end), the overlapped step is bitwise the sequential
// one under every policy, redone steps and the inf step included (the rounding is drawn again for
// the same step), and a hybrid run, whose host layers' moments the host kernel steps, is bitwise
// layer_prefetch's.
TEST(OverlapTest, CompressedMomentsStepBitwiseAlikeOverlappedAndOnTheHost) {
  constexpr int kSteps = 12;
  for (StateType moments : {StateType::kBF16, StateType::kI8}) {
    std::vector<Case> overlapped;
    const rt::PolicyConfig all{.prefetch_depth = 1, .roles = RoleSet::all()};
    const rt::PolicyConfig states{.prefetch_depth = 1, .roles = RoleSet::optimizer_states()};
    rt::PolicyConfig bulk_all = all;
    bulk_all.offload_after_step = true;
    overlapped.push_back({"keep_on_gpu", {}, DType::kFloat32});
    overlapped.push_back({"bulk", bulk_all, DType::kBFloat16});
    overlapped.push_back({"layer_prefetch", all, DType::kFloat16});
    overlapped.push_back({"layer_prefetch", states, DType::kBFloat16});
    for (Case& setup : overlapped) {
      setup.numel = 1044;
      setup.state_dtype = moments;
      SCOPED_TRACE(describe(setup));
      Outcomes seq, ovl;
      const Bytes want = train(setup, /*overlap=*/false, kSteps, 1, &seq);
      expect_same(want, train(setup, /*overlap=*/true, kSteps, 2, &ovl), seq, ovl, kSteps);
    }
    for (DType d : {DType::kFloat32, DType::kBFloat16}) {
      rt::PolicyConfig c = states;
      c.hybrid_fraction = 0.5;
      Case setup{"hybrid", c, d};
      setup.numel = 1044;
      setup.state_dtype = moments;
      SCOPED_TRACE(describe(setup));
      Outcomes ref, seq, ovl;
      const Bytes want = train(reference(setup), /*overlap=*/false, kSteps, 1, &ref);
      expect_same_tensors(want, train(setup, /*overlap=*/false, kSteps, 2, &seq));
      expect_same_tensors(want, train(setup, /*overlap=*/true, kSteps, 3, &ovl));
    }
  }
}

}  // namespace
}  // namespace strata::optim
