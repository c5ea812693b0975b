// runtime/staging.h (internal to runtime/): the staging ring room (See Note [Staging ring] in
// runtime.h). It owns the ring's GPU memory, its slots and each staged layer's slot layout, and
// stages layers into slots and back through the migration engine.
//
// Note [Slot layout]
// ~~~~~~~~~~~~~~~~~~
// A layer's tensors of the staging roles sit in its slot at offsets fixed when the layer takes the
// slot (registration order), so a layer staged for some roles first (parameters in forward) can
// take the rest later (gradients) into the places kept for them. The offsets never change while the
// layer holds the slot: a tensor unregistered meanwhile leaves a hole, and one registered meanwhile
// has no place (it is staged once the layer takes a slot again). The runtime calls the ring with
// its mutex held.
//
// Example (inside the runtime, lock held):
//   STRATA_RETURN_IF_ERROR(ring.configure(2, RoleSet::optimizer_states()));
//   STRATA_RETURN_IF_ERROR(ring.stage(3, std::nullopt, StageOrder::kRegistered));
//   ...compute on the staged tensors...
//   STRATA_RETURN_IF_ERROR(ring.unstage(3, std::nullopt));
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "allocator/block_pool.h"
#include "runtime/migration.h"
#include "runtime/registry.h"

namespace strata::rt::internal {

class StagingRing {
 public:
  StagingRing(Registry& registry, MigrationEngine& engine, alloc::TieredAllocator& allocator,
              std::unique_ptr<alloc::BlockPool> pool);

  absl::Status configure(int slots, RoleSet roles);
  absl::Status stage(int layer, std::optional<RoleSet> roles, StageOrder order);
  absl::Status unstage(int layer, std::optional<RoleSet> write_back);
  bool is_staged(int layer) const { return staged_layers_.count(layer) > 0; }
  void staged_tensors(int layer, std::vector<TensorHandle>& out) const;
  // An entry about to be unregistered leaves its layer's slot, if the layer has one (its place
  // stays a hole).
  void forget(Entry& e);
  // Waits for everything that used the ring, then frees it (and gives the main GPU pool the whole
  // budget back). A failure part way leaves the rest for the next call.
  absl::Status release();
  // Frees the ring without waiting: its memory goes back to the pool only once the copy and
  // compute streams have passed this point (the runtime's teardown after a failed wait).
  void abandon();

  std::size_t bytes() const { return slot_bytes_ * slots_.size(); }
  RoleSet roles() const { return roles_; }
  alloc::BlockPool& pool() { return *pool_; }

 private:
  struct Slot {
    std::byte* base = nullptr;
    int layer = -1;
    // Every tensor of the staging roles the layer had when it took the slot, with its offset; the
    // occupants are the ones copied in so far, in arrival order (See Note [Slot layout]).
    std::vector<std::pair<Entry*, std::size_t>> layout;
    std::vector<Entry*> occupants;
    // Complete when everything that used the slot's last contents is done (copies out of it, the
    // fetch into it, compute that read it); the next fetch into the slot waits for them on the GPU.
    std::vector<EventHandle> free_events;
    // Write-backs out of the slot were queued but the event that marks them read out could not be
    // recorded yet: the slot stays taken until a retried unstage records it.
    bool read_out_pending = false;
    // When the slot was last freed, in releases of the ring (0: never); a fetch takes the free
    // slot freed longest ago.
    std::uint64_t freed = 0;
  };

  absl::Status wait_free_events();
  // Waits for everything that used the ring, frees it and gives its segment back.
  absl::Status free_memory();
  // The layer's tensors of the staging roles with their offsets in a slot, and the bytes they take.
  std::vector<std::pair<Entry*, std::size_t>> layout_of(int layer, std::size_t& bytes) const;

  Registry& registry_;
  MigrationEngine& engine_;
  alloc::TieredAllocator& allocator_;
  std::unique_ptr<alloc::BlockPool> pool_;
  RoleSet roles_;
  std::size_t slot_bytes_ = 0;
  void* memory_ = nullptr;
  std::vector<Slot> slots_;
  int next_slot_ = 0;
  std::uint64_t releases_ = 0;        // slots freed so far
  std::map<int, int> staged_layers_;  // layer -> slot
  std::int64_t staged_now_ = 0;
};

}  // namespace strata::rt::internal
