// runtime/undo_log.cpp: the undo log (internal::UndoLog) behind Runtime::keep_for_undo,
// commit_undo and rollback_undo.
//
// Note [Undo log]
// ~~~~~~~~~~~~~~~
// An optimizer step taken layer by layer during backward (See Note [Overlapped step] in
// optim/adam.h) runs before the step's global facts are known (the gradient norm that decides
// clipping, loss scaling's inf check). It is a speculation, and when it turns out wrong the step is
// redone from the bytes it started from, so those bytes must outlive the in-place kernel until the
// step is validated. Where they are kept depends on where the tensor is:
//   - staged (a copy in a staging slot, its home block on the host): the home block already holds
//     the old bytes, so it is kept as it is and the write-back goes into a fresh block of the same
//     tier, which becomes the tensor's home. No byte more crosses the link; the price is host
//     memory, a second home for every kept tensor until the step is validated.
//   - resting on the GPU (keep_on_gpu, bulk, layer_prefetch's resident layers, FSDP2's float32
//     shards when only states stream): with the undo on the GPU (PolicyConfig::undo_on_gpu, or
//     Runtime::set_undo_on_gpu between steps), and while the GPU tier has room under the budget,
//     the bytes are copied on the GPU, on the stream the optimizer computes on, ahead of its
//     kernel: no link traffic, GPU memory of the tensor's size until the step is validated.
//     Otherwise (a budget is usually sized with no room for a second copy) they are copied to
//     pinned host memory on the D2H stream, which the compute stream waits for before the kernel
//     overwrites them. That costs D2H traffic, which the write-backs of streamed states need too
//     during backward (4 bytes a float32 parameter more: a third on top of its moments' 8).
// commit_undo frees what was kept behind the streams that may still use it, with no host wait: a
// fetch queued earlier may still read an old home block (only the H2D stream reads one; the
// write-backs of the step, which may still run on the D2H stream, go to the fresh blocks, so the
// next step's fresh blocks can reuse the old ones before they end), a copy on the GPU may still be
// running. An old home block waits only for the fetch that read it: keep() marks that fetch as
// its last use (See Note [Last use] in allocator/block_pool.h). An event recorded at the commit
// would also wait for every fetch queued since, the next step's among them; with the host ahead
// of the GPU those are often not done when the next step takes its fresh blocks, and the pinned
// pool grew from step to step.
// rollback_undo waits for everything, swaps a kept home block back where the tensor's fresh block
// still is its home (no copy) and copies the bytes back otherwise (a tensor still staged gets them
// in its slot as well as at home), then tells the policy. While the log holds anything, a step
// cannot begin, tensors cannot go (unregister) and offload_all waits: each would outlive or move
// what the log refers to.
//
// Note [The undo in the framework's memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A step in backward keeps its copies on the GPU while backward runs, and backward frees
// activations as it goes. Under a framework with a caching allocator (torch's), those freed blocks
// stay in the framework's cache, so copies drawn from strata's own GPU pool add to the device's
// peak as the driver sees it: the framework holds its activation peak and strata the copies beside
// it. Drawn from the framework's allocator instead (Runtime::set_undo_memory; the bridge's
// TorchUndoMemory), a copy takes a block backward has just freed, and goes back to the cache when
// the step is validated, before the next forward needs it again. The copies still count in the GPU
// budget (reserved in it before the framework is asked; a budget that blocks them first has
// strata's free segments trimmed, as the pool would), so a budget bounds strata's bytes as before;
// a framework with no room answers nullptr and the copy goes to pinned memory, as when the budget
// is spent. The framework's blocks are ordered on its own stream: the bridge makes the step's
// stream wait for it before the copy, and it waits for the step's stream before the block is
// freed, at validation, at a failure, or when the runtime goes with copies still kept.
#include <algorithm>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "runtime/undo_log.h"

#include "runtime/migration.h"
#include "runtime/runtime_impl.h"

namespace strata::rt::internal {

UndoLog::UndoLog(alloc::TieredAllocator& allocator, MigrationEngine& engine)
    : allocator_(allocator), engine_(engine) {}

UndoLog::~UndoLog() {
  for (const Record& r : records_) {
    if (r.external) free_on_gpu(r.kept, r.entry->bytes, r.stream, /*external=*/true);
  }
}

absl::Status UndoLog::check_empty(std::string_view what) const {
  if (records_.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      str_cat(what, ": an optimizer step taken during backward keeps ", records_.size(),
              " tensor(s) for its redo (first '", records_.front().entry->spec.name,
              "'); validate it first (commit_undo or rollback_undo; Adam::finish_step does)"));
}

// The copy on the GPU, when asked for and the GPU tier has room; nullptr when it has none (the
// caller copies to pinned memory instead; See Note [Undo log]). From memory_ when one is set
// (See Note [The undo in the framework's memory]).
absl::StatusOr<void*> UndoLog::keep_on_gpu(const Entry& e, const void* data, StreamHandle stream,
                                           const std::string& owner) {
  alloc::Budget& budget = *allocator_.budget(Tier::kGpu);
  absl::StatusOr<void*> copy = nullptr;
  if (memory_ == nullptr) {
    copy = allocator_.allocate(Tier::kGpu, e.bytes, {.stream = nullptr, .owner = owner});
    if (copy.status().code() == absl::StatusCode::kResourceExhausted) return nullptr;
  } else {
    // As the pool does under its budget: strata's free cached segments go back first.
    if (!budget.try_reserve(e.bytes) &&
        !(allocator_.trim(Tier::kGpu).ok() && budget.try_reserve(e.bytes))) {
      return nullptr;
    }
    copy = memory_->allocate(e.bytes, stream);
    if (!copy.ok() || *copy == nullptr) {
      budget.release(e.bytes);
      if (copy.ok()) return nullptr;  // no room: pinned memory instead
    }
  }
  STRATA_RETURN_IF_ERROR(copy.status());
  // `stream` holds the tensor (acquired on it), so the copy sees every earlier write and comes
  // before the kernel that overwrites the data.
  Device& dev = engine_.device();
  absl::Status s = dev.copy_async(*copy, data, e.bytes, stream);
  // A copy that fails on the device reports it at the next call: one more before the bytes count
  // as kept, so that a redo never restores a copy that did not happen.
  if (s.ok()) {
    absl::StatusOr<EventHandle> copied = dev.record(stream);
    s = copied.status();
    if (copied.ok()) dev.release(*copied);
  }
  if (!s.ok()) {
    // The copy may have been queued: the block goes back behind it.
    free_on_gpu(*copy, e.bytes, stream, memory_ != nullptr);
    return s;
  }
  return *copy;
}

void UndoLog::free_on_gpu(void* kept, std::size_t bytes, StreamHandle stream, bool external) {
  if (!external) {
    engine_.free_after(Tier::kGpu, kept, {stream});
    return;
  }
  // The bytes go back to the budget now: the block is the framework's from here on.
  allocator_.budget(Tier::kGpu)->release(bytes);
  // A block the framework fails to take back stays with it: nothing of strata's is lost.
  (void)memory_->free(kept, stream);
}

absl::Status UndoLog::keep(Entry* e, StreamHandle stream, bool over_link, bool undo_on_gpu) {
  if (e->undo_kept || e->bytes == 0) return absl::OkStatus();
  const Location& now = e->in_flight ? e->dst : e->loc;
  if (e->holds == 0 || now.tier != Tier::kGpu) {
    return absl::FailedPreconditionError(
        str_cat("keep_for_undo '", e->spec.name, "': acquire it on the GPU first (it is ",
                e->holds == 0 ? "not held" : "held elsewhere", ")"));
  }
  RuntimeStats& stats = engine_.stats();
  const std::string owner = str_cat("undo: ", e->spec.name);
  if (now.slot >= 0) {
    // Staged: the home block keeps the old bytes; the write-back goes into a fresh one.
    absl::StatusOr<void*> fresh =
        allocator_.allocate(e->rest.tier, e->bytes, {.stream = nullptr, .owner = owner});
    if (!fresh.ok()) {
      return absl::Status(fresh.status().code(),
                          str_cat("keeping '", e->spec.name, "' for an overlapped step's redo (",
                                  format_bytes(e->bytes), " of ", tier_name(e->rest.tier),
                                  "): ", fresh.status().message()));
    }
    // `rest` stays the old block until the write-back is queued: a fetch from it may still be
    // arriving, and its completion must not free it. That fetch, queued on the H2D stream already,
    // is the last read of the old block, so the commit frees it behind an event recorded now
    // (See Note [Undo log]); without one, behind the H2D stream at the commit.
    const bool marked = allocator_.mark_last_use(e->rest.tier, e->rest.ptr, engine_.h2d()).ok();
    records_.push_back({e, e->rest.tier, e->rest.ptr, *fresh});
    records_.back().last_use_marked = marked;
    e->undo_fresh = *fresh;
  } else if (absl::StatusOr<void*> on_gpu =
                 undo_on_gpu ? keep_on_gpu(*e, now.ptr, stream, owner) : nullptr;
             !on_gpu.ok() || *on_gpu != nullptr) {
    if (!on_gpu.ok()) return on_gpu.status();
    records_.push_back({e, Tier::kGpu, *on_gpu, nullptr, stream, memory_ != nullptr});
  } else if (!over_link) {
    return absl::ResourceExhaustedError(
        str_cat("keep_for_undo '", e->spec.name, "': no room to keep it on the GPU (",
                !undo_on_gpu         ? "undo_on_gpu is off"
                : memory_ != nullptr ? "the GPU budget is spent or the framework has no room"
                                     : "the GPU budget is spent",
                ") and the caller would not have it cross the link"));
  } else {
    // Resting on the GPU: a copy to pinned host memory, which `stream` waits for.
    absl::StatusOr<void*> copy =
        allocator_.allocate(Tier::kPinnedHost, e->bytes, {.stream = nullptr, .owner = owner});
    if (!copy.ok()) {
      return absl::Status(
          copy.status().code(),
          str_cat("keeping '", e->spec.name, "' for an overlapped step's redo (",
                  format_bytes(e->bytes), " of pinned host memory): ", copy.status().message()));
    }
    Device& dev = engine_.device();
    const StreamHandle d2h = engine_.d2h();
    auto fail = [&](const absl::Status& s, bool queued) {
      if (queued) {
        engine_.free_after(Tier::kPinnedHost, *copy, {d2h});
      } else {
        (void)allocator_.deallocate(Tier::kPinnedHost, *copy);
      }
      return s;
    };
    // The copy reads what every earlier use wrote: the work queued on `stream`, the data's
    // arrival when it is still coming, and its other streams' releases.
    absl::StatusOr<EventHandle> before = dev.record(stream);
    if (!before.ok()) return fail(before.status(), false);
    absl::Status s = dev.stream_wait(d2h, *before);
    dev.release(*before);
    if (s.ok() && e->in_flight) s = dev.stream_wait(d2h, e->arrival);
    for (const Entry::Ready& r : e->ready) {
      if (s.ok()) s = dev.stream_wait(d2h, r.event);
    }
    if (!s.ok()) return fail(s, false);
    s = dev.copy_async(*copy, now.ptr, e->bytes, d2h);
    if (!s.ok()) return fail(s, true);
    absl::StatusOr<EventHandle> copied = dev.record(d2h);
    if (!copied.ok()) return fail(copied.status(), true);
    s = dev.stream_wait(stream, *copied);
    dev.release(*copied);
    if (!s.ok()) return fail(s, true);
    records_.push_back({e, Tier::kPinnedHost, *copy});
    stats.undo_copied_bytes += static_cast<std::int64_t>(e->bytes);
  }
  e->undo_kept = true;
  stats.undo_bytes += static_cast<std::int64_t>(e->bytes);
  stats.undo_peak_bytes = std::max(stats.undo_peak_bytes, stats.undo_bytes);
  return absl::OkStatus();
}

void UndoLog::drop_last_use(const Record& r) {
  if (!r.last_use_marked) return;
  // A use recorded after the mark undoes it; the block is freed through free_after later anyway.
  const absl::Status s = allocator_.record_stream(r.tier, r.kept, engine_.h2d());
  STRATA_CHECK(s.ok(), "record_stream on a kept home block: ", s.message());
}

void UndoLog::commit() {
  for (const Record& r : records_) {
    if (r.entry->undo_fresh != nullptr) {
      // Still staged, its write-back not queued yet: it goes home to the old block after all, and
      // later uses of that block come (See Note [Last use] in allocator/block_pool.h). The fresh
      // block goes behind the D2H stream: a write-back whose queueing failed half-way may still
      // write it.
      drop_last_use(r);
      engine_.free_after(r.tier, r.fresh, {engine_.d2h()});
    } else if (r.tier == Tier::kGpu) {
      free_on_gpu(r.kept, r.entry->bytes, r.stream, r.external);
    } else if (r.fresh != nullptr && r.last_use_marked) {
      // An old home block: behind the fetch that read it (See Note [Undo log]).
      const absl::Status s = allocator_.deallocate(r.tier, r.kept);
      STRATA_CHECK(s.ok(), "freeing an old home block: ", s.message());
    } else if (r.fresh != nullptr) {
      engine_.free_after(r.tier, r.kept, {engine_.h2d()});
    } else {
      // A copy over the link: written on the D2H stream.
      engine_.free_after(r.tier, r.kept, {engine_.h2d(), engine_.d2h()});
    }
    r.entry->undo_kept = false;
    r.entry->undo_fresh = nullptr;
  }
  records_.clear();
  engine_.stats().undo_bytes = 0;
}

absl::Status UndoLog::rollback() {
  for (const Record& r : records_) {
    const Entry& e = *r.entry;
    if (e.holds > 0) {
      return absl::FailedPreconditionError(
          str_cat("rollback_undo: tensor '", e.spec.name, "' is held; release it first"));
    }
  }
  Device& dev = engine_.device();
  STRATA_RETURN_IF_ERROR(engine_.wait_all());
  for (StreamHandle s : {engine_.compute(), engine_.h2d(), engine_.d2h()}) {
    STRATA_RETURN_IF_ERROR(dev.stream_synchronize(s));
  }
  // The optimizer may have stepped on other streams than the compute stream (a hook on FSDP2's
  // reduce-scatter stream), where the copies kept on the GPU were made too.
  for (const Record& r : records_) {
    if (r.tier == Tier::kGpu) STRATA_RETURN_IF_ERROR(dev.stream_synchronize(r.stream));
  }
  // Each record leaves the log once its bytes are back, so a failure part way can be retried.
  while (!records_.empty()) {
    const Record r = records_.back();
    Entry& e = *r.entry;
    STRATA_RETURN_IF_ERROR(engine_.wait_ready_on_host(e));
    const bool staged = e.loc.slot >= 0;
    if (e.undo_fresh != nullptr) {
      // Still staged, its write-back never queued (the step failed first): the home block is the
      // kept one and holds the old bytes; the staged copy may have been stepped.
      STRATA_RETURN_IF_ERROR(engine_.host_copy(e.loc.ptr, r.kept, e.bytes));
      (void)allocator_.deallocate(r.tier, r.fresh);
      drop_last_use(r);
    } else if (r.fresh != nullptr && e.loc.ptr == r.fresh && !staged) {
      // Its home is still the block the write-back filled: the kept block is home again, and
      // later uses of it come.
      (void)allocator_.deallocate(r.tier, r.fresh);
      drop_last_use(r);
      e.loc = {r.tier, r.kept, -1};
      engine_.notify(e, e.loc.tier, e.loc.ptr);
    } else {
      // Wherever it is now, and in its home block too while staged (a discard returns there).
      STRATA_RETURN_IF_ERROR(engine_.host_copy(e.loc.ptr, r.kept, e.bytes));
      if (staged && e.rest.ptr != nullptr) {
        STRATA_RETURN_IF_ERROR(engine_.host_copy(e.rest.ptr, r.kept, e.bytes));
      }
      // A fresh block that stopped being its home was freed by the move that took it away.
      if (r.external) {
        free_on_gpu(r.kept, e.bytes, r.stream, r.external);
      } else {
        (void)allocator_.deallocate(r.tier, r.kept);
      }
    }
    e.undo_kept = false;
    e.undo_fresh = nullptr;
    ++e.version;
    engine_.stats().undo_bytes -= static_cast<std::int64_t>(e.bytes);
    records_.pop_back();
  }
  return absl::OkStatus();
}

}  // namespace strata::rt::internal

namespace strata::rt {

absl::Status Runtime::keep_for_undo(TensorHandle tensor, StreamHandle stream, bool over_link) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  STRATA_ASSIGN_OR_RETURN(internal::Entry * e, im.registry.get(tensor));
  return im.undo.keep(e, stream, over_link, im.undo_on_gpu);
}

absl::Status Runtime::commit_undo() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->undo.commit();
  return absl::OkStatus();
}

absl::Status Runtime::rollback_undo() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  STRATA_RETURN_IF_ERROR(im.undo.rollback());
  PolicyContext ctx(*this);
  return im.policy->on_undo_rolled_back(ctx);
}

std::size_t Runtime::undo_tensors() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->undo.size();
}

namespace {

// What changes where an undo goes: only between steps, with nothing kept.
absl::Status check_no_undo_under_way(bool stepping, const internal::UndoLog& undo,
                                     std::string_view what) {
  if (stepping) {
    return absl::FailedPreconditionError(
        str_cat(what, ": a step is under way; call it between steps"));
  }
  return undo.check_empty(what);
}

}  // namespace

absl::Status Runtime::set_undo_on_gpu(bool on) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  STRATA_RETURN_IF_ERROR(check_no_undo_under_way(im.step.in_step || im.step.in_optimizer_step,
                                                 im.undo, "set_undo_on_gpu"));
  im.undo_on_gpu = on;
  return absl::OkStatus();
}

bool Runtime::undo_on_gpu() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->undo_on_gpu;
}

absl::Status Runtime::set_undo_memory(std::shared_ptr<UndoMemory> memory) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  STRATA_RETURN_IF_ERROR(check_no_undo_under_way(im.step.in_step || im.step.in_optimizer_step,
                                                 im.undo, "set_undo_memory"));
  im.undo.set_memory(std::move(memory));
  return absl::OkStatus();
}

}  // namespace strata::rt
