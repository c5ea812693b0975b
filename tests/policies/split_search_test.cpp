// The hybrid policy's search over measured steps (See Note [Measured split] in
// policies/split_search.h): where it walks on step times shaped as a host would give them, the step
// it discards after each move, the median against one slow step, the margin more host layers must
// win by, its bounds, that it measures every layer on the GPU before it ends, that it always ends,
// and that it compares steps taken one way only.
#include "policies/split_search.h"

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace strata::policy {
namespace {

// Feeds `seconds_of(k)` for the split the search is at until it is done; the splits it stepped
// with, one entry a step.
std::vector<int> run(SplitSearch& search, const std::function<double(int)>& seconds_of,
                     int max_steps = 1000, rt::StepKind kind = rt::StepKind::kAfterBackward) {
  std::vector<int> stepped;
  while (!search.done() && static_cast<int>(stepped.size()) < max_steps) {
    stepped.push_back(search.current());
    search.add(seconds_of(search.current()), kind);
  }
  return stepped;
}

// A step time with its best at k = `best`: 5 ms a layer away from it, over 100 ms (a layer is
// past the 1% margin).
std::function<double(int)> valley(int best) {
  return [best](int k) { return (100.0 + 5.0 * std::abs(k - best)) / 1e3; };
}

TEST(SplitSearchTest, WalksUpToTheFastestSplit) {
  SplitSearch search(20, 0, {.samples = 3, .stride = 2});
  const std::vector<int> stepped = run(search, valley(7));
  ASSERT_TRUE(search.done());
  // 0, 2, 4, 6 each better than the last; 8 is no better than 6, so the walk by twos ends at 6
  // (fewer host layers on equal times). The walk by ones from 6 goes up to 7, the fastest, and
  // ends there, 8 being measured.
  EXPECT_EQ(search.best(), 7);
  EXPECT_EQ(search.current(), 7);
  EXPECT_EQ(search.measured().size(), 6u);
  EXPECT_EQ(stepped.size(), 6u * 4);  // four steps a split: one discarded, three measured
  EXPECT_DOUBLE_EQ(search.measured().at(4), 0.115);
}

TEST(SplitSearchTest, WalksDownWhenTheFirstSplitUpIsSlower) {
  SplitSearch search(24, 12, {.samples = 2, .stride = 3});
  run(search, valley(4));
  ASSERT_TRUE(search.done());
  // 12, then 15 (slower), then down: 9, 6, 3 (each better), 0 (slower); then by ones from 3: 4
  // (better), 5 (slower).
  EXPECT_EQ(search.best(), 4);
  EXPECT_EQ(search.current(), 4);
  EXPECT_EQ(search.measured().count(15), 1u);
  EXPECT_EQ(search.measured().count(0), 1u);
  EXPECT_EQ(search.measured().count(5), 1u);
  EXPECT_EQ(search.measured().count(18), 0u);
  EXPECT_EQ(search.measured().count(2), 0u);
}

TEST(SplitSearchTest, DiscardsTheStepAfterEachMove) {
  SplitSearch search(10, 0, {.samples = 1, .stride = 5});
  // The first step of every split is far slower (it pays for the move); counted, it would make
  // every split look alike.
  int steps_here = 0;
  int last = -1;
  run(search, [&](int k) {
    steps_here = k == last ? steps_here + 1 : 0;
    last = k;
    return steps_here == 0 ? 10.0 : valley(10)(k);
  });
  EXPECT_EQ(search.best(), 10);
  EXPECT_DOUBLE_EQ(search.measured().at(0), 0.150);
}

TEST(SplitSearchTest, OneSlowStepDoesNotDecide) {
  SplitSearch search(10, 0, {.samples = 3, .stride = 5});
  int calls = 0;
  run(search, [&](int k) {
    ++calls;
    // At k = 5, its second measured step is an evaluation: 10x slower.
    if (k == 5 && calls == 7) return 1.0;
    return valley(5)(k);
  });
  EXPECT_EQ(search.best(), 5);
  EXPECT_DOUBLE_EQ(search.measured().at(5), 0.100);
}

TEST(SplitSearchTest, MoreHostLayersMustWinByTheMargin) {
  SplitSearch search(10, 0, {.samples = 1, .stride = 2, .margin = 0.01});
  run(search, [](int k) { return k == 0 ? 0.1000 : 0.0995; });  // 0.5% faster: not enough
  EXPECT_EQ(search.best(), 0);
  EXPECT_EQ(search.current(), 0);
  EXPECT_EQ(search.measured().size(), 3u);  // 0, 2, then 1 by ones
}

TEST(SplitSearchTest, NothingMovableIsDoneFromTheStart) {
  SplitSearch search(0, 0, {});
  EXPECT_TRUE(search.done());
  EXPECT_EQ(search.current(), 0);
  EXPECT_EQ(search.best(), 0);
  search.add(1.0);
  EXPECT_TRUE(search.measured().empty());
}

TEST(SplitSearchTest, StaysWithinItsLayers) {
  // Started at the top, it can only go down; a stride past an end stops at it, so every layer on
  // the GPU (layer_prefetch's split) and every layer on the host are among the splits it reaches.
  SplitSearch top(6, 6, {.samples = 1, .stride = 4});
  run(top, valley(0));
  EXPECT_EQ(top.best(), 0);
  EXPECT_EQ(top.measured().size(), 4u);  // 6, 2, 0, then 1 by ones
  SplitSearch wide(3, 0, {.samples = 1, .stride = 4});
  run(wide, valley(3));
  EXPECT_TRUE(wide.done());
  EXPECT_EQ(wide.best(), 3);
  SplitSearch near_bottom(24, 7, {.samples = 1, .stride = 3});
  run(near_bottom, valley(0));
  EXPECT_EQ(near_bottom.best(), 0);  // 7, 10 (slower), 4, 1, 0; by ones, nothing is left
  // The default stride is a tenth of the layers, rounded up.
  EXPECT_EQ(SplitSearch(26, 0, {}).stride(), 3);
  EXPECT_EQ(SplitSearch(5, 0, {}).stride(), 1);
}

TEST(SplitSearchTest, WalksByOnesOverWhatTheStrideSteppedOver) {
  // The model starts it at 16 of 26; the fastest split is 14, between the stride's splits.
  SplitSearch search(26, 16, {.samples = 3});
  ASSERT_EQ(search.stride(), 3);
  run(search, valley(14));
  ASSERT_TRUE(search.done());
  // 16, 19 (slower), then down: 13 (better), 10 (slower); 0, every layer on the GPU (slower); by
  // ones from 13: 14 (better), 15.
  EXPECT_EQ(search.best(), 14);
  EXPECT_EQ(search.current(), 14);
  EXPECT_EQ(search.measured().size(), 7u);
  EXPECT_EQ(search.measured().count(12), 0u);
  EXPECT_EQ(search.stride(), 3);
}

// Noisy steps: the model's split happened to measure faster than the splits beside it, though
// every one of them is slower than none on the host. The search measures none on the host before it
// settles, and ends there.
TEST(SplitSearchTest, MeasuresEveryLayerOnTheGpuBeforeItEnds) {
  SplitSearch search(56, 24, {.samples = 3});
  ASSERT_EQ(search.stride(), 6);
  run(search, [](int k) { return k == 24 ? 0.180 : 0.100 + 0.005 * k; });
  ASSERT_TRUE(search.done());
  // 24, 30 (slower), then down: 18 (slower than 24's lucky 180 ms); 0 (the fastest); by ones from
  // 0: 1 (slower).
  EXPECT_EQ(search.best(), 0);
  EXPECT_EQ(search.current(), 0);
  EXPECT_EQ(search.measured().size(), 5u);
  EXPECT_EQ(search.measured().count(1), 1u);
  EXPECT_EQ(search.measured().count(23), 0u);
}

TEST(SplitSearchTest, EndsOnAnyTimes) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> noise(0.05, 0.5);
  for (int trial = 0; trial < 200; ++trial) {
    const int movable = 1 + trial % 40;
    SplitSearch search(movable, trial % (movable + 1), {.samples = 1 + trial % 3});
    const std::vector<int> stepped = run(search, [&](int) { return noise(rng); });
    ASSERT_TRUE(search.done()) << "trial " << trial;
    EXPECT_GE(search.current(), 0);
    EXPECT_LE(search.current(), movable);
    EXPECT_EQ(search.current(), search.best());
    // Each split is measured once at most.
    EXPECT_LE(stepped.size(), static_cast<std::size_t>((movable + 1) * (2 + trial % 3)));
  }
}

// A step taken after backward is slower at some splits here, and one redone slower still: were they
// counted beside the steps in backward, the split that happened to get them would look slow.
TEST(SplitSearchTest, ComparesStepsOfOneKindOnly) {
  SplitSearch search(20, 0, {.samples = 3, .stride = 2});
  const std::function<double(int)> in_backward = valley(7);
  int steps = 0;
  while (!search.done() && steps < 1000) {
    const int k = search.current();
    // Every third step after backward, every fifth redone: never enough in a row to switch.
    const rt::StepKind kind = steps % 5 == 4   ? rt::StepKind::kRedone
                              : steps % 3 == 2 ? rt::StepKind::kAfterBackward
                                               : rt::StepKind::kInBackward;
    const double penalty = kind == rt::StepKind::kRedone          ? 0.5
                           : kind == rt::StepKind::kAfterBackward ? 0.05 * (k % 4)
                                                                  : 0.0;
    search.add(in_backward(k) + penalty, kind);
    ++steps;
  }
  ASSERT_TRUE(search.done());
  EXPECT_EQ(search.best(), 7);
  EXPECT_EQ(search.kind(), rt::StepKind::kInBackward);
  for (const auto& [k, seconds] : search.measured()) {
    EXPECT_DOUBLE_EQ(seconds, in_backward(k)) << k;
  }
}

// A run's first steps after backward (the optimizer's wait after an early redo) set the kind, but
// the first step in backward that holds, before any split is measured, takes over at once; steps
// after backward then wait their turn like any other kind.
TEST(SplitSearchTest, StepsInBackwardTakeOverBeforeAnySplitIsMeasured) {
  SplitSearch search(20, 10, {.samples = 3, .stride = 1});
  const std::function<double(int)> after = valley(14), in_backward = valley(3);
  search.add(after(10), rt::StepKind::kAfterBackward);  // discarded: the first step
  search.add(after(10), rt::StepKind::kAfterBackward);
  search.add(after(10), rt::StepKind::kAfterBackward);
  EXPECT_EQ(search.kind(), rt::StepKind::kAfterBackward);
  search.add(in_backward(10), rt::StepKind::kRedone);  // a redo is no step that held
  EXPECT_EQ(search.kind(), rt::StepKind::kAfterBackward);
  search.add(in_backward(10), rt::StepKind::kInBackward);
  EXPECT_EQ(search.kind(), rt::StepKind::kInBackward);
  EXPECT_TRUE(search.measured().empty());
  EXPECT_EQ(search.current(), 10);
  // Fewer than 2 samples + 1 in a row after backward: not counted, and no switch back.
  for (int i = 0; i < 6; ++i) search.add(after(10), rt::StepKind::kAfterBackward);
  EXPECT_EQ(search.kind(), rt::StepKind::kInBackward);
  EXPECT_TRUE(search.measured().empty());
  run(search, in_backward, 1000, rt::StepKind::kInBackward);
  ASSERT_TRUE(search.done());
  EXPECT_EQ(search.best(), 3);
  for (const auto& [k, seconds] : search.measured()) {
    EXPECT_DOUBLE_EQ(seconds, in_backward(k)) << k;
  }
}

TEST(SplitSearchTest, RedoneStepsAreNeverCounted) {
  SplitSearch search(10, 0, {.samples = 2, .stride = 1});
  for (int i = 0; i < 50; ++i) search.add(0.1, rt::StepKind::kRedone);
  EXPECT_TRUE(search.measured().empty());
  EXPECT_FALSE(search.kind().has_value());
  EXPECT_EQ(search.current(), 0);
}

// The optimizer starts after backward, then settles in backward, where the fastest split is
// another: the search starts again from where it is, with only steps in backward.
TEST(SplitSearchTest, StartsAgainWhenStepsComeAnotherWayToStay) {
  SplitSearch search(20, 10, {.samples = 3, .stride = 1});
  const std::function<double(int)> after = valley(14), in_backward = valley(3);
  search.add(after(10), rt::StepKind::kAfterBackward);  // discarded: the first step
  for (int i = 0; i < 3; ++i) search.add(after(10), rt::StepKind::kAfterBackward);
  ASSERT_EQ(search.measured().count(10), 1u);
  const int at = search.current();
  EXPECT_EQ(at, 11);                                    // walking up
  search.add(after(at), rt::StepKind::kAfterBackward);  // discarded after the move
  // 2 samples + 1 in a row of steps in backward: not counted until the last, which starts again.
  for (int i = 0; i < 6; ++i) search.add(in_backward(at), rt::StepKind::kInBackward);
  EXPECT_EQ(search.kind(), rt::StepKind::kAfterBackward);
  EXPECT_EQ(search.measured().size(), 1u);
  search.add(in_backward(at), rt::StepKind::kInBackward);
  EXPECT_EQ(search.kind(), rt::StepKind::kInBackward);
  EXPECT_TRUE(search.measured().empty());
  run(search, in_backward, 1000, rt::StepKind::kInBackward);
  ASSERT_TRUE(search.done());
  EXPECT_EQ(search.best(), 3);
}

}  // namespace
}  // namespace strata::policy
