// policies/split_search.h: the hybrid policy's search for its split over measured steps. The cost
// model orders the layers that may move and picks a first split; measured step times then walk the
// split up and down that order, a few steps for each, and keep the fastest. Pure bookkeeping: the
// policy moves the layers and the optimizer measures the steps. See Note [Measured split].
//
//   SplitSearch search(/*movable=*/24, /*start=*/0, {});
//   while (!search.done()) {
//     const int k = search.current();      // step with the first k movable layers on the host
//     search.add(measured_seconds, kind);  // one step's time and how it was taken
//   }
//   std::printf("%d\n", search.best());
//
// Note [Measured split]
// ~~~~~~~~~~~~~~~~~~~~~
// The cost model predicts a step from rates measured apart (See Note [Hybrid cost model] in
// step_cost_model.h), and on a host where DMA and host kernels contend for memory it misses by
// 10-40%: it can keep every layer on the GPU where a fifth on the host is faster, or send more
// there than is fastest. The step itself is the better measure, and a
// hybrid step's result does not depend on its split (each layer's update is bitwise the same on
// either side: See Note [Host-stepped layers] in optim/adam_host_step.cpp), so the policy may try
// splits on the steps of the run itself, at no cost to what they compute.
//
// Layers whose states are the same wherever they step move, and so do float32 ones, whose master
// copy exists on the host only and is the parameter's value, made and dropped as the layer moves
// (See Note [Float32 masters follow the split] in optim/adam_placement.cpp); in the cost model's
// order, a split is the first k of them on the host. The search starts at the cost model's k, as a
// measured step's host kernel corrects it (See Note [Host rate in the step] in hybrid.cpp), and
// measures each split over `samples` steps after one it discards (the step after a move pays for
// the move). It walks up, `stride` layers at a time (the last step stopping at all of them), while
// each new split is the best so far; if the first split up is not, or there is none, it walks down
// from the start the same way, down to none on the host. Where that walk stopped short of none on
// the host, none on the host is measured next: it is the streamed step, the one a split must beat,
// and a walk between neighbours on noisy step times can stop at a split that only looked faster
// than the two beside it. Then, where the stride was more than one layer, it walks again from the
// best so far the same way, one layer at a time, over the splits the stride stepped over, where the
// fastest may lie. The best is the one with the fewest host layers among those within `margin` of
// the fastest: more host layers cost host memory and host threads, and must pay for themselves. A
// split's time is the median of its samples, so one slow step (an evaluation, a checkpoint) does
// not decide. Once done, the best split stays for the rest of the run.
//
// Steps taken in different ways take different times at any split: a step taken in backward hides
// part of its link time under backward's compute, and one taken in backward and redone runs twice
// (the loop's optimizer decides where each step runs: See Note [When to step in backward] in
// strata/_when.py). Splits measured by steps of different kinds would be compared by how their
// steps were taken, not by the split. So each step comes with its kind, and the search compares
// splits measured by steps of one kind: the first step it counts sets the kind, a step of another
// kind is not counted, and a redone step never is. Where the steps keep coming another way (2
// samples + 1 in a row of one other kind: the optimizer has settled there), the search starts
// again from the split it has, measuring that kind, with what it measured before forgotten. One
// exception: while no split is measured yet, a step taken (wholly or partly) in backward that held
// takes over from steps after backward at once. Steps after backward at a run's start are most
// often the optimizer's wait after an early redo (the first steps' clipping), and the loop's steps
// go back to backward as soon as they hold; waiting for 2 samples + 1 of them would spend as many
// steps again. The other way round there is no exception.
//
// The search only ever makes a step faster or slower, never wrong, so a failure while it measures
// or moves (no pinned memory for the host buffers of the layers moved, a device error) ends it
// where the policy can put the last move back; the step already taken stands (See
// Adam::measure_step in optim/adam.h).
#pragma once

#include <map>
#include <optional>
#include <vector>

#include "runtime/step_costs.h"

namespace strata::policy {

struct SplitSearchOptions {
  int samples = 3;       // measured steps a split, after the one discarded
  int stride = 0;        // layers a move; 0: a tenth of the movable layers, rounded up
  double margin = 0.01;  // See Note [Measured split]
};

class SplitSearch {
 public:
  // `movable` layers in the cost model's order, the first `start` of them on the host now.
  // Done from the start when nothing can move.
  SplitSearch(int movable, int start, SplitSearchOptions options);

  // The split to step with now: the first current() movable layers on the host.
  int current() const { return current_; }
  bool done() const { return done_; }
  // One step's seconds with current(), taken the way `kind` names (kRedone: never counted). Once
  // the split has its samples it is recorded and the next one chosen; when the search ends
  // current() is the best.
  void add(double seconds, rt::StepKind kind = rt::StepKind::kAfterBackward);
  // The kind of the steps the search counts; nullopt before the first.
  std::optional<rt::StepKind> kind() const { return kind_; }
  // Median seconds of each split measured so far, by its k.
  const std::map<int, double>& measured() const { return measured_; }
  // The fewest host layers within margin of the fastest measured; the start before any.
  int best() const;
  int stride() const { return stride_; }

 private:
  // Starts the samples of split k.
  void go_to(int k);
  // The search from its start again, at current(): another kind of step has come to stay.
  void restart();
  // The split step_ layers from k in `direction`, clamped to the ends; -1 where that is k itself or
  // a split already measured.
  int neighbor(int k, int direction) const;
  // The first split of a walk from walk_start_: up, else down; -1 where neither is left.
  int first_move();
  int movable_;
  int start_;
  SplitSearchOptions options_;
  int stride_;  // the first walk's
  int step_;    // the walk's now: stride_, then 1
  int current_;
  int walk_start_;
  int first_up_ = -1;  // the walk's first split up from its start, -1 before or without one
  int direction_ = +1;
  bool done_ = false;
  bool discarded_ = false;  // the current split's first step is behind it
  std::vector<double> samples_;
  std::map<int, double> measured_;
  std::optional<rt::StepKind> kind_;
  int other_kind_ = 0;  // steps in a row of one other kind than kind_ (not redone)
  rt::StepKind other_ = rt::StepKind::kAfterBackward;
};

}  // namespace strata::policy
