#include "policies/split_search.h"

#include <algorithm>
#include <iterator>

namespace strata::policy {

SplitSearch::SplitSearch(int movable, int start, SplitSearchOptions options)
    : movable_(std::max(movable, 0)),
      start_(std::clamp(start, 0, std::max(movable, 0))),
      options_(options),
      stride_(options.stride > 0 ? options.stride : (movable_ + 9) / 10),
      current_(start_) {
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

void SplitSearch::add(double seconds) {
  if (done_) return;
  if (!discarded_) {  // the first step after a move pays for it
    discarded_ = true;
    return;
  }
  samples_.push_back(seconds);
  if (static_cast<int>(samples_.size()) < options_.samples) return;
  auto mid = samples_.begin() + static_cast<std::ptrdiff_t>(samples_.size() / 2);
  std::nth_element(samples_.begin(), mid, samples_.end());
  measured_[current_] = *mid;

  // See Note [Measured split]: on while the newest split is the best; up from the start, else
  // (the first split up was slower, or there is none) down from it, once. A step past either end
  // stops at it.
  auto neighbor = [&](int k, int direction) {
    const int n = std::clamp(k + direction * stride_, 0, movable_);
    return n == k || measured_.count(n) != 0 ? -1 : n;
  };
  const bool improving = best() == current_;
  int next = improving ? neighbor(current_, direction_) : -1;
  const bool first_up_slower = measured_.size() == 2 && !improving;
  if (next < 0 && direction_ > 0 && (current_ == start_ || first_up_slower)) {
    direction_ = -1;
    next = neighbor(start_, -1);
  }
  if (next < 0) {
    done_ = true;
    go_to(best());
    return;
  }
  go_to(next);
}

}  // namespace strata::policy
