// allocator/block_pool_expand.cpp: the BlockPool member functions of expandable segments, kept
// apart from the fixed-segment paths of block_pool.cpp and block_pool_release.cpp.
//
// Note [Expandable segments]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// With fixed segments a pool that frees a 1 GiB activation and then asks for 1.5 GiB cannot use the
// free gigabyte; it takes a new segment, and under shapes that change from step to step (variable
// sequence lengths) it ends up holding 2.16 x what it ever had live (bench/replay_trace.h's
// variable trace; 1.005 x with expandable segments). An expandable segment is one address range per
// stream, reserved once (as large as the device's memory or the budget, whichever is less) with
// memory mapped into it only where blocks need it:
//   - its blocks cover the whole range; those with no memory behind them are `unmapped` and sit in
//     no free set. Memory is mapped in extents (one map_range call each, at most kMaxExtent and a
//     multiple of the upstream's granularity), recorded in Segment::extents;
//   - growing: when no free block fits, the pool looks in the stream's ranges for the run of free
//     and unmapped blocks that fits the request with the fewest new bytes mapped (a free block at
//     the end of the mapped memory plus the unmapped space after it, whatever the request's size),
//     maps what is missing and merges the run into one block. Only when no range has room does it
//     reserve another;
//   - shrinking (trim, the out-of-memory fallback, a phase switch): every extent lying wholly
//     inside a free block is unmapped, after an event on the segment's stream completed
//     (See Note [Stream ordering]); the block becomes unmapped address space. A range with nothing
//     mapped is given back;
//   - reserved_bytes, the budget and stats count mapped bytes; segments counts ranges; num_maps,
//     num_unmaps, upstream_alloc_ns and upstream_free_ns say what mapping cost.
// Small blocks keep their fixed 2 MiB segments: every small segment fits every small request, so
// they do not fragment across sizes the way large ones do.
//
// Mapping runs with the pool's lock held (one call per extent, tens of microseconds on a GPU), so
// two threads never grow one range at once; unmapping runs without it, the blocks on their way out
// marked `releasing` so nobody takes or merges them meanwhile.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "allocator/block_pool.h"
#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"

namespace strata::alloc {
namespace {

// Bigger extents cost fewer driver calls; smaller ones come back sooner, because an extent is
// unmapped only once all of it is free.
constexpr std::size_t kMaxExtent = std::size_t{64} << 20;

std::size_t round_up(std::size_t bytes, std::size_t unit) {
  return (bytes + unit - 1) / unit * unit;
}

}  // namespace

BlockPool::Block* BlockPool::carve_locked(Block* block, std::byte* ptr, std::size_t bytes) {
  if (ptr > block->ptr) {
    block = split_off_locked(block, static_cast<std::size_t>(ptr - block->ptr));
  }
  if (bytes < block->size) split_off_locked(block, bytes);
  return block;
}

absl::StatusOr<BlockPool::Segment*> BlockPool::new_expandable_segment_locked(std::size_t size,
                                                                             StreamHandle stream) {
  const std::size_t least = round_up(size, chunk_);
  std::size_t most = std::min(budget_->limit(), upstream_->max_range_bytes());
  most = most >= kMaxAllocationSize ? kMaxAllocationSize : round_up(most, chunk_);
  most = std::max(most, least);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<Upstream::Range> range = upstream_->reserve_range(most, least);
  stats_.upstream_alloc_ns += elapsed_ns(start);
  if (!range.ok()) {
    return absl::Status(range.status().code(),
                        str_cat(upstream_->name(), ": ", range.status().message()));
  }
  auto* segment = new Segment;
  segment->base = static_cast<std::byte*>(range->base);
  segment->stream = stream;
  segment->expandable = true;
  segment->range = range->bytes;
  Block* block = new_block_locked();
  block->ptr = segment->base;
  block->size = segment->range;
  block->stream = stream;
  block->segment = segment;
  block->unmapped = true;
  segment->first = block;
  segments_.emplace(reinterpret_cast<std::uintptr_t>(segment->base), segment);
  expandable_segments_[stream].push_back(segment);
  stats_.segments.add(1);
  ++stats_.num_segment_allocs;
  return segment;
}

absl::StatusOr<BlockPool::Block*> BlockPool::grow_expandable_locked(std::size_t size,
                                                                    StreamHandle stream) {
  // The run of free and unmapped blocks, starting at `start`, that holds `size` with the fewest
  // bytes to map; what to map is the unmapped part of [start, start + size) rounded up to chunks.
  Block* best = nullptr;
  std::size_t best_to_map = 0;
  auto consider = [&](Block* start) {
    std::size_t covered = 0, to_map = 0;
    const std::byte* end = start->ptr + size;
    for (const Block* b = start; b != nullptr && covered < size; b = b->next) {
      if (!is_free(b) && !b->unmapped) return;
      if (b->unmapped) {
        to_map += std::min(b->size, round_up(static_cast<std::size_t>(end - b->ptr), chunk_));
      }
      covered += b->size;
    }
    if (covered < size) return;
    if (best == nullptr || to_map < best_to_map) best = start, best_to_map = to_map;
  };
  auto mine = expandable_segments_.find(stream);
  const std::vector<Segment*> none;
  for (Segment* segment : mine == expandable_segments_.end() ? none : mine->second) {
    bool in_run = false;
    for (Block* b = segment->first; b != nullptr; b = b->next) {
      const bool usable = is_free(b) || b->unmapped;
      if (usable && !in_run) consider(b);
      in_run = usable;
    }
  }
  if (best == nullptr) {
    absl::StatusOr<Segment*> segment = new_expandable_segment_locked(size, stream);
    if (!segment.ok()) return segment.status();
    best = (*segment)->first;
    best_to_map = round_up(size, chunk_);
  }
  Segment* segment = best->segment;

  // Map first, change the blocks after: a failed mapping leaves the pool as it was.
  struct Piece {
    Block* hole;
    std::size_t bytes;  // mapped at the hole's start
  };
  std::vector<Piece> pieces;
  {
    std::size_t covered = 0;
    const std::byte* end = best->ptr + size;
    for (Block* b = best; covered < size; b = b->next) {
      if (b->unmapped) {
        pieces.push_back(
            {b, std::min(b->size, round_up(static_cast<std::size_t>(end - b->ptr), chunk_))});
      }
      covered += b->size;
    }
  }
  if (!budget_->try_reserve(best_to_map)) {
    if (segment->size == 0) settle_segment_locked(segment);  // gives a new range back
    return absl::ResourceExhaustedError(
        str_cat("mapping ", format_bytes(best_to_map), " more would pass the budget"));
  }
  std::vector<std::pair<std::byte*, std::size_t>> mapped;
  absl::Status failed;
  const auto start = std::chrono::steady_clock::now();
  for (const Piece& piece : pieces) {
    for (std::size_t done = 0; done < piece.bytes && failed.ok();) {
      const std::size_t bytes = std::min(kMaxExtent, piece.bytes - done);
      std::byte* at = piece.hole->ptr + done;
      failed = upstream_->map_range(at, bytes);
      if (failed.ok()) mapped.emplace_back(at, bytes);
      done += bytes;
    }
  }
  if (!failed.ok()) {
    for (auto it = mapped.rbegin(); it != mapped.rend(); ++it) {
      const absl::Status s = upstream_->unmap_range(it->first, it->second);
      if (!s.ok()) std::fprintf(stderr, "strata: %s\n", std::string(s.message()).c_str());
    }
    stats_.upstream_alloc_ns += elapsed_ns(start);
    budget_->release(best_to_map);
    if (segment->size == 0) settle_segment_locked(segment);
    return absl::Status(failed.code(), str_cat(upstream_->name(), ": ", failed.message()));
  }
  stats_.upstream_alloc_ns += elapsed_ns(start);
  stats_.num_maps += static_cast<std::int64_t>(mapped.size());
  for (const auto& [at, bytes] : mapped) {
    segment->extents.emplace(static_cast<std::size_t>(at - segment->base), bytes);
  }
  segment->size += best_to_map;
  stats_.reserved_bytes.add(static_cast<std::int64_t>(best_to_map));

  // The run's free blocks leave their free set; each hole's mapped start becomes a block of free
  // memory; then the run merges into one block from `best` on.
  {
    std::size_t covered = 0;
    for (Block* b = best; covered < size; b = b->next) {
      if (is_free(b)) free_set(false).erase(free_key(b));
      covered += b->size;
    }
  }
  for (const Piece& piece : pieces)
    carve_locked(piece.hole, piece.hole->ptr, piece.bytes)->unmapped = false;
  while (best->size < size) absorb_next_locked(best);
  return best;
}

void BlockPool::settle_segment_locked(Segment* segment) {
  for (Block* b = segment->first; b != nullptr; b = b->next) {
    while (b->unmapped && b->next != nullptr && b->next->unmapped) absorb_next_locked(b);
  }
  if (segment->size != 0) return;
  // Nothing mapped is left: the range goes back.
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = upstream_->release_range(segment->base, segment->range);
  stats_.upstream_free_ns += elapsed_ns(start);
  if (!s.ok()) {
    std::fprintf(stderr, "strata: keeping an empty range of tier %s: %s\n",
                 std::string(tier_name(config_.tier)).c_str(), std::string(s.message()).c_str());
    return;
  }
  segments_.erase(reinterpret_cast<std::uintptr_t>(segment->base));
  std::vector<Segment*>& list = expandable_segments_[segment->stream];
  list.erase(std::find(list.begin(), list.end(), segment));
  if (list.empty()) expandable_segments_.erase(segment->stream);
  stats_.segments.add(-1);
  ++stats_.num_segment_frees;
  delete_block_locked(segment->first);
  delete segment;
}

std::size_t BlockPool::release_expandable_locked() {
  // Every extent wholly inside a free block; its block leaves the free set, marked releasing.
  struct Victim {
    Block* block;
    std::vector<std::pair<std::size_t, std::size_t>> extents;  // offset, bytes (ascending)
  };
  std::vector<Victim> victims;
  for (const auto& [stream, list] : expandable_segments_) {
    for (Segment* segment : list) {
      for (Block* b = segment->first; b != nullptr; b = b->next) {
        if (!is_free(b)) continue;
        const auto from = static_cast<std::size_t>(b->ptr - segment->base);
        const std::size_t to = from + b->size;
        Victim victim{b, {}};
        for (auto it = segment->extents.lower_bound(from);
             it != segment->extents.end() && it->first + it->second <= to; ++it) {
          victim.extents.emplace_back(it->first, it->second);
        }
        if (!victim.extents.empty()) victims.push_back(std::move(victim));
      }
    }
  }
  if (victims.empty()) return 0;
  std::vector<StreamHandle> streams;
  for (Victim& v : victims) {
    free_set(false).erase(free_key(v.block));
    v.block->releasing = true;
    if (std::find(streams.begin(), streams.end(), v.block->stream) == streams.end()) {
      streams.push_back(v.block->stream);
    }
  }

  mu_.unlock();
  // Work queued on a segment's stream before its blocks were freed may still touch them
  // (See Note [Stream ordering] in block_pool.h). Fail closed: a stream that cannot be waited on
  // keeps its memory mapped.
  std::vector<StreamHandle> unsafe;
  if (stream_ops_ != nullptr) {
    for (StreamHandle stream : streams) {
      absl::StatusOr<EventHandle> event = stream_ops_->record(stream);
      absl::Status s = event.status();
      if (event.ok()) {
        s = stream_ops_->synchronize(*event);
        stream_ops_->release(*event);
      }
      if (!s.ok()) {
        std::fprintf(stderr, "strata: keeping free memory of tier %s mapped: %s\n",
                     std::string(tier_name(config_.tier)).c_str(),
                     std::string(s.message()).c_str());
        unsafe.push_back(stream);
      }
    }
  }
  // The extents that did go.
  std::vector<std::vector<bool>> gone(victims.size());
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < victims.size(); ++i) {
    const Victim& v = victims[i];
    gone[i].assign(v.extents.size(), false);
    if (std::find(unsafe.begin(), unsafe.end(), v.block->stream) != unsafe.end()) continue;
    for (std::size_t e = 0; e < v.extents.size(); ++e) {
      const absl::Status s =
          upstream_->unmap_range(v.block->segment->base + v.extents[e].first, v.extents[e].second);
      if (!s.ok()) {
        std::fprintf(stderr, "strata: keeping memory of tier %s mapped: %s\n",
                     std::string(tier_name(config_.tier)).c_str(),
                     std::string(s.message()).c_str());
      }
      gone[i][e] = s.ok();
    }
  }
  const std::int64_t took = elapsed_ns(start);
  mu_.lock();
  stats_.upstream_free_ns += took;

  std::size_t released = 0;
  std::vector<Segment*> touched;
  for (std::size_t i = 0; i < victims.size(); ++i) {
    Victim& v = victims[i];
    Segment* segment = v.block->segment;
    std::byte* const end = v.block->ptr + v.block->size;
    v.block->releasing = false;
    // Cut each extent that went out of the block as an unmapped one; what stays is free memory.
    std::vector<Block*> free_pieces;
    Block* rest = v.block;
    for (std::size_t e = 0; e < v.extents.size(); ++e) {
      if (!gone[i][e]) continue;
      std::byte* at = segment->base + v.extents[e].first;
      const std::size_t bytes = v.extents[e].second;
      if (at > rest->ptr) free_pieces.push_back(rest);
      Block* hole = carve_locked(rest, at, bytes);
      hole->unmapped = true;
      segment->extents.erase(v.extents[e].first);
      segment->size -= bytes;
      stats_.reserved_bytes.add(-static_cast<std::int64_t>(bytes));
      ++stats_.num_unmaps;
      budget_->release(bytes);
      released += bytes;
      rest = hole->ptr + hole->size < end ? hole->next : nullptr;
    }
    if (rest != nullptr) free_pieces.push_back(rest);
    for (Block* piece : free_pieces) insert_free_locked(piece);
    if (std::find(touched.begin(), touched.end(), segment) == touched.end()) {
      touched.push_back(segment);
    }
  }
  // Holes merge once every victim is settled (merging deletes blocks other victims point to).
  for (Segment* segment : touched) settle_segment_locked(segment);
  return released;
}

absl::Status BlockPool::return_segment(Segment* segment) {
  if (!segment->expandable) return upstream_->deallocate(segment->base, segment->size);
  for (const auto& [offset, bytes] : segment->extents) {
    STRATA_RETURN_IF_ERROR(upstream_->unmap_range(segment->base + offset, bytes));
  }
  return upstream_->release_range(segment->base, segment->range);
}

}  // namespace strata::alloc
