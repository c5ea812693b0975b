#include "allocator/block_pool.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <type_traits>
#include <utility>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"

namespace strata::alloc {
std::int64_t BlockPool::elapsed_ns(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              start)
      .count();
}

BlockPool::BlockPool(PoolConfig config, std::unique_ptr<Upstream> upstream,
                     std::shared_ptr<StreamOps> stream_ops)
    : config_(config),
      upstream_(std::move(upstream)),
      stream_ops_(std::move(stream_ops)),
      budget_(config.shared_budget != nullptr ? config.shared_budget
                                              : std::make_shared<Budget>(config.budget)),
      made_with_(budget_->limit()),
      expandable_(config.expandable && upstream_ != nullptr &&
                  upstream_->expansion_granularity() > 0),
      chunk_(upstream_ == nullptr
                 ? kLargeSegmentGranularity
                 : std::max(kLargeSegmentGranularity, upstream_->expansion_granularity())) {
  STRATA_CHECK(upstream_ != nullptr, "BlockPool for tier ", tier_name(config.tier),
               " needs an upstream");
  STRATA_CHECK(is_power_of_two(chunk_), upstream_->name(),
               ": the expansion granularity must be a power of two");
}

BlockPool::~BlockPool() {
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Status waited = wait_all_pending_locked();
  if (!live_.empty()) {
    std::fprintf(stderr,
                 "strata: pool %s destroyed with %zu live block(s) (%lld bytes); their memory is "
                 "released now\n",
                 std::string(tier_name(config_.tier)).c_str(), live_.size(),
                 static_cast<long long>(stats_.allocated_bytes.current));
  }
  for (const PendingEvent& p : pending_) stream_ops_->release(p.event);
  for (const auto& [ptr, block] : live_) {
    for (const Block::StreamUse& use : block->extra_streams) {
      if (use.last_use != nullptr) stream_ops_->release(use.last_use);
    }
  }
  for (auto& [base, segment] : segments_) {
    // A segment with a block some stream may still use stays out of the upstream's hands for good
    // (See Note [Withheld blocks] in block_pool.h).
    bool in_use = false;
    for (const Block* b = segment->first; b != nullptr; b = b->next) {
      in_use = in_use || b->pending_events > 0 || b->releasing;
    }
    if (in_use) {
      std::fprintf(stderr,
                   "strata: pool %s destroyed while a stream may still use %s of segment %p (%s); "
                   "that memory is not given back\n",
                   std::string(tier_name(config_.tier)).c_str(),
                   format_bytes(segment->size).c_str(), static_cast<void*>(segment->base),
                   std::string(waited.message()).c_str());
    } else {
      absl::Status s = return_segment(segment);
      if (!s.ok()) std::fprintf(stderr, "strata: %s\n", std::string(s.message()).c_str());
      if (s.ok()) budget_->release(segment->size);
    }
    delete segment;
  }
  segments_.clear();
}

std::size_t BlockPool::round_size(std::size_t bytes) {
  return (bytes + kBlockGranularity - 1) & ~(kBlockGranularity - 1);
}

std::size_t BlockPool::segment_size_for(std::size_t size, bool small) {
  return small ? kSmallSegmentSize
               : (size + kLargeSegmentGranularity - 1) & ~(kLargeSegmentGranularity - 1);
}

BlockPool::Block* BlockPool::new_block_locked() {
  if (spare_blocks_.empty()) {
    block_storage_.push_back(std::make_unique<Block>());
    return block_storage_.back().get();
  }
  Block* b = spare_blocks_.back();
  spare_blocks_.pop_back();
  return b;
}

void BlockPool::delete_block_locked(Block* block) {
  block->ptr = nullptr;
  block->size = block->requested = 0;
  block->segment = nullptr;
  block->prev = block->next = nullptr;
  block->allocated = block->small = false;
  block->pending_events = 0;
  block->withheld = false;
  block->unmapped = block->releasing = false;
  block->extra_streams.clear();
  block->owner.clear();
  spare_blocks_.push_back(block);
}

absl::StatusOr<void*> BlockPool::allocate(std::size_t bytes, const AllocOptions& options) {
  if (bytes == 0) {
    const std::string_view tier = tier_name(config_.tier);
    return absl::InvalidArgumentError(
        str_cat("allocate in tier ", tier,
                ": size 0; strata hands out no empty blocks (a zero-size tensor "
                "needs no storage)"));
  }
  if (bytes > kMaxAllocationSize) {
    const std::string_view tier = tier_name(config_.tier);
    return absl::InvalidArgumentError(str_cat("allocate in tier ", tier, ": size ", bytes,
                                              " bytes is above the largest allocation (",
                                              kMaxAllocationSize, " bytes, 1 PiB)"));
  }
  if (options.alignment == 0 || !is_power_of_two(options.alignment) ||
      options.alignment > kMaxAlignment) {
    const std::string_view tier = tier_name(config_.tier);
    return absl::InvalidArgumentError(
        str_cat("allocate in tier ", tier, ": alignment ", options.alignment,
                " is not a power of two between 1 and ", kMaxAlignment));
  }
  const std::size_t size = round_size(bytes);
  const bool small = size <= kSmallSize;

  std::lock_guard<std::mutex> lock(mu_);
  if (!pending_.empty()) process_ready_events_locked();
  Block* block = take_best_fit_locked(options.stream, small, size);
  if (block == nullptr && unmerged_frees_ > 0) {
    // Merge what deallocate left unmerged before growing (See Note [Lazy coalescing] in
    // block_pool.h).
    consolidate_locked();
    block = take_best_fit_locked(options.stream, small, size);
  }
  if (block == nullptr && !pending_.empty()) {
    // Before growing, every block whose events are done, not only those up to the first that is
    // not (See Note [Stream ordering] in block_pool.h).
    process_ready_events_locked(/*all=*/true);
    block = take_best_fit_locked(options.stream, small, size);
  }
  absl::Status cause;
  if (block == nullptr) {
    absl::StatusOr<Block*> grown = grow_locked(size, small, options.stream);
    if (grown.ok()) {
      block = *grown;
    } else {
      cause = grown.status();
    }
  }
  absl::Status waited;
  if (block == nullptr && segment_size_for(size, small) <= budget_->limit()) {
    // The named chain of fallbacks: wait for blocks behind stream events, return cached segments to
    // the upstream, then try once more.
    ++stats_.num_alloc_retries;
    waited = wait_all_pending_locked();
    block = take_best_fit_locked(options.stream, small, size);
    if (block == nullptr) {
      release_cached_segments_locked();
      absl::StatusOr<Block*> grown = grow_locked(size, small, options.stream);
      if (grown.ok()) {
        block = *grown;
      } else {
        cause = grown.status();
      }
    }
  }
  if (block == nullptr) {
    ++stats_.num_ooms;
    std::string message = oom_message_locked(size, bytes, cause);
    // Blocks still waiting behind their events are part of what could not be had: say why.
    if (!waited.ok()) {
      str_append(&message,
                 "; blocks behind copy events could not be waited for: ", waited.message());
    }
    return absl::ResourceExhaustedError(message);
  }

  split_locked(block, size);
  block->allocated = true;
  block->requested = bytes;
  block->sequence = next_sequence_++;
  if (config_.track_allocations) block->owner.assign(options.owner.data(), options.owner.size());
  live_.emplace(block->ptr, block);
  upstream_->on_block_live(block->segment->base, block->ptr, bytes);
  stats_.allocated_bytes.add(static_cast<std::int64_t>(block->size));
  stats_.requested_bytes.add(static_cast<std::int64_t>(bytes));
  stats_.active_blocks.add(1);
  ++stats_.num_allocs;
  return static_cast<void*>(block->ptr);
}

BlockPool::Block* BlockPool::take_best_fit_locked(StreamHandle stream, bool small,
                                                  std::size_t size) {
  FreeSet& set = free_set(small);
  auto it = set.lower_bound(FreeKey{reinterpret_cast<std::uintptr_t>(stream), size, 0, nullptr});
  if (it == set.end() || it->stream != reinterpret_cast<std::uintptr_t>(stream)) return nullptr;
  Block* block = it->block;
  set.erase(it);
  return block;
}

absl::StatusOr<BlockPool::Block*> BlockPool::grow_locked(std::size_t size, bool small,
                                                         StreamHandle stream) {
  if (expandable_ && !small) return grow_expandable_locked(size, stream);
  const std::size_t segment_size = segment_size_for(size, small);
  if (!budget_->try_reserve(segment_size)) {
    return absl::ResourceExhaustedError(
        str_cat("a new segment of ", format_bytes(segment_size), " would pass the budget"));
  }
  // Note: no lock is held across the upstream call (cudaMalloc can take milliseconds); the
  // segment's bytes are in the budget meanwhile.
  mu_.unlock();
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<void*> memory = upstream_->allocate(segment_size);
  const std::int64_t took = elapsed_ns(start);
  mu_.lock();
  stats_.upstream_alloc_ns += took;
  if (!memory.ok()) {
    budget_->release(segment_size);
    return absl::Status(memory.status().code(),
                        str_cat(upstream_->name(), ": ", memory.status().message()));
  }
  STRATA_CHECK(reinterpret_cast<std::uintptr_t>(*memory) % kSegmentAlignment == 0,
               upstream_->name(), " returned a segment not aligned to ", kSegmentAlignment);

  auto* segment = new Segment;
  segment->base = static_cast<std::byte*>(*memory);
  segment->size = segment_size;
  segment->stream = stream;
  segment->small = small;
  Block* block = new_block_locked();
  block->ptr = segment->base;
  block->size = segment_size;
  block->stream = stream;
  block->segment = segment;
  block->small = small;
  segment->first = block;
  segments_.emplace(reinterpret_cast<std::uintptr_t>(segment->base), segment);
  stats_.reserved_bytes.add(static_cast<std::int64_t>(segment_size));
  stats_.segments.add(1);
  ++stats_.num_segment_allocs;
  return block;
}

void BlockPool::split_locked(Block* block, std::size_t size) {
  if (block->size - size < kBlockGranularity) return;
  Block* rest = split_off_locked(block, size);
  free_set(rest->small).insert(free_key(rest));
}

BlockPool::Block* BlockPool::split_off_locked(Block* block, std::size_t keep) {
  Block* rest = new_block_locked();
  rest->ptr = block->ptr + keep;
  rest->size = block->size - keep;
  rest->stream = block->stream;
  rest->segment = block->segment;
  rest->small = block->small;
  rest->unmapped = block->unmapped;
  rest->releasing = block->releasing;
  rest->prev = block;
  rest->next = block->next;
  if (rest->next != nullptr) rest->next->prev = rest;
  block->next = rest;
  block->size = keep;
  return rest;
}

void BlockPool::free_block_locked(Block* block, bool merge) {
  upstream_->on_block_dead(block->segment->base, block->ptr);
  block->allocated = false;
  block->requested = 0;
  block->extra_streams.clear();
  block->owner.clear();
  if (!merge) {
    ++unmerged_frees_;
    free_set(block->small).insert(free_key(block));
    return;
  }
  insert_free_locked(block);
}

void BlockPool::insert_free_locked(Block* block) {
  FreeSet& set = free_set(block->small);
  // Merge with free neighbours; blocks waiting on events are neither allocated nor in the free set
  // and stay apart until their events complete, as do unmapped ones.
  Block* prev = block->prev;
  if (prev != nullptr && is_free(prev)) {
    set.erase(free_key(prev));
    absorb_next_locked(prev);
    block = prev;
  }
  Block* next = block->next;
  if (next != nullptr && is_free(next)) {
    set.erase(free_key(next));
    absorb_next_locked(block);
  }
  set.insert(free_key(block));
}

void BlockPool::absorb_next_locked(Block* block) {
  Block* next = block->next;
  block->size += next->size;
  block->next = next->next;
  if (block->next != nullptr) block->next->prev = block;
  delete_block_locked(next);
}

absl::Status BlockPool::deallocate(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) return bad_free_locked(ptr);
  Block* block = it->second;
  live_.erase(it);
  stats_.allocated_bytes.add(-static_cast<std::int64_t>(block->size));
  stats_.requested_bytes.add(-static_cast<std::int64_t>(block->requested));
  stats_.active_blocks.add(-1);
  ++stats_.num_frees;

  if (block->extra_streams.empty()) {
    free_block_locked(block, /*merge=*/!block->small);
    return absl::OkStatus();
  }
  // Other streams may still read or write this block. Hold it back until an event recorded on each
  // of them now has completed (See Note [Stream ordering] in block_pool.h).
  block->allocated = false;
  stats_.pending_free_bytes.add(static_cast<std::int64_t>(block->size));
  for (const Block::StreamUse& use : block->extra_streams) {
    const StreamHandle stream = use.stream;
    ++block->pending_events;
    if (use.last_use != nullptr) {  // See Note [Last use] in block_pool.h
      pending_.push_back({use.last_use, block});
      continue;
    }
    absl::StatusOr<EventHandle> event = stream_ops_->record(stream);
    if (event.ok()) {
      pending_.push_back({*event, block});
      continue;
    }
    // No event says when the stream is done with the block, so it is not reused until a later one
    // can be recorded (See Note [Withheld blocks] in block_pool.h). The free itself succeeded: the
    // caller must not free again, so this is no error to it.
    if (!block->withheld) {
      std::fprintf(stderr,
                   "strata: deallocate in tier %s: could not record an event for %p (%s); the "
                   "block is withheld from reuse until one can be recorded\n",
                   std::string(tier_name(config_.tier)).c_str(), ptr,
                   std::string(event.status().message()).c_str());
    }
    withhold_locked(block);
    unrecorded_.push_back({stream, block});
  }
  return absl::OkStatus();
}

absl::Status BlockPool::set_budget(std::size_t budget) {
  if (budget == 0) {
    return absl::InvalidArgumentError(
        str_cat("budget of tier ", tier_name(config_.tier), " must be > 0"));
  }
  budget_->set_limit(budget);
  return absl::OkStatus();
}

std::size_t BlockPool::budget() const { return budget_->limit(); }

const BlockPool::Segment* BlockPool::find_segment_locked(const void* ptr) const {
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = segments_.upper_bound(p);
  if (it == segments_.begin()) return nullptr;
  --it;
  const Segment* segment = it->second;
  if (p >= it->first + segment->span()) return nullptr;
  return segment;
}

absl::Status BlockPool::bad_free_locked(const void* ptr) const {
  const std::string_view tier = tier_name(config_.tier);
  const Segment* segment = find_segment_locked(ptr);
  if (segment == nullptr) {
    return absl::InvalidArgumentError(
        str_cat("deallocate in tier ", tier, ": ", ptr, " was not allocated by this tier"));
  }
  for (const Block* b = segment->first; b != nullptr; b = b->next) {
    if (ptr < b->ptr || ptr >= b->ptr + b->size) continue;
    if (ptr == b->ptr || !b->allocated) {
      return absl::FailedPreconditionError(
          str_cat("deallocate in tier ", tier, ": ", ptr, " is not live (double free?)"));
    }
    return absl::InvalidArgumentError(
        str_cat("deallocate in tier ", tier, ": ", ptr, " is an interior pointer, ",
                static_cast<const std::byte*>(ptr) - b->ptr, " bytes into the live block at ",
                static_cast<const void*>(b->ptr)));
  }
  return absl::FailedPreconditionError(
      str_cat("deallocate in tier ", tier, ": ", ptr, " is not live (double free?)"));
}

void BlockPool::compute_derived_locked(TierStats& s) const {
  // Adjacent free blocks may not be merged yet, so free space is measured in runs of free blocks,
  // which is what a merge would make of them (See Note [Lazy coalescing] in block_pool.h).
  std::int64_t total_free = 0, largest = 0, inactive_split = 0;
  for (const auto& entry : segments_) {
    const Segment* segment = entry.second;
    std::int64_t run = 0, segment_free = 0;
    bool holds_live = false;  // a block handed out or behind events
    auto close_run = [&] {
      if (run == 0) return;
      segment_free += run;
      largest = std::max(largest, run);
      run = 0;
    };
    for (const Block* b = segment->first; b != nullptr; b = b->next) {
      if (is_free(b)) {
        run += static_cast<std::int64_t>(b->size);
      } else {
        holds_live = holds_live || b->allocated || b->pending_events > 0;
        close_run();
      }
    }
    close_run();
    total_free += segment_free;
    if (holds_live) inactive_split += segment_free;
  }
  s.free_bytes = total_free;
  s.largest_free_block = largest;
  s.inactive_split_bytes = inactive_split;
  s.fragmentation =
      total_free == 0 ? 0.0 : 1.0 - static_cast<double>(largest) / static_cast<double>(total_free);
}

TierStats BlockPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  TierStats s = stats_;
  compute_derived_locked(s);
  return s;
}

void BlockPool::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  auto reset_peak = [](auto& stat) {
    if constexpr (std::is_same_v<std::decay_t<decltype(stat)>, Gauge>) stat.reset_peak();
  };
#define STRATA_RESET_PEAK_(name, kind, help) reset_peak(stats_.name);
  STRATA_TIER_STATS(STRATA_RESET_PEAK_)
#undef STRATA_RESET_PEAK_
}

std::string BlockPool::oom_message_locked(std::size_t size, std::size_t requested,
                                          const absl::Status& cause) const {
  TierStats s = stats_;
  compute_derived_locked(s);
  const std::size_t limit = budget_->limit();
  const std::size_t own = static_cast<std::size_t>(s.reserved_bytes.current);
  const std::size_t all = budget_->reserved();
  const std::size_t elsewhere = all > own ? all - own : 0;
  return str_cat("out of memory in tier ", tier_name(config_.tier), ": tried to allocate ",
                 format_bytes(size), " (", requested, " bytes asked); reserved ",
                 format_bytes(static_cast<std::size_t>(s.reserved_bytes.current)), ", allocated ",
                 format_bytes(static_cast<std::size_t>(s.allocated_bytes.current)), ", budget ",
                 limit == kNoBudget ? std::string("unlimited") : format_bytes(limit),
                 limit == made_with_ ? config_.budget_note : std::string(),
                 elsewhere > 0 ? str_cat(" (", format_bytes(elsewhere),
                                         " of it reserved by the pools it is shared with)")
                               : std::string(),
                 ", largest free block ",
                 format_bytes(static_cast<std::size_t>(s.largest_free_block)),
                 cause.ok() ? std::string() : str_cat("; ", cause.message()));
}

std::vector<LiveAllocation> BlockPool::live_allocations() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<LiveAllocation> out;
  out.reserve(live_.size());
  for (const auto& [ptr, b] : live_) {
    out.push_back({config_.tier, b->ptr, b->size, b->requested, b->stream, b->owner, b->sequence});
  }
  std::sort(out.begin(), out.end(), [](const LiveAllocation& a, const LiveAllocation& b) {
    return a.sequence < b.sequence;
  });
  return out;
}

bool BlockPool::is_live(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.contains(ptr);
}

bool BlockPool::contains(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  return find_segment_locked(ptr) != nullptr;
}

std::optional<std::size_t> BlockPool::requested_size(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) return std::nullopt;
  return it->second->requested;
}

absl::Status BlockPool::validate() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::int64_t reserved = 0, allocated = 0, requested = 0, active = 0, pending = 0, withheld = 0;
  std::size_t free_blocks = 0;
  for (const auto& [base, segment] : segments_) {
    reserved += static_cast<std::int64_t>(segment->size);
    std::byte* expect = segment->base;
    const Block* prev = nullptr;
    std::size_t mapped = 0;
    for (const Block* b = segment->first; b != nullptr; b = b->next) {
      if (b->unmapped) {
        if (!segment->expandable) return absl::InternalError("unmapped block in a fixed segment");
        if (b->allocated || b->pending_events > 0 || b->releasing) {
          return absl::InternalError("an unmapped block is in use");
        }
        if (prev != nullptr && prev->unmapped) {
          return absl::InternalError("two adjacent unmapped blocks were not merged");
        }
      } else {
        mapped += b->size;
      }
      if (b->ptr != expect) return absl::InternalError("blocks of a segment are not contiguous");
      if (b->prev != prev) return absl::InternalError("broken prev link");
      if (b->segment != segment) return absl::InternalError("block points at the wrong segment");
      if (b->size == 0 || b->size % kBlockGranularity != 0) {
        return absl::InternalError("block size not a multiple of the granularity");
      }
      if (is_free(b)) {
        ++free_blocks;
        if ((b->small ? small_free_ : large_free_).count(free_key(b)) == 0) {
          return absl::InternalError("free block missing from its free set");
        }
        if (unmerged_frees_ == 0 && prev != nullptr && is_free(prev)) {
          return absl::InternalError("two adjacent free blocks were not merged");
        }
      }
      if (b->allocated) {
        allocated += static_cast<std::int64_t>(b->size);
        requested += static_cast<std::int64_t>(b->requested);
        ++active;
        if (!live_.contains(b->ptr)) return absl::InternalError("allocated block not in live map");
      }
      if (b->pending_events > 0) pending += static_cast<std::int64_t>(b->size);
      if (b->withheld) withheld += static_cast<std::int64_t>(b->size);
      expect = b->ptr + b->size;
      prev = b;
    }
    if (expect != segment->base + segment->span()) {
      return absl::InternalError("blocks do not cover their segment");
    }
    if (segment->expandable) {
      std::size_t extents = 0;
      for (const auto& [offset, bytes] : segment->extents) extents += bytes;
      if (extents != segment->size || mapped != segment->size) {
        return absl::InternalError("an expandable segment's mappings do not add up");
      }
    }
  }
  if (free_blocks != small_free_.size() + large_free_.size()) {
    return absl::InternalError("free sets hold blocks that are not free");
  }
  if (reserved != stats_.reserved_bytes.current) return absl::InternalError("reserved_bytes off");
  if (allocated != stats_.allocated_bytes.current)
    return absl::InternalError("allocated_bytes off");
  if (requested != stats_.requested_bytes.current)
    return absl::InternalError("requested_bytes off");
  if (active != stats_.active_blocks.current) return absl::InternalError("active_blocks off");
  if (pending != stats_.pending_free_bytes.current) {
    return absl::InternalError("pending_free_bytes off");
  }
  if (withheld != stats_.withheld_bytes.current) return absl::InternalError("withheld_bytes off");
  return absl::OkStatus();
}

}  // namespace strata::alloc
