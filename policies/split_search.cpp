// policies/split_search.cpp: SplitSearch's walk over measured splits (See Note [Measured split] in
// split_search.h).
#include "policies/split_search.h"

#include <algorithm>
#include <iterator>

namespace strata::policy {

SplitSearch::SplitSearch(int movable, int start, SplitSearchOptions options)
    : movable_(std::max(movable, 0)),
      start_(std::clamp(start, 0, std::max(movable, 0))),
      options_(options),
      stride_(options.stride > 0 ? options.stride : (movable_ + 9) / 10),
      step_(stride_),
      current_(start_),
      walk_start_(start_) {
  if (options_.samples < 1) options_.samples = 1;
  done_ = movable_ == 0;
}

int SplitSearch::best() const {
  if (measured_.empty()) return start_;
  double fastest = measured_.begin()->second;
  for (const auto& [k, seconds] : measured_) fastest = std::min(fastest, seconds);
  for (const auto& [k, seconds] : measured_) {  // ascending k: the fewest host layers first
    if (seconds <= fastest * (1 + options_.margin)) return k;
  }
  return start_;
}

void SplitSearch::go_to(int k) {
  current_ = k;
  discarded_ = false;
  samples_.clear();
}

void SplitSearch::restart() {
  start_ = current_;
  walk_start_ = current_;
  step_ = stride_;
  first_up_ = -1;
  direction_ = +1;
  measured_.clear();
  samples_.clear();
}

void SplitSearch::add(double seconds, rt::StepKind kind) {
  if (done_) return;
  if (!discarded_) {  // the first step after a move pays for it
    discarded_ = true;
    return;
  }
  // See Note [Measured split]: steps of one kind only.
  if (kind == rt::StepKind::kRedone) return;
  if (kind_.has_value() && kind != *kind_) {
    // Before any split is measured, a step that held in backward takes over at once.
    const bool early = measured_.empty() && *kind_ == rt::StepKind::kAfterBackward;
    if (!early) {
      other_kind_ = other_kind_ > 0 && other_ == kind ? other_kind_ + 1 : 1;
      other_ = kind;
      if (other_kind_ < 2 * options_.samples + 1) return;
    }
    restart();
  }
  kind_ = kind;
  other_kind_ = 0;
  samples_.push_back(seconds);
  if (static_cast<int>(samples_.size()) < options_.samples) return;
  auto mid = samples_.begin() + static_cast<std::ptrdiff_t>(samples_.size() / 2);
  std::nth_element(samples_.begin(), mid, samples_.end());
  measured_[current_] = *mid;

  // See Note [Measured split]: on while the newest split is the best; up from the walk's start,
  // else (the first split up was slower, or there is none) down from it, once. A step past either
  // end stops at it. The coarse walk is followed by one a layer at a time from its best.
  const bool improving = best() == current_;
  int next = -1;
  if (current_ == walk_start_) {  // only the first walk measures its start
    next = first_move();
  } else if (improving) {
    next = neighbor(current_, direction_);
  } else if (current_ == first_up_) {
    direction_ = -1;
    next = neighbor(walk_start_, -1);
  }
  // Every layer on the GPU (the streamed step, which the split must beat) is measured before the
  // walk by ones, wherever the walk stopped (See Note [Measured split]).
  if (next < 0 && measured_.count(0) == 0) {
    direction_ = -1;
    next = 0;
  }
  if (next < 0 && step_ > 1) {
    step_ = 1;
    walk_start_ = best();
    next = first_move();
  }
  if (next < 0) {
    done_ = true;
    go_to(best());
    return;
  }
  go_to(next);
}

int SplitSearch::neighbor(int k, int direction) const {
  const int n = std::clamp(k + direction * step_, 0, movable_);
  return n == k || measured_.count(n) != 0 ? -1 : n;
}

int SplitSearch::first_move() {
  direction_ = +1;
  first_up_ = neighbor(walk_start_, +1);
  if (first_up_ >= 0) return first_up_;
  direction_ = -1;
  return neighbor(walk_start_, -1);
}

}  // namespace strata::policy
