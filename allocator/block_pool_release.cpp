// allocator/block_pool_release.cpp: the BlockPool member functions that decide when freed memory
// may be reused or leave the pool: the streams that use a block and its last use on them, blocks
// waiting behind stream events (See Note [Stream ordering]; See Note [Last use]; See Note [Withheld
// blocks], all in block_pool.h), the merge of lazily freed blocks
// (See Note [Lazy coalescing] in block_pool.h) and the return of entirely free segments to the
// upstream (trim and the out-of-memory fallback). Kept apart from block_pool.cpp so each file stays
// readable.
#include "allocator/block_pool.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/strings.h"

namespace strata::alloc {

absl::Status BlockPool::record_stream(void* ptr, StreamHandle stream) {
  return add_stream_use(ptr, stream, /*last=*/false, "record_stream");
}

absl::Status BlockPool::mark_last_use(void* ptr, StreamHandle stream) {
  return add_stream_use(ptr, stream, /*last=*/true, "mark_last_use");
}

absl::Status BlockPool::add_stream_use(void* ptr, StreamHandle stream, bool last,
                                       std::string_view what) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    return absl::InvalidArgumentError(
        str_cat(what, " in tier ", tier_name(config_.tier), ": ", ptr, " is not a live block"));
  }
  if (stream_ops_ == nullptr) {
    return absl::FailedPreconditionError(
        str_cat(what, " in tier ", tier_name(config_.tier), ": this pool has no stream events"));
  }
  Block* block = it->second;
  if (stream == block->stream) return absl::OkStatus();
  EventHandle event = nullptr;
  if (last) {
    STRATA_ASSIGN_OR_RETURN(event, stream_ops_->record(stream));
  }
  auto use = std::find_if(block->extra_streams.begin(), block->extra_streams.end(),
                          [&](const Block::StreamUse& u) { return u.stream == stream; });
  if (use == block->extra_streams.end()) {
    block->extra_streams.push_back({stream, event});
    return absl::OkStatus();
  }
  // A later use, or a later last use: the mark before it no longer says when the stream is done
  // (See Note [Last use] in block_pool.h).
  if (use->last_use != nullptr) stream_ops_->release(use->last_use);
  use->last_use = event;
  return absl::OkStatus();
}

void BlockPool::withhold_locked(Block* block) {
  if (block->withheld) return;
  block->withheld = true;
  ++stats_.num_withheld_blocks;
  stats_.withheld_bytes.add(static_cast<std::int64_t>(block->size));
}

void BlockPool::event_done_locked(Block* block) {
  if (--block->pending_events > 0) return;
  stats_.pending_free_bytes.add(-static_cast<std::int64_t>(block->size));
  if (block->withheld) {
    block->withheld = false;
    stats_.withheld_bytes.add(-static_cast<std::int64_t>(block->size));
  }
  free_block_locked(block, /*merge=*/true);
}

void BlockPool::retry_unrecorded_locked() {
  // An event recorded now on the stream completes after all the work the stream had when the block
  // was freed (and more), so it is a safe stand-in for the one that could not be recorded then.
  for (std::size_t i = 0; i < unrecorded_.size();) {
    absl::StatusOr<EventHandle> event = stream_ops_->record(unrecorded_[i].stream);
    if (!event.ok()) {
      ++i;
      continue;
    }
    pending_.push_back({*event, unrecorded_[i].block});
    unrecorded_[i] = unrecorded_.back();
    unrecorded_.pop_back();
  }
}

void BlockPool::process_ready_events_locked(bool all) {
  if (!unrecorded_.empty()) retry_unrecorded_locked();
  if (all) {
    std::deque<PendingEvent> still;
    for (const PendingEvent& p : pending_) {
      absl::StatusOr<bool> done = stream_ops_->query(p.event);
      if (!done.ok() || !*done) {  // unknown counts as not done: fail closed
        still.push_back(p);
        continue;
      }
      stream_ops_->release(p.event);
      event_done_locked(p.block);
    }
    pending_.swap(still);
    return;
  }
  // Events complete roughly in the order they were recorded; stop at the first that has not, as
  // PyTorch does, so the common case costs one query.
  while (!pending_.empty()) {
    PendingEvent& front = pending_.front();
    absl::StatusOr<bool> done = stream_ops_->query(front.event);
    if (!done.ok() || !*done) return;  // unknown counts as not done: fail closed
    stream_ops_->release(front.event);
    Block* block = front.block;
    pending_.pop_front();
    event_done_locked(block);
  }
}

absl::Status BlockPool::wait_all_pending_locked() {
  if (!unrecorded_.empty()) retry_unrecorded_locked();
  absl::Status status;
  if (!unrecorded_.empty()) {
    status = absl::UnavailableError(
        str_cat(unrecorded_.size(), " freed block(s) of tier ", tier_name(config_.tier),
                " are withheld: no event can be recorded on their streams"));
  }
  // The events to wait for now; a wait that fails keeps its event for the next try
  // (See Note [Withheld blocks]).
  std::deque<PendingEvent> waits;
  waits.swap(pending_);
  while (!waits.empty()) {
    PendingEvent entry = waits.front();
    waits.pop_front();
    ++stats_.num_event_waits;
    mu_.unlock();
    absl::Status s = stream_ops_->synchronize(entry.event);
    mu_.lock();
    if (!s.ok()) {
      status.Update(s);
      withhold_locked(entry.block);
      pending_.push_back(entry);
      continue;
    }
    stream_ops_->release(entry.event);
    event_done_locked(entry.block);
  }
  return status;
}

absl::Status BlockPool::synchronize_pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return wait_all_pending_locked();
}

void BlockPool::consolidate_locked() {
  for (auto& [base, segment] : segments_) {
    for (Block* b = segment->first; b != nullptr; b = b->next) {
      if (!is_free(b) || b->next == nullptr || !is_free(b->next)) continue;
      FreeSet& set = free_set(b->small);
      set.erase(free_key(b));
      while (b->next != nullptr && is_free(b->next)) {
        set.erase(free_key(b->next));
        absorb_next_locked(b);
      }
      set.insert(free_key(b));
    }
  }
  unmerged_frees_ = 0;
}

void BlockPool::consolidate() {
  std::lock_guard<std::mutex> lock(mu_);
  consolidate_locked();
}

std::size_t BlockPool::release_cached_segments_locked() {
  consolidate_locked();
  // Take every entirely free segment out of the pool first, so no other thread can hand out its
  // block while the lock is released below; reserved_bytes keeps counting them until they are gone.
  std::vector<Segment*> victims;
  for (auto& [base, segment] : segments_) {
    Block* b = segment->first;
    if (!segment->expandable && b->next == nullptr && is_free(b)) victims.push_back(segment);
  }
  for (Segment* segment : victims) {
    free_set(segment->small).erase(free_key(segment->first));
    segments_.erase(reinterpret_cast<std::uintptr_t>(segment->base));
  }
  std::size_t released = release_expandable_locked();
  for (Segment* segment : victims) {
    mu_.unlock();
    // Work queued on the segment's stream before its last free may still touch it; wait for that
    // stream before the memory leaves the pool (See Note [Stream ordering] in block_pool.h). Work
    // on other streams is covered by the blocks' own events (record_stream), and must be: a
    // virtual-memory segment is unmapped at once, with no device-wide wait as cudaFree's to hide a
    // missing one. Fail closed: a segment whose stream cannot be waited on stays in the pool.
    absl::Status s;
    if (stream_ops_ != nullptr) {
      absl::StatusOr<EventHandle> event = stream_ops_->record(segment->stream);
      s = event.status();
      if (event.ok()) {
        s = stream_ops_->synchronize(*event);
        stream_ops_->release(*event);
      }
    }
    const auto start = std::chrono::steady_clock::now();
    if (s.ok()) s = upstream_->deallocate(segment->base, segment->size);
    const std::int64_t took = elapsed_ns(start);
    mu_.lock();
    stats_.upstream_free_ns += took;
    if (!s.ok()) {
      std::fprintf(stderr, "strata: keeping a segment of tier %s: %s\n",
                   std::string(tier_name(config_.tier)).c_str(), std::string(s.message()).c_str());
      segments_.emplace(reinterpret_cast<std::uintptr_t>(segment->base), segment);
      free_set(segment->small).insert(free_key(segment->first));
      continue;
    }
    stats_.reserved_bytes.add(-static_cast<std::int64_t>(segment->size));
    stats_.segments.add(-1);
    ++stats_.num_segment_frees;
    budget_->release(segment->size);
    released += segment->size;
    delete_block_locked(segment->first);
    delete segment;
  }
  return released;
}

absl::StatusOr<std::size_t> BlockPool::trim() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!pending_.empty()) process_ready_events_locked();
  return release_cached_segments_locked();
}

}  // namespace strata::alloc
