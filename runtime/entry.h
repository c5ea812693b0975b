// runtime/entry.h (internal to runtime/): what the runtime keeps for each registered tensor.
//
// An Entry is shared by the runtime's rooms: the registry owns it (registry.h), the migration
// engine moves it (migration.h), the staging ring lends it a slot (staging.h), and the guards count
// its holds (guards.cpp). Every field is read and written with the runtime's one mutex held.
//
// Example (inside the runtime, lock held):
//   Entry& e = *registry.get(handle).value();
//   if (!e.in_flight && e.loc.tier != Tier::kGpu) STRATA_RETURN_IF_ERROR(engine.migrate(e, ...));
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/device.h"
#include "runtime/tensor.h"

namespace strata::rt::internal {

// Where a tensor's bytes are: a block of a tier's main pool, or a region of a staging slot.
struct Location {
  Tier tier = Tier::kGpu;
  void* ptr = nullptr;
  int slot = -1;  // >= 0: staging slot, not a pool block
};

struct Entry {
  TensorHandle handle;
  TensorSpec spec;
  std::size_t bytes = 0;
  Location loc;
  bool in_flight = false;
  Location dst;
  StreamHandle copy_stream = nullptr;
  EventHandle arrival = nullptr;
  // The stream an acquire made wait for `arrival` (See Note [Covered arrival] in migration.cpp).
  StreamHandle arrival_waiter = nullptr;
  // Events after which the data is complete: the last release on each compute stream that used
  // it, and copies finished early from the bookkeeping's point of view. Later copies wait on all
  // of them on the GPU; a release replaces only the event of its own stream.
  struct Ready {
    StreamHandle stream;
    EventHandle event;
    // Recorded on a stream after it waited for the copy in flight (See Note [Covered arrival]).
    bool covers_arrival = false;
  };
  std::vector<Ready> ready;
  int holds = 0;
  std::uint64_t version = 0;
  // While staged: the home block the tensor keeps (See Note [Staging ring] in runtime.h); the fetch
  // reads it, a write-back copies into it, a discard just returns to it.
  Location rest;
  void* reported = nullptr;  // the address on_moved last reported
  bool offloaded = false;    // moved to the host by offload_all, back at reload_all
  // The tensor's bytes from before the overlapped step are kept (See Note [Undo log] in
  // undo_log.cpp). A staged one's write-back goes into undo_fresh, a block of its home tier, which
  // becomes its home, and the old home block (`rest` until then) is the log's; so the staged data
  // must be written back, never discarded.
  bool undo_kept = false;
  void* undo_fresh = nullptr;
};

}  // namespace strata::rt::internal
