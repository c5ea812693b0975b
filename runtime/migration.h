// runtime/migration.h (internal to runtime/): the migration engine room. It owns the copy streams,
// the events that tell when copies and compute are done, the pinned bounce buffers for pageable
// memory, copy timing, and the on_moved callbacks; it moves entries between tiers and completes
// their moves.
//
// Stream ordering as the engine keeps it (See Note [Stream ordering] in allocator/block_pool.h; its
// rules are numbered in docs/design.md, section 6): a copy waits on the GPU for every earlier use
// of its source; the source stays the tensor's until the copy's event completed; memory a queued
// copy may still touch goes back to its pool only through free_after(), which makes the pool wait
// for the copy stream before the memory is reused. The runtime calls the engine with its mutex
// held.
//
// Example (inside the runtime, lock held):
//   STRATA_RETURN_IF_ERROR(engine.migrate(e, Tier::kPinnedHost));   // queued, returns at once
//   STRATA_RETURN_IF_ERROR(engine.poll());                            // completes what finished
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "allocator/block_pool.h"
#include "allocator/tiered_allocator.h"
#include "runtime/device.h"
#include "runtime/entry.h"
#include "runtime/runtime.h"

namespace strata::rt::internal {

class MigrationEngine {
 public:
  MigrationEngine(std::shared_ptr<Device> device, alloc::TieredAllocator& allocator,
                  std::unique_ptr<alloc::BlockPool> bounce_pool);
  // Makes the copy streams and the runtime's own compute stream.
  absl::Status create_streams();
  // Streams synchronized and destroyed; called last, after every wait the runtime could make.
  void destroy_streams(bool device_ok);

  // Queues a move of e into dst_tier (a new block of its main pool, or dst_ptr when given; a
  // staging slot region when slot >= 0). The copy waits on the GPU for wait_first. A failure
  // leaves e where it was, bit for bit, and frees nothing a queued copy may still write.
  absl::Status migrate(Entry& e, Tier dst_tier, void* dst_ptr = nullptr, int slot = -1,
                       const std::vector<EventHandle>& wait_first = {});
  // Makes the destination e's location. early: the copy may still run (see migration.cpp).
  void finish(Entry& e, bool early);
  // Completes moves whose copies finished. Never waits.
  absl::Status poll();
  // Waits on the host for e's move, then completes it.
  absl::Status wait_entry(Entry& e);
  absl::Status wait_all();
  // Waits on the host for every recorded use of e's data (its ready events).
  absl::Status wait_ready_on_host(Entry& e);
  // Copies bytes and waits for the copy (registration, read, write). When the wait fails, dst is
  // still being written: the caller must not free it but through free_after(..., d2h()).
  absl::Status host_copy(void* dst, const void* src, std::size_t bytes);
  // See Note [Compute fence] in migration.cpp.
  absl::Status fence_compute();
  // Gives the memory of a location back to its pool (staging slots are the ring's: nothing).
  void free_location(const Entry& e, const Location& loc);
  // Gives a block back to its pool, reusable only once each of `streams` has passed this point (a
  // copy on one of them may still use the block).
  void free_after(Tier tier, void* ptr, std::initializer_list<StreamHandle> streams);
  // Reports e's new address to the on_moved callbacks when it changed.
  void notify(Entry& e, Tier tier, void* ptr);
  // Reads the timing of completed copies and stalls; with wait, waits for all of them.
  void drain_timing(bool wait);
  // Frees the bounce buffers once no copy uses them.
  absl::Status release_bounce();
  // Teardown after a failed wait (See Note [Teardown after a failed wait] in runtime.cpp): drops
  // the timing events unread and gives the bounce buffers back behind the copy streams.
  void abandon();
  // Counts a compute stream's wait on a copy, measured between two timing events.
  void add_stall(EventHandle before, EventHandle after, StreamHandle stream) {
    stalls_.push_back({before, after, stream});
  }

  Device& device() { return *device_; }
  const std::shared_ptr<Device>& device_ptr() const { return device_; }
  StreamHandle h2d() const { return h2d_; }
  StreamHandle d2h() const { return d2h_; }
  StreamHandle compute() const { return compute_; }
  void set_compute(StreamHandle s) { compute_ = s; }
  RuntimeStats& stats() { return stats_; }
  const RuntimeStats& stats() const { return stats_; }
  std::vector<Entry*>& in_flight() { return in_flight_; }
  alloc::BlockPool& bounce_pool() { return *bounce_pool_; }
  std::map<int, std::function<void(TensorHandle, Tier, void*)>>& on_moved() { return on_moved_; }

 private:
  // Both lists keep the order their entries were queued in on their stream (See Note [Polling in
  // stream order] in migration.cpp).
  struct TimedCopy {
    EventHandle start;
    EventHandle end;
    StreamHandle stream;
    bool h2d;
    std::size_t bytes;
  };
  struct Stall {
    EventHandle start;
    EventHandle end;
    StreamHandle stream;
  };

  // Where a move goes, whether migrate allocated it (so a failure frees it), and the copy stream
  // of its direction.
  struct Destination {
    Location loc;
    bool allocated = false;
    StreamHandle stream = nullptr;
  };

  // migrate's steps (See MigrationEngine::migrate in migration.cpp).
  absl::Status check_movable(const Entry& e) const;
  absl::StatusOr<Destination> destination(const Entry& e, Location loc);
  absl::Status copy_through_bounce(Entry& e, const Destination& dst,
                                   const std::vector<EventHandle>& wait_first);
  absl::Status copy_on_stream(Entry& e, const Destination& dst,
                              const std::vector<EventHandle>& wait_first);
  void mark_in_flight(Entry& e, const Destination& dst, EventHandle arrival);
  absl::Status fail_move(const Entry& e, const Destination& dst, const absl::Status& s,
                         bool queued);
  absl::Status bounce_copy(Entry& e, const Location& dst);
  absl::Status ensure_bounce();

  std::shared_ptr<Device> device_;
  alloc::TieredAllocator& allocator_;
  std::unique_ptr<alloc::BlockPool> bounce_pool_;
  StreamHandle h2d_ = nullptr;
  StreamHandle d2h_ = nullptr;
  StreamHandle own_compute_ = nullptr;
  StreamHandle compute_ = nullptr;
  std::vector<Entry*> in_flight_;
  std::vector<TimedCopy> timed_;  // copies whose timing is still to be read
  std::vector<Stall> stalls_;
  RuntimeStats stats_;
  std::map<int, std::function<void(TensorHandle, Tier, void*)>> on_moved_;
  // Pinned bounce buffers for pageable copies, from a pool of the runtime's own: a spill to
  // pageable memory happens when the pinned budget is full, so bounce memory cannot come out of it.
  std::vector<void*> bounce_;
  std::vector<EventHandle> bounce_events_;
};

}  // namespace strata::rt::internal
