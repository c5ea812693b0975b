// allocator/block_pool.h: one tier's coalescing best-fit pool over large upstream segments.
//
// A BlockPool asks its Upstream for segments and splits them into blocks. Free blocks sit in
// ordered sets keyed by (stream, size, address), so the best fit is one lower_bound. Small requests
// (<= kSmallSize) share kSmallSegmentSize segments so they never split the large segments that
// activations and optimizer states need.
//
// Note [Lazy coalescing]
// ~~~~~~~~~~~~~~~~~~~~~~
// deallocate puts a small block (<= kSmallSize) back into its free set without merging it with free
// neighbours; a request that finds no fit merges everything first (consolidate) and only then
// grows, and so does the segment release of trim and of the out-of-memory path. An alloc+free pair
// of one small size thus costs one free-set erase and one insert instead of the four of
// split-then-merge (measured: 125 -> 96 ns). Large blocks merge at once: best fit among unmerged
// large blocks packed the training-step replay worse (reserved / peak allocated 1.005 -> 1.077).
// Stats measure free space in runs of free blocks, as a merge would make them, so fragmentation is
// the same figure either way.
//
// Rounding (named so tests and docs agree):
//   every size rounds up to a multiple of kBlockGranularity (512 B), so every block is aligned to
//   512 B, which covers the GPU's 256 B and the host's 64 B minimum and any alignment up to
//   kMaxAlignment; small segments are kSmallSegmentSize; a large segment is the request rounded up
//   to kLargeSegmentGranularity.
//
// Note [Stream ordering]
// ~~~~~~~~~~~~~~~~~~~~~~
// Its rules are numbered in docs/design.md, section 6. As the pool implements it:
//   - a block belongs to the stream it was allocated on, and blocks are reused only by that stream;
//     work on one stream runs in order, so a block freed there can be handed out again at once;
//   - record_stream(ptr, s) says another stream s also uses the block; at free, an event is
//     recorded on each such stream and the block waits in a pending list until all its events
//     completed; mark_last_use(ptr, s) records that event early (See Note [Last use], below);
//   - before a segment goes back to the upstream, an event recorded on its stream is waited for;
//   - a freed block whose stream event cannot be recorded, or whose event cannot be waited on, is
//     withheld rather than reused (See Note [Withheld blocks], below);
//   - events complete roughly in the order they were recorded, so an allocation asks the pending
//     list only up to its first event not done; one about to grow the pool asks every event first;
//   - before reporting out of memory the pool waits for pending events, returns cached (entirely
//     free) segments to the upstream, and tries once more (num_alloc_retries counts this); a
//     request whose segment alone is above the budget fails at once and changes nothing;
//   - the budget is a Budget (budget.h) the pool may share with others: a segment's bytes are taken
//     from it before the upstream is asked and given back when the segment goes back.
//
// Note [Withheld blocks]
// ~~~~~~~~~~~~~~~~~~~~~~
// A freed block whose stream event cannot be recorded, or whose event cannot be waited on, is
// withheld (counted in withheld_bytes) rather than reused: the pool records and waits again at its
// next chance (a later event on the same stream covers all the work the missing one would have), so
// the block comes back once the device answers again; a pool destroyed while some of its blocks are
// withheld keeps their segments from the upstream for good and says so, rather than give back
// memory a stream may still write.
//
// Note [Last use]
// ~~~~~~~~~~~~~~~
// A block kept live long after its last use on another stream (the old home of a tensor staged for
// an optimizer step, kept for the step's redo until the step is validated) would, freed with
// record_stream, wait for an event recorded at the free: behind all the work queued on that stream
// since, which with the host running ahead of the GPU may not be done when the next allocation of
// its size comes, so the pool grows instead. mark_last_use(ptr, s) records the event at the last
// use: the caller promises that nothing queued on s afterwards touches the block, unless it says
// so with record_stream(ptr, s), which drops the mark. The free then waits for the marked event.
//
// Errors: size 0, sizes above kMaxAllocationSize (SIZE_MAX among them), sizes whose rounding
// overflows, and alignment 0, not a power of two or above kMaxAlignment are kInvalidArgument. Out
// of memory (budget or upstream) is kResourceExhausted naming the tier, the bytes asked, reserved,
// allocated, the budget and the largest free block. Freeing a pointer that is not live: a foreign
// pointer or an interior pointer is kInvalidArgument; a block already freed is kFailedPrecondition.
// A failed call changes nothing.
//
// Thread-safe: one mutex per pool (See Note [Pool mutex]); upstream calls and event waits run with
// it released.
//
// Example:
//   BlockPool pool({.tier = Tier::kGpu, .budget = 8 * kGiB}, std::move(upstream), stream_ops);
//   absl::StatusOr<void*> p = pool.allocate(4 * kMiB, {.stream = compute_stream, .owner = "act0"});
//   ...launch work on compute_stream...
//   STRATA_RETURN_IF_ERROR(pool.record_stream(*p, d2h_stream));   // a copy reads it too
//   STRATA_RETURN_IF_ERROR(pool.deallocate(*p));                   // reusable once the copy is
//   done
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/budget.h"
#include "allocator/stats.h"
#include "allocator/stream_ops.h"
#include "allocator/tier.h"
#include "allocator/upstream.h"

namespace strata::alloc {

inline constexpr std::size_t kBlockGranularity = 512;
inline constexpr std::size_t kMaxAlignment = kBlockGranularity;
inline constexpr std::size_t kDefaultAlignment = 256;
inline constexpr std::size_t kSmallSize = std::size_t{1} << 20;
inline constexpr std::size_t kSmallSegmentSize = std::size_t{2} << 20;
inline constexpr std::size_t kLargeSegmentGranularity = std::size_t{2} << 20;
// 1 PiB: larger than any memory a tier can have, small enough that rounding never overflows.
inline constexpr std::size_t kMaxAllocationSize = std::size_t{1} << 50;

struct AllocOptions {
  // Power of two, 1 .. kMaxAlignment. Every block is aligned to kBlockGranularity anyway.
  std::size_t alignment = kDefaultAlignment;
  // The stream that will use the block first; the block is reused only in this stream's order.
  StreamHandle stream = nullptr;
  // Who owns the block, for the leak report; kept only when tracking is on.
  std::string_view owner = {};
};

// One entry of the leak report.
struct LiveAllocation {
  Tier tier = Tier::kGpu;
  void* ptr = nullptr;
  std::size_t size = 0;       // after rounding
  std::size_t requested = 0;  // as asked
  StreamHandle stream = nullptr;
  std::string owner;           // "" when tracking was off
  std::uint64_t sequence = 0;  // allocation order within the pool
};

struct PoolConfig {
  Tier tier = Tier::kGpu;
  // Cap on reserved bytes (segments held from the upstream), in a Budget of the pool's own...
  std::size_t budget = kNoBudget;
  // Keep owner tags for the leak report.
  bool track_allocations = false;
  // ...or in a Budget it shares with other pools (then `budget` is ignored).
  std::shared_ptr<Budget> shared_budget;
  // Said after the budget in an out-of-memory message (where a default budget came from), while
  // the budget is still the one the pool was made with.
  std::string budget_note;
  // Large blocks come from one address range per stream that grows and shrinks by mapping memory,
  // where the upstream can (expansion_granularity() > 0; See Note [Expandable segments] in
  // block_pool_expand.cpp).
  bool expandable = false;
};

class BlockPool {
 public:
  // `stream_ops` may be null for a pool whose memory no stream touches; record_stream then fails.
  BlockPool(PoolConfig config, std::unique_ptr<Upstream> upstream,
            std::shared_ptr<StreamOps> stream_ops);
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  [[nodiscard]] absl::StatusOr<void*> allocate(std::size_t bytes, const AllocOptions& options = {});
  [[nodiscard]] absl::Status deallocate(void* ptr);
  // Marks a live block as used by `stream` as well (See Note [Stream ordering] above).
  [[nodiscard]] absl::Status record_stream(void* ptr, StreamHandle stream);
  // Says that the work queued on `stream` so far is the last to touch the live block there: its
  // free waits for an event recorded now (See Note [Last use] above). A later record_stream on
  // `stream` undoes this. Nothing to do for the block's own stream.
  [[nodiscard]] absl::Status mark_last_use(void* ptr, StreamHandle stream);
  // Waits for every pending event and makes those blocks reusable.
  [[nodiscard]] absl::Status synchronize_pending();
  // Merges adjacent free blocks now (the pool does this by itself before it grows or trims).
  void consolidate();
  // Returns every entirely free segment to the upstream. Returns the bytes released.
  [[nodiscard]] absl::StatusOr<std::size_t> trim();

  // The limit of the pool's Budget (shared or not); must be > 0.
  [[nodiscard]] absl::Status set_budget(std::size_t budget);
  std::size_t budget() const;
  const std::shared_ptr<Budget>& budget_account() const { return budget_; }
  TierStats stats() const;
  void reset_peak_stats();
  // Live blocks in allocation order (the leak report).
  std::vector<LiveAllocation> live_allocations() const;
  bool is_live(const void* ptr) const;
  // True when ptr lies inside one of this pool's segments.
  bool contains(const void* ptr) const;
  // Requested size of a live block, or std::nullopt.
  std::optional<std::size_t> requested_size(const void* ptr) const;

  Tier tier() const { return config_.tier; }
  // True when large blocks come from expandable segments (asked for and the upstream can).
  bool expandable() const { return expandable_; }
  const Upstream& upstream() const { return *upstream_; }
  // Checks the pool's invariants (linked lists, free sets, counters, and once consolidated no two
  // adjacent free blocks); an error names the first broken one. For tests: O(blocks).
  [[nodiscard]] absl::Status validate() const;

 private:
  struct Segment;
  struct Block {
    std::byte* ptr = nullptr;
    std::size_t size = 0;
    std::size_t requested = 0;
    StreamHandle stream = nullptr;
    Segment* segment = nullptr;
    Block* prev = nullptr;
    Block* next = nullptr;
    bool allocated = false;
    bool small = false;
    int pending_events = 0;
    bool withheld = false;  // See Note [Withheld blocks]
    // Address space of an expandable segment with no memory behind it, or free memory on its way
    // out of the pool (its unmapping runs without the lock; See Note [Expandable segments]).
    bool unmapped = false;
    bool releasing = false;
    std::uint64_t sequence = 0;
    // The other streams that use the block, each with the event mark_last_use recorded there
    // (nullptr: none; the free records one).
    struct StreamUse {
      StreamHandle stream = nullptr;
      EventHandle last_use = nullptr;
    };
    absl::InlinedVector<StreamUse, 1> extra_streams;
    std::string owner;
  };
  struct Segment {
    std::byte* base = nullptr;
    std::size_t size = 0;  // bytes held from the upstream (for an expandable segment: mapped)
    StreamHandle stream = nullptr;
    bool small = false;
    Block* first = nullptr;
    // The reserved range (its blocks cover all of it, unmapped ones included) and what is mapped
    // where: offset -> bytes of each map_range call (See Note [Expandable segments]).
    bool expandable = false;
    std::size_t range = 0;
    absl::btree_map<std::size_t, std::size_t> extents;
    std::size_t span() const { return expandable ? range : size; }
  };
  // Note [Inline free keys]
  // ~~~~~~~~~~~~~~~~~~~~~~~
  // The free sets hold each block's sort key by value, so a best-fit search compares keys inside
  // the btree's nodes instead of following a pointer to every block it passes; with 10^6 blocks
  // those pointer reads were most of an allocate+deallocate (bench/allocator_scaling_bench.cpp). A
  // block's stream, size and address do not change while it is in a set: it is taken out first.
  struct FreeKey {
    std::uintptr_t stream = 0;
    std::size_t size = 0;
    std::uintptr_t ptr = 0;
    Block* block = nullptr;
    // By stream, then size, then address: lower_bound of {stream, size} is the best fit at the
    // lowest address.
    friend bool operator<(const FreeKey& a, const FreeKey& b) {
      if (a.stream != b.stream) return a.stream < b.stream;
      if (a.size != b.size) return a.size < b.size;
      return a.ptr < b.ptr;
    }
  };
  static FreeKey free_key(const Block* b) {
    return {reinterpret_cast<std::uintptr_t>(b->stream), b->size,
            reinterpret_cast<std::uintptr_t>(b->ptr), const_cast<Block*>(b)};
  }
  using FreeSet = absl::btree_set<FreeKey>;
  struct PendingEvent {
    EventHandle event;
    Block* block;
  };
  // A stream of a freed block on which no event could be recorded yet (See Note [Withheld blocks]).
  struct Unrecorded {
    StreamHandle stream;
    Block* block;
  };

  // Nanoseconds from `start` to now, for the upstream call counters (upstream_alloc_ns and
  // upstream_free_ns) that grow_locked and release_cached_segments_locked keep.
  static std::int64_t elapsed_ns(std::chrono::steady_clock::time_point start);
  static std::size_t round_size(std::size_t bytes);
  // Free for reuse: neither handed out, nor behind events, nor without memory, nor leaving.
  static bool is_free(const Block* b) {
    return !b->allocated && b->pending_events == 0 && !b->unmapped && !b->releasing;
  }
  static std::size_t segment_size_for(std::size_t size, bool small);
  FreeSet& free_set(bool small) { return small ? small_free_ : large_free_; }

  Block* take_best_fit_locked(StreamHandle stream, bool small, std::size_t size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Block*> grow_locked(std::size_t size, bool small, StreamHandle stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void split_locked(Block* block, std::size_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Cuts `block` after `keep` bytes; the rest, in the same state and in no free set, is returned.
  Block* split_off_locked(Block* block, std::size_t keep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void free_block_locked(Block* block, bool merge) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Puts a block that is not handed out into its free set, merged with its free neighbours.
  void insert_free_locked(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Merges block->next, free and already out of its free set, into `block`.
  void absorb_next_locked(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void consolidate_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // record_stream (`last` false) and mark_last_use (`last` true); `what` names the call in errors.
  absl::Status add_stream_use(void* ptr, StreamHandle stream, bool last, std::string_view what);
  // Frees the blocks behind completed events: up to the first event not done, or with `all`,
  // asking every event (the pool is about to grow).
  void process_ready_events_locked(bool all = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void retry_unrecorded_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void withhold_locked(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A pending event of `block` completed: the block is free once none is left.
  void event_done_locked(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status wait_all_pending_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::size_t release_cached_segments_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // See Note [Expandable segments] in block_pool_expand.cpp.
  absl::StatusOr<Block*> grow_expandable_locked(std::size_t size, StreamHandle stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Segment*> new_expandable_segment_locked(std::size_t size, StreamHandle stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::size_t release_expandable_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Splits `block` so that [ptr, ptr + bytes) is a block of its own; returns it.
  Block* carve_locked(Block* block, std::byte* ptr, std::size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Merges adjacent unmapped blocks of an expandable segment, and deletes it when nothing in it
  // is mapped (giving back its range).
  void settle_segment_locked(Segment* segment) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives a segment's memory back to the upstream (whole, or every mapping and then the range).
  absl::Status return_segment(Segment* segment);
  absl::Status bad_free_locked(const void* ptr) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  const Segment* find_segment_locked(const void* ptr) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void compute_derived_locked(TierStats& s) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  std::string oom_message_locked(std::size_t size, std::size_t requested,
                                 const absl::Status& cause) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  Block* new_block_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void delete_block_locked(Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PoolConfig config_;
  const std::unique_ptr<Upstream> upstream_;
  const std::shared_ptr<StreamOps> stream_ops_;

  // Note [Pool mutex]
  // ~~~~~~~~~~~~~~~~~
  // std::mutex, not absl::Mutex: Debian's Abseil build runs deadlock detection (a cycle-graph
  // lookup and a thread-local read) on every Lock/Unlock, which was half of the instructions of a
  // pooled alloc+free pair (callgrind: ~1500 per pair before, see PERF notes).
  mutable std::mutex mu_;
  // Taken before each upstream call, so segments on their way count too.
  const std::shared_ptr<Budget> budget_;
  const std::size_t made_with_;  // the budget's limit when the pool was made (budget_note's)
  FreeSet small_free_ ABSL_GUARDED_BY(mu_);
  FreeSet large_free_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<const void*, Block*> live_ ABSL_GUARDED_BY(mu_);
  absl::btree_map<std::uintptr_t, Segment*> segments_ ABSL_GUARDED_BY(mu_);
  std::deque<PendingEvent> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<Unrecorded> unrecorded_ ABSL_GUARDED_BY(mu_);
  std::size_t unmerged_frees_ ABSL_GUARDED_BY(mu_) = 0;
  TierStats stats_ ABSL_GUARDED_BY(mu_);
  std::uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<std::unique_ptr<Block>> block_storage_ ABSL_GUARDED_BY(mu_);
  std::vector<Block*> spare_blocks_ ABSL_GUARDED_BY(mu_);
  // Whether large blocks use expandable segments, the unit mapped, and each stream's expandable
  // segments in the order they were made (See Note [Expandable segments]).
  const bool expandable_;
  const std::size_t chunk_;
  absl::flat_hash_map<StreamHandle, std::vector<Segment*>> expandable_segments_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace strata::alloc
