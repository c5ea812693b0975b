// runtime/guards.cpp: the residency guards of Runtime. acquire() gives a tensor's address on a tier
// for work on a stream (the stream waits on the GPU for any copy bringing it there) and holds the
// tensor in place; release() records, per stream, the event after which that work is done, which
// every later move of the tensor waits for. acquire_layer / release_layer do the same for a layer,
// and release_layer lets the policy act on the released layer.
#include <algorithm>

#include "absl/container/inlined_vector.h"
#include "base/status.h"
#include "base/strings.h"
#include "runtime/runtime_impl.h"

namespace strata::rt {

using internal::Entry;

absl::StatusOr<void*> Runtime::Impl::acquire_locked(Entry& e, Tier tier, StreamHandle stream) {
  Device& dev = engine.device();
  if (!e.in_flight && e.loc.tier != tier) {
    if (e.loc.slot >= 0) {
      return absl::FailedPreconditionError(
          str_cat("acquire '", e.spec.name, "' on ", tier_name(tier), ": it is staged on the GPU"));
    }
    if (e.holds > 0) {
      return absl::FailedPreconditionError(str_cat("acquire '", e.spec.name, "' on ",
                                                   tier_name(tier), ": it is held on ",
                                                   tier_name(e.loc.tier)));
    }
    STRATA_RETURN_IF_ERROR(engine.migrate(e, tier));
  }
  if (e.in_flight) {
    if (e.dst.tier != tier) {
      return absl::FailedPreconditionError(str_cat("acquire '", e.spec.name, "' on ",
                                                   tier_name(tier), ": it is moving to ",
                                                   tier_name(e.dst.tier)));
    }
    STRATA_ASSIGN_OR_RETURN(bool arrived, dev.query(e.arrival));
    if (arrived) {
      engine.finish(e, /*early=*/false);
    } else {
      // The compute stream waits on the GPU; how long is measured between two timing events. Each
      // is released if the acquire cannot go through.
      STRATA_ASSIGN_OR_RETURN(EventHandle before, dev.record_timed(stream));
      if (absl::Status s = dev.stream_wait(stream, e.arrival); !s.ok()) {
        dev.release_timed(before);
        return s;
      }
      absl::StatusOr<EventHandle> after = dev.record_timed(stream);
      if (!after.ok()) {
        dev.release_timed(before);
        return after.status();
      }
      ++engine.stats().prefetch_waits;
      engine.add_stall(before, *after, stream);
      e.arrival_waiter = stream;
      ++e.holds;
      engine.notify(e, e.dst.tier, e.dst.ptr);
      return e.dst.ptr;
    }
  }
  for (const Entry::Ready& r : e.ready) STRATA_RETURN_IF_ERROR(dev.stream_wait(stream, r.event));
  ++engine.stats().prefetch_hits;
  ++e.holds;
  engine.notify(e, e.loc.tier, e.loc.ptr);
  return e.loc.ptr;
}

absl::StatusOr<void*> Runtime::acquire(TensorHandle tensor, Tier tier, StreamHandle stream) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  STRATA_RETURN_IF_ERROR(impl_->engine.poll());
  STRATA_ASSIGN_OR_RETURN(Entry * e, impl_->registry.get(tensor));
  return impl_->acquire_locked(*e, tier, stream);
}

absl::Status Runtime::release(TensorHandle tensor, StreamHandle stream) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  STRATA_ASSIGN_OR_RETURN(Entry * e, impl_->registry.get(tensor));
  return impl_->release_locked({e}, stream);
}

absl::Status Runtime::release(const std::vector<TensorHandle>& tensors, StreamHandle stream) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<Entry*> members;
  for (TensorHandle h : tensors) {
    STRATA_ASSIGN_OR_RETURN(Entry * e, impl_->registry.get(h));
    members.push_back(e);
  }
  return impl_->release_locked(members, stream);
}

// All or nothing: every event is recorded before any hold changes, so a failed record leaves every
// tensor held as it was and the caller can retry.
absl::Status Runtime::Impl::release_locked(const std::vector<Entry*>& members,
                                           StreamHandle stream) {
  for (Entry* e : members) {
    if (e->holds == 0) {
      return absl::FailedPreconditionError(
          str_cat("release '", e->spec.name, "': it is not acquired"));
    }
  }
  Device& dev = engine.device();
  // Inline for the usual few tensors: a release runs per tensor per step.
  absl::InlinedVector<EventHandle, 8> done;
  for (std::size_t i = 0; i < members.size(); ++i) {
    absl::StatusOr<EventHandle> event = dev.record(stream);
    if (!event.ok()) {
      for (EventHandle d : done) dev.release(d);
      return absl::Status(event.status().code(),
                          str_cat("release '", members[i]->spec.name,
                                  "' (still held): ", event.status().message()));
    }
    done.push_back(*event);
  }
  for (std::size_t i = 0; i < members.size(); ++i) {
    Entry* e = members[i];
    // This stream's earlier release is behind the new event; other streams' are not.
    for (auto it = e->ready.begin(); it != e->ready.end();) {
      if (it->stream == stream) {
        dev.release(it->event);
        it = e->ready.erase(it);
      } else {
        ++it;
      }
    }
    e->ready.push_back({stream, done[i], e->in_flight && e->arrival_waiter == stream});
    --e->holds;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<void*>> Runtime::Impl::acquire_layer_locked(int layer, RoleSet roles,
                                                                       std::optional<Tier> tier,
                                                                       StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(check_layer("acquire_layer", layer));
  STRATA_RETURN_IF_ERROR(engine.poll());
  std::vector<Entry*> members = registry.layer_entries(layer, roles);
  std::vector<void*> out;
  out.reserve(members.size());
  for (std::size_t i = 0; i < members.size(); ++i) {
    const Entry& e = *members[i];
    absl::StatusOr<void*> p =
        acquire_locked(*members[i], tier.value_or(e.in_flight ? e.dst.tier : e.loc.tier), stream);
    if (!p.ok()) {
      // Undo the holds taken: nothing was queued on `stream` that uses them yet (only waits), so
      // no release event is needed, and undoing cannot fail.
      for (std::size_t j = 0; j < i; ++j) --members[j]->holds;
      return p.status();
    }
    out.push_back(*p);
  }
  return out;
}

absl::StatusOr<std::vector<void*>> Runtime::acquire_layer(int layer, RoleSet roles, Tier tier,
                                                          StreamHandle stream) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->acquire_layer_locked(layer, roles, tier, stream);
}

absl::Status Runtime::release_layer(int layer, RoleSet roles, StreamHandle stream) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  STRATA_RETURN_IF_ERROR(im.check_layer("release_layer", layer));
  std::vector<Entry*> entries = im.registry.layer_entries(layer, roles);
  STRATA_RETURN_IF_ERROR(im.release_locked(entries, stream));
  PolicyContext ctx(*this);
  absl::Status s = im.policy->on_layer_released(ctx, layer);
  if (!s.ok()) {
    // Held again, so the caller can repeat the call; the policy resumes where it stopped (its
    // steps are each retryable), and the release events already recorded only add waits.
    for (Entry* e : entries) ++e->holds;
  }
  return s;
}

}  // namespace strata::rt
