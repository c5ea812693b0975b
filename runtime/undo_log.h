// runtime/undo_log.h: the undo log, the bytes an optimizer step taken during backward keeps so that
// it can be redone exactly (See Note [Undo log] in undo_log.cpp). Internal to the runtime, which
// calls it under its mutex; clients use Runtime::keep_for_undo, commit_undo and rollback_undo.
//
//   UndoLog log(allocator, engine);
//   STRATA_RETURN_IF_ERROR(log.keep(entry, stream, /*over_link=*/true, /*undo_on_gpu=*/false));
//   ... the kernel overwrites the tensor on `stream` ...
//   valid ? log.commit() : STRATA_RETURN_IF_ERROR(log.rollback());
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/tiered_allocator.h"
#include "runtime/device.h"
#include "runtime/entry.h"
#include "runtime/undo_memory.h"

namespace strata::rt::internal {

class MigrationEngine;

class UndoLog {
 public:
  UndoLog(alloc::TieredAllocator& allocator, MigrationEngine& engine);
  // Copies still kept from the framework's memory go back to it behind their streams; strata's own
  // blocks go with its pools. The runtime commits the log before its streams and pools go, so at
  // its teardown nothing is left here.
  ~UndoLog();
  UndoLog(const UndoLog&) = delete;
  UndoLog& operator=(const UndoLog&) = delete;

  // Keeps e's bytes as they are before the work queued on `stream` after this call writes them (as
  // Runtime::keep_for_undo says); `undo_on_gpu` lets a tensor resting on the GPU be copied there
  // while the GPU tier has room. A tensor kept already, or of no bytes, is left as it is.
  [[nodiscard]] absl::Status keep(Entry* e, StreamHandle stream, bool over_link, bool undo_on_gpu);
  // The step stands: what was kept is freed behind the streams that may still read it.
  void commit();
  // Puts every kept tensor's bytes back (waiting on the host for every stream) and frees what was
  // kept; kFailedPrecondition while a kept tensor is held. A failure part way keeps what is not put
  // back yet, so it can be called again. The caller tells the policy.
  [[nodiscard]] absl::Status rollback();
  // OK when nothing is kept; else kFailedPrecondition naming `what` and the first tensor kept.
  [[nodiscard]] absl::Status check_empty(std::string_view what) const;
  std::size_t size() const { return records_.size(); }
  // Where copies kept on the GPU come from: `memory`, or strata's GPU pool when null
  // (See Note [The undo in the framework's memory] in undo_log.cpp). With nothing kept only.
  void set_memory(std::shared_ptr<UndoMemory> memory) { memory_ = std::move(memory); }

 private:
  struct Record {
    Entry* entry;
    Tier tier;                      // of `kept`
    void* kept;                     // the bytes from before the step: the old home block, or a copy
    void* fresh = nullptr;          // redirect: the block the write-back fills
    StreamHandle stream = nullptr;  // a copy kept on the GPU: the stream that made it
    bool external = false;          // a copy kept on the GPU came from memory_
    // An old home block whose last read, the fetch into its slot, the pool knows already
    // (See Note [Last use] in allocator/block_pool.h).
    bool last_use_marked = false;
  };
  // The copy on the GPU; nullptr when the GPU tier has no room (the caller copies to pinned
  // memory instead).
  absl::StatusOr<void*> keep_on_gpu(const Entry& e, const void* data, StreamHandle stream,
                                    const std::string& owner);
  // An old home block that stays home (its step's write-back never queued, or rolled back):
  // undoes the mark of its last use, since it will be read again.
  void drop_last_use(const Record& r);
  // Frees a copy kept on the GPU behind `stream` (from memory_ when `external`, its bytes back to
  // the budget).
  void free_on_gpu(void* kept, std::size_t bytes, StreamHandle stream, bool external);

  alloc::TieredAllocator& allocator_;
  MigrationEngine& engine_;
  std::vector<Record> records_;
  std::shared_ptr<UndoMemory> memory_;
};

}  // namespace strata::rt::internal
