#include "allocator/stream_ops.h"

#include "base/strings.h"

namespace strata::alloc {

absl::StatusOr<EventHandle> SimulatedStreamOps::record(StreamHandle /*stream*/) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::uintptr_t id = next_id_++;
  done_[id] = !holding_;
  return reinterpret_cast<EventHandle>(id);
}

absl::StatusOr<bool> SimulatedStreamOps::query(EventHandle event) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = done_.find(reinterpret_cast<std::uintptr_t>(event));
  if (it == done_.end()) {
    return absl::InvalidArgumentError(str_cat("query of an unknown event ", event));
  }
  return it->second;
}

absl::Status SimulatedStreamOps::synchronize(EventHandle event) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = done_.find(reinterpret_cast<std::uintptr_t>(event));
  if (it == done_.end()) {
    return absl::InvalidArgumentError(str_cat("synchronize on an unknown event ", event));
  }
  if (!it->second && !synchronize_completes_) {
    return absl::DeadlineExceededError("simulated stream never completes this event");
  }
  it->second = true;
  return absl::OkStatus();
}

void SimulatedStreamOps::release(EventHandle event) {
  std::lock_guard<std::mutex> lock(mu_);
  done_.erase(reinterpret_cast<std::uintptr_t>(event));
}

void SimulatedStreamOps::hold() {
  std::lock_guard<std::mutex> lock(mu_);
  holding_ = true;
}

void SimulatedStreamOps::complete(EventHandle event) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = done_.find(reinterpret_cast<std::uintptr_t>(event));
  if (it != done_.end()) it->second = true;
}

void SimulatedStreamOps::complete_all() {
  std::lock_guard<std::mutex> lock(mu_);
  holding_ = false;
  for (auto& [id, done] : done_) done = true;
}

std::int64_t SimulatedStreamOps::live_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<std::int64_t>(done_.size());
}

void SimulatedStreamOps::set_synchronize_completes(bool value) {
  std::lock_guard<std::mutex> lock(mu_);
  synchronize_completes_ = value;
}

}  // namespace strata::alloc
