// runtime/migration.cpp: the migration engine room (migration.h) and the public migration calls of
// Runtime: migrate, poll, wait_all.
#include "runtime/migration.h"

#include <algorithm>
#include <cstring>

#include "absl/algorithm/container.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "base/status.h"
#include "base/strings.h"
#include "runtime/runtime_impl.h"

namespace strata::rt {
namespace internal {
namespace {

bool is_gpu(Tier t) { return t == Tier::kGpu; }

// The smallest copy whose time goes into the engine rates (See Note [Timed copies]).
constexpr std::size_t kTimedCopyMinBytes = std::size_t{1} << 20;

}  // namespace

MigrationEngine::MigrationEngine(std::shared_ptr<Device> device, alloc::TieredAllocator& allocator,
                                 std::unique_ptr<alloc::BlockPool> bounce_pool)
    : device_(std::move(device)), allocator_(allocator), bounce_pool_(std::move(bounce_pool)) {}

absl::Status MigrationEngine::create_streams() {
  STRATA_ASSIGN_OR_RETURN(h2d_, device_->create_stream());
  STRATA_ASSIGN_OR_RETURN(d2h_, device_->create_stream());
  STRATA_ASSIGN_OR_RETURN(own_compute_, device_->create_stream());
  compute_ = own_compute_;
  return absl::OkStatus();
}

void MigrationEngine::destroy_streams(bool device_ok) {
  for (StreamHandle s : {h2d_, d2h_, own_compute_}) {
    if (s == nullptr) continue;
    if (device_ok) (void)device_->stream_synchronize(s);
    device_->destroy_stream(s);
  }
  h2d_ = d2h_ = own_compute_ = nullptr;
}

void MigrationEngine::free_location(const Entry& e, const Location& loc) {
  if (loc.ptr == nullptr) return;
  if (loc.slot >= 0) return;  // staging slot regions are the ring's, not the tensor's
  absl::Status s = allocator_.deallocate(loc.tier, loc.ptr);
  STRATA_CHECK(s.ok(), "freeing the storage of '", e.spec.name, "': ", s.message());
}

void MigrationEngine::free_after(Tier tier, void* ptr,
                                 std::initializer_list<StreamHandle> streams) {
  for (StreamHandle stream : streams) {
    absl::Status s = allocator_.record_stream(tier, ptr, stream);
    STRATA_CHECK(s.ok(), "record_stream on a block being freed: ", s.message());
  }
  absl::Status s = allocator_.deallocate(tier, ptr);
  STRATA_CHECK(s.ok(), "freeing a block a copy may still use: ", s.message());
}

absl::Status MigrationEngine::host_copy(void* dst, const void* src, std::size_t bytes) {
  // A copy the host waits for: through the D2H stream, which orders it after nothing else.
  STRATA_RETURN_IF_ERROR(device_->copy_async(dst, src, bytes, d2h_));
  return device_->stream_synchronize(d2h_);
}

absl::Status MigrationEngine::wait_ready_on_host(Entry& e) {
  // Each event is dropped once waited for, so a failure part way leaves the rest for a retry.
  while (!e.ready.empty()) {
    STRATA_RETURN_IF_ERROR(device_->synchronize(e.ready.back().event));
    device_->release(e.ready.back().event);
    e.ready.pop_back();
  }
  return absl::OkStatus();
}

absl::Status MigrationEngine::ensure_bounce() {
  if (!bounce_.empty()) return absl::OkStatus();
  for (int i = 0; i < kBounceSlots; ++i) {
    absl::StatusOr<void*> b =
        bounce_pool_->allocate(kBounceChunkBytes, {.owner = "runtime.bounce"});
    if (!b.ok()) {
      for (void* p : bounce_) (void)bounce_pool_->deallocate(p);
      bounce_.clear();
      return b.status();
    }
    bounce_.push_back(*b);
  }
  bounce_events_.assign(kBounceSlots, nullptr);
  return absl::OkStatus();
}

absl::Status MigrationEngine::release_bounce() {
  while (!bounce_.empty()) {
    if (bounce_events_.back() != nullptr) {
      STRATA_RETURN_IF_ERROR(device_->synchronize(bounce_events_.back()));
      device_->release(bounce_events_.back());
      bounce_events_.back() = nullptr;
    }
    STRATA_RETURN_IF_ERROR(bounce_pool_->deallocate(bounce_.back()));
    bounce_.pop_back();
    bounce_events_.pop_back();
  }
  return absl::OkStatus();
}

void MigrationEngine::abandon() {
  for (const TimedCopy& t : timed_) {
    device_->release_timed(t.start);
    device_->release_timed(t.end);
  }
  timed_.clear();
  for (const Stall& st : stalls_) {
    device_->release_timed(st.start);
    device_->release_timed(st.end);
  }
  stalls_.clear();
  for (std::size_t b = 0; b < bounce_.size(); ++b) {
    if (bounce_events_[b] != nullptr) device_->release(bounce_events_[b]);
    for (StreamHandle s : {h2d_, d2h_}) (void)bounce_pool_->record_stream(bounce_[b], s);
    (void)bounce_pool_->deallocate(bounce_[b]);
  }
  bounce_.clear();
  bounce_events_.clear();
}

// Copies that involve pageable memory go through pinned bounce buffers in kBounceChunkBytes
// pieces. The host copies between pageable and pinned memory itself, so it waits for each piece's
// device copy: these migrations complete before this returns (except the tail of an H2D copy).
absl::Status MigrationEngine::bounce_copy(Entry& e, const Location& dst) {
  const Location src = e.loc;
  auto* out = static_cast<std::byte*>(dst.ptr);
  const auto* in = static_cast<const std::byte*>(src.ptr);
  STRATA_RETURN_IF_ERROR(wait_ready_on_host(e));
  if (!is_gpu(src.tier) && !is_gpu(dst.tier)) {  // pinned <-> pageable: a plain host copy
    std::memcpy(out, in, e.bytes);
    stats_.migrated_bytes_h2h += static_cast<std::int64_t>(e.bytes);
    return absl::OkStatus();
  }
  STRATA_RETURN_IF_ERROR(ensure_bounce());
  const bool to_gpu = is_gpu(dst.tier);
  StreamHandle stream = to_gpu ? h2d_ : d2h_;
  struct Piece {
    std::size_t offset = 0;
    std::size_t bytes = 0;
  };
  std::vector<Piece> landing(kBounceSlots);  // D2H pieces waiting to be copied out on the host
  int k = 0;
  for (std::size_t off = 0; off < e.bytes; off += kBounceChunkBytes, ++k) {
    const std::size_t n = std::min(kBounceChunkBytes, e.bytes - off);
    const int b = k % kBounceSlots;
    if (bounce_events_[b] != nullptr) {
      STRATA_RETURN_IF_ERROR(device_->synchronize(bounce_events_[b]));
      device_->release(bounce_events_[b]);
      bounce_events_[b] = nullptr;
      if (!to_gpu) std::memcpy(out + landing[b].offset, bounce_[b], landing[b].bytes);
    }
    if (to_gpu) {
      std::memcpy(bounce_[b], in + off, n);
      STRATA_RETURN_IF_ERROR(device_->copy_async(out + off, bounce_[b], n, stream));
    } else {
      STRATA_RETURN_IF_ERROR(device_->copy_async(bounce_[b], in + off, n, stream));
      landing[b] = {off, n};
    }
    STRATA_ASSIGN_OR_RETURN(bounce_events_[b], device_->record(stream));
  }
  for (int b = 0; b < kBounceSlots; ++b) {
    if (bounce_events_[b] == nullptr) continue;
    STRATA_RETURN_IF_ERROR(device_->synchronize(bounce_events_[b]));
    device_->release(bounce_events_[b]);
    bounce_events_[b] = nullptr;
    if (!to_gpu) std::memcpy(out + landing[b].offset, bounce_[b], landing[b].bytes);
  }
  (to_gpu ? stats_.migrated_bytes_h2d : stats_.migrated_bytes_d2h) +=
      static_cast<std::int64_t>(e.bytes);
  return absl::OkStatus();
}

// A move is four steps: check that the tensor may move, find where it goes (allocating a block
// unless the caller gave one), queue the copy (through the pinned bounce buffers when either side
// is pageable, else on the copy stream of its direction), and mark the tensor in flight. A step
// that fails gives back what the earlier ones took (fail_move) and leaves the tensor where it was.
absl::Status MigrationEngine::migrate(Entry& e, Tier dst_tier, void* dst_ptr, int slot,
                                      const std::vector<EventHandle>& wait_first) {
  STRATA_RETURN_IF_ERROR(check_movable(e));
  if (e.loc.tier == dst_tier && slot < 0 && e.loc.slot < 0 && dst_ptr == nullptr) {
    return absl::OkStatus();
  }
  if (e.bytes == 0) {
    e.loc = {dst_tier, nullptr, slot};
    return absl::OkStatus();
  }
  STRATA_ASSIGN_OR_RETURN(const Destination dst, destination(e, {dst_tier, dst_ptr, slot}));
  const bool pageable = e.loc.tier == Tier::kPageableHost || dst_tier == Tier::kPageableHost;
  return pageable ? copy_through_bounce(e, dst, wait_first) : copy_on_stream(e, dst, wait_first);
}

absl::Status MigrationEngine::check_movable(const Entry& e) const {
  if (e.holds > 0) {
    return absl::FailedPreconditionError(str_cat("tensor '", e.spec.name, "' is held by ", e.holds,
                                                 " acquire(s); release it before moving it"));
  }
  if (e.in_flight) {
    return absl::FailedPreconditionError(
        str_cat("tensor '", e.spec.name, "' is already moving to ", tier_name(e.dst.tier)));
  }
  return absl::OkStatus();
}

// Note [Runtime blocks are stream-agnostic]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The runtime frees a block only after the copies and compute that used it are known complete
// (finish) or hands it back with record_stream, so its blocks need no per-stream pool: one pool
// per tier, reused by any copy.
absl::StatusOr<MigrationEngine::Destination> MigrationEngine::destination(const Entry& e,
                                                                          Location loc) {
  Destination dst{loc, loc.ptr == nullptr, is_gpu(loc.tier) ? h2d_ : d2h_};
  if (!dst.allocated) return dst;
  absl::StatusOr<void*> block =
      allocator_.allocate(loc.tier, e.bytes, {.stream = nullptr, .owner = e.spec.name});
  if (!block.ok()) {
    ++stats_.failed_migrations;
    return absl::Status(block.status().code(),
                        str_cat("moving '", e.spec.name, "' to ", tier_name(loc.tier), ": ",
                                block.status().message()));
  }
  dst.loc.ptr = *block;
  return dst;
}

// `queued`: a copy into the destination may have been queued and still run, so a block allocated
// for it is freed only once the copy stream is past it.
absl::Status MigrationEngine::fail_move(const Entry& e, const Destination& dst,
                                        const absl::Status& s, bool queued) {
  ++stats_.failed_migrations;
  if (dst.allocated) {
    if (queued) {
      free_after(dst.loc.tier, dst.loc.ptr, {dst.stream});
    } else {
      (void)allocator_.deallocate(dst.loc.tier, dst.loc.ptr);
    }
  }
  return absl::Status(s.code(),
                      str_cat("moving '", e.spec.name, "' to ", tier_name(dst.loc.tier),
                              " failed; it stays on ", tier_name(e.loc.tier), ": ", s.message()));
}

void MigrationEngine::mark_in_flight(Entry& e, const Destination& dst, EventHandle arrival) {
  e.in_flight = true;
  e.dst = dst.loc;
  e.copy_stream = dst.stream;
  e.arrival = arrival;
  e.arrival_waiter = nullptr;
  in_flight_.push_back(&e);
}

absl::Status MigrationEngine::copy_through_bounce(Entry& e, const Destination& dst,
                                                  const std::vector<EventHandle>& wait_first) {
  const bool to_gpu = is_gpu(dst.loc.tier);
  for (EventHandle w : wait_first) {
    absl::Status s = device_->synchronize(w);
    if (!s.ok()) return fail_move(e, dst, s, false);
  }
  absl::Status s = bounce_copy(e, dst.loc);
  if (!s.ok()) return fail_move(e, dst, s, to_gpu);
  // Done on the host's side; an H2D tail may still be in the stream, so complete by event.
  absl::StatusOr<EventHandle> arrival = device_->record(dst.stream);
  if (!arrival.ok()) return fail_move(e, dst, arrival.status(), to_gpu);
  // The ready events stay; none of them covers the new copy.
  for (Entry::Ready& r : e.ready) r.covers_arrival = false;
  mark_in_flight(e, dst, *arrival);
  return absl::OkStatus();
}

// Note [Timed copies]
// ~~~~~~~~~~~~~~~~~~~
// A copy's timing takes two more event records on its stream, as much host time as the copy
// itself when it is small (bench/results/2026-11-24-H100-compare measured it), and the rate of a
// copy that short says little about the link. Only copies of kTimedCopyMinBytes or more are
// timed; the engine rates (RuntimeStats::h2d_gbps) are those copies' bytes over their time.
absl::Status MigrationEngine::copy_on_stream(Entry& e, const Destination& dst,
                                             const std::vector<EventHandle>& wait_first) {
  const StreamHandle stream = dst.stream;
  // See Note [Stream ordering], rule 2: the copy waits for every prior use of the data on the GPU,
  // and the source stays the tensor's until the copy's event completes (finish).
  for (const Entry::Ready& r : e.ready) {
    absl::Status s = device_->stream_wait(stream, r.event);
    if (!s.ok()) return fail_move(e, dst, s, false);
  }
  for (EventHandle w : wait_first) {
    absl::Status s = device_->stream_wait(stream, w);
    if (!s.ok()) return fail_move(e, dst, s, false);
  }
  const bool timed = e.bytes >= kTimedCopyMinBytes;
  absl::StatusOr<EventHandle> start = timed ? device_->record_timed(stream) : nullptr;
  if (!start.ok()) return fail_move(e, dst, start.status(), false);
  auto release_start = [&] {
    if (*start != nullptr) device_->release_timed(*start);
  };
  absl::Status s = device_->copy_async(dst.loc.ptr, e.loc.ptr, e.bytes, stream);
  if (!s.ok()) {
    release_start();
    return fail_move(e, dst, s, false);
  }
  absl::StatusOr<EventHandle> end = timed ? device_->record_timed(stream) : nullptr;
  absl::StatusOr<EventHandle> arrival =
      end.ok() ? device_->record(stream) : absl::StatusOr<EventHandle>(end.status());
  if (!arrival.ok()) {
    // The copy is queued and nothing tells when it is done: the destination goes back to its pool
    // behind the copy stream.
    release_start();
    if (end.ok() && *end != nullptr) device_->release_timed(*end);
    return fail_move(e, dst, arrival.status(), true);
  }
  for (const Entry::Ready& r : e.ready) device_->release(r.event);
  e.ready.clear();
  mark_in_flight(e, dst, *arrival);
  // Read once the copy is done, whatever becomes of the move (See Note [Polling in stream order]).
  if (*start != nullptr) timed_.push_back({*start, *end, stream, is_gpu(dst.loc.tier), e.bytes});
  (is_gpu(dst.loc.tier) ? stats_.migrated_bytes_h2d : stats_.migrated_bytes_d2h) +=
      static_cast<std::int64_t>(e.bytes);
  return absl::OkStatus();
}

// Makes the destination the tensor's location. With early == false the copy is known complete and
// the source is freed at once; with early == true the copy may still run, so the source block is
// handed back with record_stream (reused only after the copy stream passes this point) and the
// arrival event becomes a ready event that later GPU work waits on.
void MigrationEngine::finish(Entry& e, bool early) {
  const Location src = e.loc;
  const bool retained = src.ptr != nullptr && src.ptr == e.rest.ptr;
  if (src.slot < 0 && src.ptr != nullptr && !retained) {
    if (early) {
      absl::Status s = allocator_.record_stream(src.tier, src.ptr, e.copy_stream);
      STRATA_CHECK(s.ok(), "record_stream on the source of '", e.spec.name, "': ", s.message());
    }
    // Kernels the loop queued after migrate() may still read the source (the tensor's address was
    // the source until now): it is reused only once the compute stream passed this point.
    if (src.tier != Tier::kPageableHost) {
      absl::Status s = allocator_.record_stream(src.tier, src.ptr, compute_);
      STRATA_CHECK(s.ok(), "record_stream on the source of '", e.spec.name, "': ", s.message());
    }
    free_location(e, src);
  }
  // Note [Covered arrival]
  // ~~~~~~~~~~~~~~~~~~~~~~
  // A release on a stream that had waited for the copy already orders what comes after it behind
  // the copy; later copies then need not wait for the copy itself too. Each wait costs a copy
  // stream a pause between copies, and a write-back of a staged tensor would otherwise wait twice.
  const bool covered = std::any_of(e.ready.begin(), e.ready.end(),
                                   [](const Entry::Ready& r) { return r.covers_arrival; });
  if (early && !covered) {
    e.ready.push_back({e.copy_stream, e.arrival});
  } else {
    device_->release(e.arrival);
  }
  e.arrival = nullptr;
  e.arrival_waiter = nullptr;
  e.loc = e.dst;
  if (e.loc.ptr == e.rest.ptr) e.rest = {};  // a write-back into the kept home block: home again
  e.in_flight = false;
  ++e.version;
  ++stats_.num_migrations;
  in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(), &e));
  notify(e, e.loc.tier, e.loc.ptr);
}

void MigrationEngine::notify(Entry& e, Tier tier, void* ptr) {
  if (ptr == e.reported) return;
  e.reported = ptr;
  for (const auto& [id, fn] : on_moved_) fn(e.handle, tier, ptr);
}

// Note [Compute fence]
// ~~~~~~~~~~~~~~~~~~~~
// Hooks are the points where the training loop hands control to the runtime; everything queued on
// the compute stream before a hook must finish before a copy queued by the hook touches the same
// data. One event on the compute stream, waited on by both copy streams, orders all of it without
// the host waiting.
absl::Status MigrationEngine::fence_compute() {
  STRATA_ASSIGN_OR_RETURN(EventHandle fence, device_->record(compute_));
  absl::Status s = device_->stream_wait(h2d_, fence);
  if (s.ok()) s = device_->stream_wait(d2h_, fence);
  device_->release(fence);
  return s;
}

namespace {

// Reads and drops the entries of `list` whose end event is done, keeping the others in their order.
// On each stream it asks no further once one is not done (See Note [Polling in stream order]).
template <typename T, typename Done, typename Read>
void drain_in_order(std::vector<T>& list, Done done, Read read) {
  absl::InlinedVector<StreamHandle, 4> busy;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < list.size(); ++i) {
    if (!absl::c_linear_search(busy, list[i].stream)) {
      if (done(list[i].end)) {
        read(list[i]);
        continue;
      }
      busy.push_back(list[i].stream);
    }
    list[kept++] = list[i];
  }
  list.resize(kept);
}

}  // namespace

void MigrationEngine::drain_timing(bool wait) {
  auto done = [&](EventHandle ev) {
    if (wait) return device_->synchronize(ev).ok();
    absl::StatusOr<bool> q = device_->query(ev);
    return q.ok() && *q;
  };
  drain_in_order(timed_, done, [&](const TimedCopy& t) {
    absl::StatusOr<double> ms = device_->elapsed_ms(t.start, t.end);
    if (ms.ok()) {
      (t.h2d ? stats_.h2d_busy_ms : stats_.d2h_busy_ms) += *ms;
      (t.h2d ? stats_.timed_bytes_h2d : stats_.timed_bytes_d2h) +=
          static_cast<std::int64_t>(t.bytes);
    }
    device_->release_timed(t.start);
    device_->release_timed(t.end);
  });
  drain_in_order(stalls_, done, [&](const Stall& st) {
    absl::StatusOr<double> ms = device_->elapsed_ms(st.start, st.end);
    if (ms.ok()) stats_.prefetch_stall_ns += static_cast<std::int64_t>(*ms * 1e6);
    device_->release_timed(st.start);
    device_->release_timed(st.end);
  });
}

// Note [Polling in stream order]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every acquire and every hook polls, so a layer's step polls once a tensor, with a ring's worth of
// copies in flight. A copy's arrival event is recorded on its copy stream right after the copy, and
// in_flight_ keeps the order the moves were queued in (entries leave it, none is reordered), so on
// each copy stream the entries complete in their order in in_flight_: the first one not done
// means none after it on that stream is. poll asks no further on that stream, so a poll costs the
// queries of the copies that finished since the last, plus one a stream still copying, instead of
// one a copy in flight. The timing lists that every poll reads (drain_timing: the timed copies, and
// the waits of a stream that computes) are read the same way, and keep their entries in the order
// each stream was given them. The waits matter most: the host queues a step's work well ahead of
// the GPU, so a whole backward's waits can be pending at once.
absl::Status MigrationEngine::poll() {
  absl::InlinedVector<StreamHandle, 2> busy;  // copy streams found still copying
  for (std::size_t i = 0; i < in_flight_.size();) {
    Entry* e = in_flight_[i];
    if (absl::c_linear_search(busy, e->copy_stream)) {
      ++i;
      continue;
    }
    absl::StatusOr<bool> done = device_->query(e->arrival);
    if (!done.ok()) return done.status();
    if (*done) {
      finish(*e, /*early=*/false);  // erases in_flight_[i]
    } else {
      busy.push_back(e->copy_stream);
      ++i;
    }
  }
  drain_timing(/*wait=*/false);
  return absl::OkStatus();
}

absl::Status MigrationEngine::wait_entry(Entry& e) {
  if (!e.in_flight) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(device_->synchronize(e.arrival));
  finish(e, /*early=*/false);
  return absl::OkStatus();
}

absl::Status MigrationEngine::wait_all() {
  // Copies on one stream complete in order, so waiting for the newest arrival of each copy stream
  // covers all of them: at most one host wait per stream, whatever the number of tensors.
  while (!in_flight_.empty()) {
    absl::flat_hash_map<StreamHandle, EventHandle> newest;
    for (Entry* e : in_flight_) newest[e->copy_stream] = e->arrival;
    for (const auto& [stream, event] : newest) STRATA_RETURN_IF_ERROR(device_->synchronize(event));
    STRATA_RETURN_IF_ERROR(poll());
  }
  drain_timing(/*wait=*/false);
  return absl::OkStatus();
}

}  // namespace internal

absl::Status Runtime::Impl::migrate_locked(TensorHandle tensor, Tier dst) {
  STRATA_ASSIGN_OR_RETURN(internal::Entry * e, registry.get(tensor));
  // Staged, or still arriving in its slot.
  if (e->loc.slot >= 0 || (e->in_flight && e->dst.slot >= 0)) {
    return absl::FailedPreconditionError(str_cat("tensor '", e->spec.name, "' is staged (layer ",
                                                 e->spec.layer, "); unstage_layer first"));
  }
  return engine.migrate(*e, dst);
}

absl::Status Runtime::migrate(TensorHandle tensor, Tier dst) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->migrate_locked(tensor, dst);
}

absl::Status Runtime::poll() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->engine.poll();
}

absl::Status Runtime::wait_all() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->engine.wait_all();
}

}  // namespace strata::rt
