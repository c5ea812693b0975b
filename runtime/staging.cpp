// runtime/staging.cpp: the staging ring room (staging.h) and the public staging calls of Runtime:
// configure_staging, stage_layer, unstage_layer, is_staged, staged_tensors.
#include "runtime/staging.h"

#include <algorithm>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "runtime/runtime_impl.h"

namespace strata::rt {
namespace internal {
namespace {

constexpr std::size_t kStagingAlignment = alloc::kBlockGranularity;

std::size_t align_up(std::size_t x, std::size_t a) { return (x + a - 1) & ~(a - 1); }
std::int64_t staged_size(const Entry& e) {
  return static_cast<std::int64_t>(align_up(e.bytes, kStagingAlignment));
}

}  // namespace

StagingRing::StagingRing(Registry& registry, MigrationEngine& engine,
                         alloc::TieredAllocator& allocator, std::unique_ptr<alloc::BlockPool> pool)
    : registry_(registry), engine_(engine), allocator_(allocator), pool_(std::move(pool)) {}

absl::Status StagingRing::wait_free_events() {
  // Each wait is dropped once done, so a failure part way leaves the rest for the next call.
  for (Slot& slot : slots_) {
    while (!slot.free_events.empty()) {
      STRATA_RETURN_IF_ERROR(engine_.device().synchronize(slot.free_events.back()));
      engine_.device().release(slot.free_events.back());
      slot.free_events.pop_back();
    }
  }
  return absl::OkStatus();
}

absl::Status StagingRing::configure(int slots, RoleSet roles) {
  if (slots < 1) {
    return absl::InvalidArgumentError(str_cat("configure_staging: ", slots, " slots; need >= 1"));
  }
  std::size_t largest = 0;
  for (int layer : registry_.layers()) {
    std::size_t bytes = 0;
    for (const Entry* e : registry_.layer_entries(layer, roles)) {
      bytes += align_up(e->bytes, kStagingAlignment);
    }
    largest = std::max(largest, bytes);
  }
  if (largest == slot_bytes_ && roles == roles_ && static_cast<int>(slots_.size()) == slots) {
    return absl::OkStatus();
  }
  if (!staged_layers_.empty()) {
    return absl::FailedPreconditionError("configure_staging while layers are staged");
  }
  const std::size_t total = largest * static_cast<std::size_t>(slots);
  STRATA_RETURN_IF_ERROR(free_memory());
  slots_.clear();
  slot_bytes_ = largest;
  roles_ = roles;
  next_slot_ = 0;
  engine_.stats().staging_bytes = static_cast<std::int64_t>(total);
  if (total == 0) return absl::OkStatus();
  // The ring draws on the GPU budget with the main pool (See Note [Staging ring] in runtime.h):
  // what the main pool keeps cached goes back first if the ring does not fit beside it.
  const alloc::AllocOptions where{.stream = engine_.h2d(), .owner = "runtime.staging"};
  absl::StatusOr<void*> memory = pool_->allocate(total, where);
  if (memory.status().code() == absl::StatusCode::kResourceExhausted) {
    // Blocks freed behind stream events come back first (a host wait: this is setup), then the
    // segments left entirely free.
    if (allocator_.pool(Tier::kGpu).synchronize_pending().ok() &&
        allocator_.trim(Tier::kGpu).ok()) {
      memory = pool_->allocate(total, where);
    }
  }
  if (!memory.ok()) {
    slot_bytes_ = 0;
    engine_.stats().staging_bytes = 0;
    return absl::Status(memory.status().code(),
                        str_cat("the staging ring (", slots, " slot(s) of the largest layer's ",
                                roles.to_string(), ", ", format_bytes(largest),
                                " each) does not "
                                "fit: ",
                                memory.status().message()));
  }
  memory_ = *memory;
  slots_.resize(slots);
  for (int i = 0; i < slots; ++i) slots_[i].base = static_cast<std::byte*>(memory_) + largest * i;
  return absl::OkStatus();
}

std::vector<std::pair<Entry*, std::size_t>> StagingRing::layout_of(int layer,
                                                                   std::size_t& bytes) const {
  std::vector<std::pair<Entry*, std::size_t>> out;
  bytes = 0;
  for (Entry* e : registry_.layer_entries(layer, roles_)) {
    out.emplace_back(e, bytes);
    bytes += align_up(e->bytes, kStagingAlignment);
  }
  return out;
}

absl::Status StagingRing::stage(int layer, std::optional<RoleSet> roles, StageOrder order) {
  if (slots_.empty()) {
    return absl::FailedPreconditionError(
        str_cat("stage_layer ", layer, ": no staging ring; call configure_staging first"));
  }
  const RoleSet want = roles.value_or(roles_);
  auto staged = staged_layers_.find(layer);
  std::vector<std::pair<Entry*, std::size_t>> layout;
  if (staged != staged_layers_.end()) {
    // The places fixed when the layer took its slot (See Note [Slot layout] in staging.h).
    layout = slots_[staged->second].layout;
    for (Entry* e : registry_.layer_entries(layer, want)) {
      if (std::none_of(layout.begin(), layout.end(), [e](const auto& p) { return p.first == e; })) {
        return absl::FailedPreconditionError(
            str_cat("stage_layer ", layer, ": tensor '", e->spec.name,
                    "' was registered after the layer took its staging slot; unstage the layer "
                    "first"));
      }
    }
  } else {
    std::size_t off = 0;
    layout = layout_of(layer, off);
    if (off > slot_bytes_) {
      return absl::FailedPreconditionError(
          str_cat("stage_layer ", layer, ": needs ", format_bytes(off), " but staging slots hold ",
                  format_bytes(slot_bytes_), "; call configure_staging after registering"));
    }
  }
  std::vector<std::pair<Entry*, std::size_t>> todo;
  for (auto [e, off] : layout) {
    // On the GPU already (in the main pool, or in its slot), or being fetched into its slot. A
    // tensor still being written back from its last staging is fetched again (chained on the GPU
    // below).
    const bool on_gpu_already =
        e->in_flight ? e->dst.tier == Tier::kGpu : e->loc.tier == Tier::kGpu;
    if (want.contains(e->spec.role) && e->bytes > 0 && !on_gpu_already) todo.emplace_back(e, off);
  }
  if (todo.empty()) return absl::OkStatus();
  // Stable, so tensors of equal size keep their registration order (See Note [Staging order] in
  // runtime.h).
  if (order == StageOrder::kSmallestFirst) {
    std::stable_sort(todo.begin(), todo.end(),
                     [](const auto& a, const auto& b) { return a.first->bytes < b.first->bytes; });
  } else if (order == StageOrder::kLargestFirst) {
    std::stable_sort(todo.begin(), todo.end(),
                     [](const auto& a, const auto& b) { return a.first->bytes > b.first->bytes; });
  }
  for (auto [e, off] : todo) {
    if (e->holds > 0) {
      return absl::FailedPreconditionError(
          str_cat("stage_layer ", layer, ": tensor '", e->spec.name, "' is held"));
    }
  }
  int index = -1;
  const bool new_slot = staged == staged_layers_.end();
  if (!new_slot) {
    index = staged->second;  // more roles into the layer's slot
  } else {
    // The free slot freed longest ago, whose last write-backs are the likeliest done, so that the
    // fetch queued now waits for the least (See Note [Draining slot] in policies/ring_plan.cpp);
    // among slots never used, the ring position first.
    const int n = static_cast<int>(slots_.size());
    for (int i = 0; i < n; ++i) {
      const int candidate = (next_slot_ + i) % n;
      if (slots_[candidate].layer >= 0) continue;
      if (index < 0 || slots_[candidate].freed < slots_[index].freed) index = candidate;
    }
    if (index < 0) {
      std::string held;
      for (const auto& [l, sl] : staged_layers_) str_append(&held, held.empty() ? "" : ", ", l);
      return absl::ResourceExhaustedError(str_cat("stage_layer ", layer, ": all ", n,
                                                  " staging slots hold layers (", held,
                                                  "); unstage one first"));
    }
    next_slot_ = (index + 1) % n;
    slots_[index].layer = layer;
    slots_[index].layout = layout;
    staged_layers_[layer] = index;
  }
  Slot& slot = slots_[index];
  absl::Status status;
  int queued = 0;
  for (auto [e, off] : todo) {
    // Still being written back from the last step: chain on the GPU instead of waiting here.
    if (e->in_flight) engine_.finish(*e, /*early=*/true);
    e->rest = e->loc;
    status = engine_.migrate(*e, Tier::kGpu, slot.base + off, index, slot.free_events);
    if (!status.ok()) {
      // The tensors queued so far stay staged (unstage_layer brings them home); this one stays.
      e->rest = {};
      break;
    }
    ++queued;
    slot.occupants.push_back(e);
    staged_now_ += staged_size(*e);
  }
  if (queued > 0) {
    // Every copy into the slot waited for these; they are spent.
    for (EventHandle ev : slot.free_events) engine_.device().release(ev);
    slot.free_events.clear();
  } else if (new_slot) {
    // Nothing went in: the slot stays free, and keeps what a later fetch must wait for.
    slot.layer = -1;
    slot.layout.clear();
    staged_layers_.erase(layer);
  }
  RuntimeStats& stats = engine_.stats();
  stats.staged_peak_bytes = std::max(stats.staged_peak_bytes, staged_now_);
  return status;
}

absl::Status StagingRing::unstage(int layer, std::optional<RoleSet> write_back) {
  auto it = staged_layers_.find(layer);
  if (it == staged_layers_.end()) return absl::OkStatus();
  const RoleSet copy_home = write_back.value_or(RoleSet::all());
  Slot& slot = slots_[it->second];
  Device& dev = engine_.device();
  for (Entry* e : slot.occupants) {
    if (e->holds > 0) {
      return absl::FailedPreconditionError(
          str_cat("unstage_layer ", layer, ": tensor '", e->spec.name, "' is still held"));
    }
  }
  // Write-backs go in arrival order: the first tensor in is the first whose compute is done, so
  // the D2H stream starts while the rest of the layer is still arriving and computing
  // (See Note [Per-parameter pipelining] in optim/adam.cpp); in reverse order it would idle until
  // the whole layer is in. Each occupant leaves the slot's books only once handled, so a call that
  // fails half-way can be retried and handles the rest.
  bool copied = false;
  absl::Status status;
  std::size_t handled = 0;
  for (; handled < slot.occupants.size(); ++handled) {
    Entry* e = slot.occupants[handled];
    // A kept tensor's home is a fresh block, which only the write-back fills (See Note [Undo log]
    // in undo_log.cpp).
    if (copy_home.contains(e->spec.role) || e->undo_fresh != nullptr) {
      if (e->in_flight) engine_.finish(*e, /*early=*/true);  // still arriving: chain on the GPU
      if (e->undo_fresh != nullptr) {
        // Into the fresh block, which is home from now on; the old one is the log's
        // (See Note [Undo log] in undo_log.cpp).
        status = engine_.migrate(*e, e->rest.tier, e->undo_fresh, -1);
        if (!status.ok()) break;
        e->rest = {};
        e->undo_fresh = nullptr;
      } else {
        status = engine_.migrate(*e, e->rest.tier, e->rest.ptr, -1);
        if (!status.ok()) break;
      }
      copied = true;
    } else {
      // Discard: the kept home block still holds the data (the staged copy was only read). The
      // slot must not be refilled before the fetch into it and the compute that read it are done.
      absl::StatusOr<EventHandle> fetched = dev.record(engine_.h2d());
      if (!fetched.ok()) {
        status = fetched.status();
        break;
      }
      if (e->in_flight) {
        slot.free_events.push_back(e->arrival);
        e->arrival = nullptr;
        e->in_flight = false;
        std::erase(engine_.in_flight(), e);
      }
      for (const Entry::Ready& r : e->ready) slot.free_events.push_back(r.event);
      e->ready.clear();
      // The fetch read the home block; later writes into it wait for the copy stream.
      e->ready.push_back({engine_.h2d(), *fetched});
      e->loc = e->rest;
      e->rest = {};
      engine_.notify(*e, e->loc.tier, e->loc.ptr);
    }
    staged_now_ -= staged_size(*e);
  }
  slot.occupants.erase(slot.occupants.begin(),
                       slot.occupants.begin() + static_cast<std::ptrdiff_t>(handled));
  if (copied || slot.read_out_pending) {
    // The slot may be refilled once the write-backs just queued have read it.
    slot.read_out_pending = true;
    STRATA_ASSIGN_OR_RETURN(EventHandle read_out, dev.record(engine_.d2h()));
    slot.free_events.push_back(read_out);
    slot.read_out_pending = false;
  }
  if (!status.ok()) return status;  // still staged with the occupants not yet handled
  slot.layer = -1;
  slot.layout.clear();
  slot.freed = ++releases_;
  staged_layers_.erase(it);
  return absl::OkStatus();
}

void StagingRing::staged_tensors(int layer, std::vector<TensorHandle>& out) const {
  out.clear();
  auto it = staged_layers_.find(layer);
  if (it == staged_layers_.end()) return;
  for (const Entry* e : slots_[it->second].occupants) out.push_back(e->handle);
}

void StagingRing::forget(Entry& e) {
  auto it = staged_layers_.find(e.spec.layer);
  if (it == staged_layers_.end()) return;
  Slot& slot = slots_[it->second];
  // Its place stays a hole (See Note [Slot layout]).
  std::erase_if(slot.layout, [&](const auto& p) { return p.first == &e; });
  if (std::find(slot.occupants.begin(), slot.occupants.end(), &e) != slot.occupants.end()) {
    std::erase(slot.occupants, &e);
    staged_now_ -= staged_size(e);
  }
}

absl::Status StagingRing::release() {
  if (!staged_layers_.empty()) {
    return absl::FailedPreconditionError("releasing the staging ring while layers are staged");
  }
  STRATA_RETURN_IF_ERROR(wait_free_events());
  slots_.clear();
  staged_layers_.clear();
  staged_now_ = 0;
  slot_bytes_ = 0;
  roles_ = RoleSet();
  engine_.stats().staging_bytes = 0;
  return free_memory();
}

absl::Status StagingRing::free_memory() {
  STRATA_RETURN_IF_ERROR(wait_free_events());
  if (memory_ == nullptr) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(pool_->deallocate(memory_));
  memory_ = nullptr;
  // The next ring is another size, and what the staging pool kept cached would count against the
  // GPU budget that the main pool shares: its segment goes back at once.
  return pool_->trim().status();
}

void StagingRing::abandon() {
  for (Slot& slot : slots_) {
    for (EventHandle ev : slot.free_events) engine_.device().release(ev);
    slot.free_events.clear();
  }
  slots_.clear();
  staged_layers_.clear();
  if (memory_ == nullptr) return;
  for (StreamHandle s : {engine_.h2d(), engine_.d2h(), engine_.compute()}) {
    (void)pool_->record_stream(memory_, s);
  }
  (void)pool_->deallocate(memory_);
  memory_ = nullptr;
}

}  // namespace internal

absl::Status Runtime::configure_staging(int slots, RoleSet roles) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->staging.configure(slots, roles);
}

absl::Status Runtime::stage_layer(int layer, std::optional<RoleSet> roles, StageOrder order) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->staging.stage(layer, roles, order);
}

absl::Status Runtime::unstage_layer(int layer, std::optional<RoleSet> write_back) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->staging.unstage(layer, write_back);
}

bool Runtime::is_staged(int layer) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->staging.is_staged(layer);
}

void Runtime::staged_tensors(int layer, std::vector<TensorHandle>& out) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->staging.staged_tensors(layer, out);
}

}  // namespace strata::rt
