// allocator/budget.h: a cap on bytes reserved from upstreams that several pools can draw on.
//
// Each tier's pool has a Budget; the runtime's staging pool draws on the GPU tier's too, so
// strata's GPU bytes (segments reserved by either pool) never pass the budget given for the GPU,
// whichever pool grows. A pool takes a segment's bytes out of its Budget before it asks its
// upstream for the segment and gives them back when the segment goes back, so the reserved figure
// and its peak are exact at every moment.
//
// Example:
//   auto gpu = std::make_shared<Budget>(8 * kGiB);
//   BlockPool main_pool({.tier = Tier::kGpu, .shared_budget = gpu}, std::move(upstream), ops);
//   BlockPool ring_pool({.tier = Tier::kGpu, .shared_budget = gpu}, std::move(other), ops);
//   // main_pool.stats().reserved_bytes + ring_pool.stats().reserved_bytes <= gpu->limit(), always
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <mutex>

namespace strata::alloc {

inline constexpr std::size_t kNoBudget = std::numeric_limits<std::size_t>::max();

class Budget {
 public:
  explicit Budget(std::size_t limit = kNoBudget) : limit_(limit) {}

  // Takes `bytes` out of the budget, or returns false (taking nothing) if that would pass the
  // limit.
  bool try_reserve(std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (limit_ != kNoBudget && (bytes > limit_ || reserved_ > limit_ - bytes)) return false;
    reserved_ += bytes;
    peak_ = std::max(peak_, reserved_);
    return true;
  }
  void release(std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    reserved_ -= std::min(bytes, reserved_);
  }
  // A limit below what is reserved now stops growth until enough goes back.
  void set_limit(std::size_t limit) {
    std::lock_guard<std::mutex> lock(mu_);
    limit_ = limit;
  }
  std::size_t limit() const {
    std::lock_guard<std::mutex> lock(mu_);
    return limit_;
  }
  std::size_t reserved() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reserved_;
  }
  std::size_t peak() const {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = reserved_;
  }

 private:
  mutable std::mutex mu_;
  std::size_t limit_;
  std::size_t reserved_ = 0;
  std::size_t peak_ = 0;
};

}  // namespace strata::alloc
