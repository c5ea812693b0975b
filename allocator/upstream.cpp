#include "allocator/upstream.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <map>

#include <mutex>
#include "absl/base/thread_annotations.h"
#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"

namespace strata::alloc {
namespace {

absl::StatusOr<void*> map_anonymous(std::size_t bytes, int prot, std::string_view who) {
  void* p = mmap(nullptr, bytes, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    return absl::ResourceExhaustedError(
        str_cat(who, ": mmap of ", format_bytes(bytes), " failed: ", std::strerror(err)));
  }
  return p;
}

absl::Status unmap(void* ptr, std::size_t bytes, std::string_view who) {
  if (munmap(ptr, bytes) != 0) {
    const int err = errno;
    return absl::InternalError(
        str_cat(who, ": munmap(", ptr, ", ", bytes, ") failed: ", std::strerror(err)));
  }
  return absl::OkStatus();
}

// Expandable segments on the simulated device (See Note [Expandable segments] in
// block_pool_expand.cpp): a range is address space mapped PROT_NONE; "mapping" part of it makes
// those pages readable and writable (kMemory) or only counts them (kAddressOnly, which never
// touches memory), and unmapping drops the pages and makes them inaccessible again, so a test that
// uses memory the pool gave back faults as it would on a GPU. Mapped bytes and whole segments share
// the one capacity, as a GPU's memory does.
class SimulatedRanges {
 public:
  static constexpr std::size_t kGranularity = std::size_t{2} << 20;

  SimulatedRanges(std::string_view who, std::size_t capacity, bool backed)
      : who_(who), capacity_(capacity), backed_(backed) {}
  ~SimulatedRanges() {
    for (const auto& [base, bytes] : ranges_) munmap(base, bytes);
  }

  std::size_t capacity() const { return capacity_; }

  // Capacity accounting for segments and mappings alike.
  absl::Status take(std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (bytes > capacity_ - in_use_) {
      return absl::ResourceExhaustedError(
          str_cat(who_, " out of memory: asked ", format_bytes(bytes), ", in use ",
                  format_bytes(in_use_), " of capacity ", format_bytes(capacity_)));
    }
    in_use_ += bytes;
    return absl::OkStatus();
  }
  void give(std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    in_use_ -= bytes;
  }

  absl::StatusOr<Upstream::Range> reserve(std::size_t max_bytes, std::size_t min_bytes) {
    if (min_bytes == 0 || min_bytes > max_bytes || max_bytes % kGranularity != 0 ||
        min_bytes % kGranularity != 0) {
      return absl::InvalidArgumentError(str_cat(who_, ": reserve_range(", max_bytes, ", ",
                                                min_bytes,
                                                ") needs 0 < min <= max, both "
                                                "multiples of ",
                                                format_bytes(kGranularity)));
    }
    // Halve until the process can map it (a sanitizer's shadow layout leaves less address space).
    std::size_t length = max_bytes;
    absl::StatusOr<void*> base = map_anonymous(length, PROT_NONE, who_);
    while (!base.ok() && length / 2 >= min_bytes) {
      length = (length / 2) & ~(kGranularity - 1);
      base = map_anonymous(length, PROT_NONE, who_);
    }
    if (!base.ok()) return base.status();
    std::lock_guard<std::mutex> lock(mu_);
    ranges_.emplace(*base, length);
    return Upstream::Range{*base, length};
  }

  absl::Status release(void* base, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.find(base);
    if (it == ranges_.end() || it->second != bytes) {
      return absl::InvalidArgumentError(
          str_cat(who_, ": release_range(", base, ", ", bytes, ") is no range of this upstream"));
    }
    auto inside = mapped_.lower_bound(static_cast<std::byte*>(base));
    if (inside != mapped_.end() && inside->first < static_cast<std::byte*>(base) + bytes) {
      return absl::FailedPreconditionError(
          str_cat(who_, ": release_range(", base, ") while ", inside->first, " is mapped"));
    }
    ranges_.erase(it);
    return unmap(base, bytes, who_);
  }

  absl::Status map_memory(void* ptr, std::size_t bytes) {
    if (bytes == 0 || bytes % kGranularity != 0) {
      return absl::InvalidArgumentError(str_cat(who_, ": map_range of ", bytes,
                                                " bytes, not a multiple of ",
                                                format_bytes(kGranularity)));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!inside_a_range_locked(ptr, bytes)) {
        return absl::InvalidArgumentError(
            str_cat(who_, ": map_range(", ptr, ", ", bytes, ") is outside every range"));
      }
      auto next = mapped_.lower_bound(static_cast<std::byte*>(ptr));
      const bool overlaps_next =
          next != mapped_.end() && next->first < static_cast<std::byte*>(ptr) + bytes;
      const bool overlaps_prev =
          next != mapped_.begin() && std::prev(next)->first + std::prev(next)->second > ptr;
      if (overlaps_next || overlaps_prev) {
        return absl::FailedPreconditionError(
            str_cat(who_, ": map_range(", ptr, ", ", bytes, ") overlaps a mapping"));
      }
    }
    STRATA_RETURN_IF_ERROR(take(bytes));
    if (backed_ && mprotect(ptr, bytes, PROT_READ | PROT_WRITE) != 0) {
      const int err = errno;
      give(bytes);
      return absl::ResourceExhaustedError(
          str_cat(who_, ": mprotect of ", format_bytes(bytes), " failed: ", std::strerror(err)));
    }
    std::lock_guard<std::mutex> lock(mu_);
    mapped_.emplace(static_cast<std::byte*>(ptr), bytes);
    return absl::OkStatus();
  }

  absl::Status unmap_memory(void* ptr, std::size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = mapped_.find(static_cast<std::byte*>(ptr));
      if (it == mapped_.end() || it->second != bytes) {
        return absl::InvalidArgumentError(str_cat(who_, ": unmap_range(", ptr, ", ", bytes,
                                                  ") is not what one map_range mapped"));
      }
      mapped_.erase(it);
    }
    // The pages go (a later mapping reads zeros) and any access faults until mapped again.
    if (backed_ &&
        (madvise(ptr, bytes, MADV_DONTNEED) != 0 || mprotect(ptr, bytes, PROT_NONE) != 0)) {
      const int err = errno;
      std::lock_guard<std::mutex> lock(mu_);
      mapped_.emplace(static_cast<std::byte*>(ptr), bytes);
      return absl::InternalError(
          str_cat(who_, ": unmapping ", format_bytes(bytes), " failed: ", std::strerror(err)));
    }
    give(bytes);
    return absl::OkStatus();
  }

 private:
  bool inside_a_range_locked(const void* ptr, std::size_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = ranges_.upper_bound(const_cast<void*>(ptr));
    if (it == ranges_.begin()) return false;
    --it;
    const auto* base = static_cast<const std::byte*>(it->first);
    const auto* p = static_cast<const std::byte*>(ptr);
    return p >= base && p + bytes <= base + it->second;
  }

  const std::string who_;
  const std::size_t capacity_;
  const bool backed_;
  std::mutex mu_;
  std::size_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<void*, std::size_t> ranges_ ABSL_GUARDED_BY(mu_);       // base -> bytes
  std::map<std::byte*, std::size_t> mapped_ ABSL_GUARDED_BY(mu_);  // start -> bytes
};

// The two simulated devices: their expandable ranges, and the capacity those share with segments.
class SimulatedUpstream : public Upstream {
 public:
  SimulatedUpstream(std::string_view who, std::size_t capacity, bool backed)
      : ranges_(who, capacity, backed) {}

  std::size_t expansion_granularity() const override { return SimulatedRanges::kGranularity; }
  std::size_t max_range_bytes() const override { return ranges_.capacity(); }
  absl::StatusOr<Range> reserve_range(std::size_t max_bytes, std::size_t min_bytes) override {
    return ranges_.reserve(max_bytes, min_bytes);
  }
  absl::Status release_range(void* base, std::size_t bytes) override {
    return ranges_.release(base, bytes);
  }
  absl::Status map_range(void* ptr, std::size_t bytes) override {
    return ranges_.map_memory(ptr, bytes);
  }
  absl::Status unmap_range(void* ptr, std::size_t bytes) override {
    return ranges_.unmap_memory(ptr, bytes);
  }

 protected:
  SimulatedRanges ranges_;
};

class SimulatedDeviceUpstream final : public SimulatedUpstream {
 public:
  explicit SimulatedDeviceUpstream(SimulatedDeviceOptions options)
      : SimulatedUpstream("simulated device", options.capacity, /*backed=*/true) {}

  std::string_view name() const override { return "simulated_device"; }

  absl::StatusOr<void*> allocate(std::size_t bytes) override {
    STRATA_RETURN_IF_ERROR(ranges_.take(bytes));
    absl::StatusOr<void*> p = map_anonymous(bytes, PROT_READ | PROT_WRITE, name());
    if (!p.ok()) ranges_.give(bytes);
    return p;
  }

  absl::Status deallocate(void* ptr, std::size_t bytes) override {
    absl::Status s = unmap(ptr, bytes, name());
    if (s.ok()) ranges_.give(bytes);
    return s;
  }
};

// Address space only: one PROT_NONE reservation, carved first-fit. One mapping however many
// segments, so a model of terabytes in hundreds of thousands of segments stays within the kernel's
// mapping limit; any access faults, since nothing is backed.
//
// The reservation is made at the first allocate. Where the process cannot map the whole capacity
// (a sanitizer's shadow layout, a ulimit -v, a kernel without overcommit of PROT_NONE), it halves
// the request until a mapping succeeds, no smaller than that first segment: the capacity is then
// what could be reserved, and an out-of-memory message says so.
class AddressSpaceUpstream final : public SimulatedUpstream {
 public:
  static constexpr std::size_t kMaxReservation = std::size_t{16} << 40;

  explicit AddressSpaceUpstream(std::size_t capacity)
      : SimulatedUpstream("simulated device (address only)",
                          std::min(capacity, kMaxReservation) & ~(kSegmentAlignment - 1),
                          /*backed=*/false),
        capacity_(ranges_.capacity()) {}
  ~AddressSpaceUpstream() override {
    if (base_ != nullptr) munmap(base_, reserved_);
  }
  std::string_view name() const override { return "simulated_device(address_only)"; }

  absl::StatusOr<void*> allocate(std::size_t bytes) override {
    const std::size_t size = (bytes + kSegmentAlignment - 1) & ~(kSegmentAlignment - 1);
    // Segments and expandable ranges' mappings share the capacity.
    STRATA_RETURN_IF_ERROR(ranges_.take(size));
    absl::StatusOr<void*> p = carve(size, bytes);
    if (!p.ok()) ranges_.give(size);
    return p;
  }

  absl::Status deallocate(void* ptr, std::size_t bytes) override {
    const std::size_t size = (bytes + kSegmentAlignment - 1) & ~(kSegmentAlignment - 1);
    give_back(ptr, size);
    ranges_.give(size);
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<void*> carve(std::size_t size, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (base_ == nullptr) STRATA_RETURN_IF_ERROR(reserve(size));
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < size) continue;
      const std::size_t offset = it->first;
      const std::size_t rest = it->second - size;
      free_.erase(it);
      if (rest > 0) free_.emplace(offset + size, rest);
      return static_cast<void*>(base_ + offset);
    }
    std::string reserved_note;
    if (reserved_ < capacity_) {
      reserved_note =
          str_cat(" (only ", format_bytes(reserved_), " of address space could be reserved)");
    }
    return absl::ResourceExhaustedError(
        str_cat("simulated device (address only) out of memory: ", "asked ", format_bytes(bytes),
                " of capacity ", format_bytes(capacity_), reserved_note));
  }

  void give_back(void* ptr, std::size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    std::size_t offset = static_cast<std::size_t>(static_cast<std::byte*>(ptr) - base_);
    std::size_t length = size;
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && offset + length == next->first) {
      length += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        offset = prev->first;
        length += prev->second;
        free_.erase(prev);
      }
    }
    free_.emplace(offset, length);
  }

  absl::Status reserve(std::size_t first_segment) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (first_segment > capacity_) {
      return absl::ResourceExhaustedError(
          str_cat("simulated device (address only) out of memory: asked ",
                  format_bytes(first_segment), " of capacity ", format_bytes(capacity_)));
    }
    std::size_t length = capacity_;
    absl::StatusOr<void*> base = map_anonymous(length, PROT_NONE, name());
    while (!base.ok() && length / 2 >= first_segment) {
      length = (length / 2) & ~(kSegmentAlignment - 1);
      base = map_anonymous(length, PROT_NONE, name());
    }
    if (!base.ok()) return base.status();
    base_ = static_cast<std::byte*>(*base);
    reserved_ = length;
    free_.emplace(0, reserved_);
    return absl::OkStatus();
  }

  const std::size_t capacity_;
  std::mutex mu_;
  std::byte* base_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::size_t reserved_ ABSL_GUARDED_BY(mu_) = 0;  // bytes mapped at base_, <= capacity_
  std::map<std::size_t, std::size_t> free_ ABSL_GUARDED_BY(mu_);  // offset -> length
};

class PageableHostUpstream final : public Upstream {
 public:
  explicit PageableHostUpstream(std::string_view name) : name_(name) {}
  std::string_view name() const override { return name_; }
  absl::StatusOr<void*> allocate(std::size_t bytes) override {
    return map_anonymous(bytes, PROT_READ | PROT_WRITE, name());
  }
  absl::Status deallocate(void* ptr, std::size_t bytes) override {
    return unmap(ptr, bytes, name());
  }

 private:
  const std::string name_;
};

}  // namespace

std::unique_ptr<Upstream> make_simulated_device_upstream(SimulatedDeviceOptions options) {
  if (options.backing == SimulatedBacking::kAddressOnly) {
    return std::make_unique<AddressSpaceUpstream>(options.capacity);
  }
  return std::make_unique<SimulatedDeviceUpstream>(options);
}

std::unique_ptr<Upstream> make_pageable_host_upstream() {
  return std::make_unique<PageableHostUpstream>("pageable_host");
}

std::unique_ptr<Upstream> make_simulated_pinned_upstream() {
  return std::make_unique<PageableHostUpstream>("simulated_pinned_host");
}

std::string_view device_method_name(DeviceMethod method) {
  switch (method) {
    case DeviceMethod::kAuto:
      return "auto";
    case DeviceMethod::kVirtualMemory:
      return "virtual memory";
    case DeviceMethod::kCudaMalloc:
      return "cudaMalloc";
  }
  return "?";
}

absl::StatusOr<DeviceMethod> parse_device_method(std::string_view name) {
  if (name == "auto") return DeviceMethod::kAuto;
  if (name == "virtual") return DeviceMethod::kVirtualMemory;
  if (name == "cudamalloc") return DeviceMethod::kCudaMalloc;
  return absl::InvalidArgumentError(
      str_cat("must be auto, virtual or cudamalloc, not '", name, "'"));
}

std::string_view pinned_method_name(PinnedMethod method) {
  return method == PinnedMethod::kCudaHostAlloc ? "cudaHostAlloc" : "mmap+cudaHostRegister";
}

absl::StatusOr<Upstream::Range> Upstream::reserve_range(std::size_t, std::size_t) {
  return absl::UnimplementedError(str_cat(name(), " has no expandable segments"));
}
absl::Status Upstream::release_range(void*, std::size_t) {
  return absl::UnimplementedError(str_cat(name(), " has no expandable segments"));
}
absl::Status Upstream::map_range(void*, std::size_t) {
  return absl::UnimplementedError(str_cat(name(), " has no expandable segments"));
}
absl::Status Upstream::unmap_range(void*, std::size_t) {
  return absl::UnimplementedError(str_cat(name(), " has no expandable segments"));
}

void FaultInjectingUpstream::fail_allocate_calls(std::int64_t first, std::int64_t count) {
  allocate_calls_.store(0);
  fail_count_.store(count);
  fail_first_.store(first);
}

void FaultInjectingUpstream::fail_all_allocates() { fail_first_.store(-1); }

void FaultInjectingUpstream::disarm() { fail_first_.store(0); }

absl::Status FaultInjectingUpstream::count_allocate_call(std::size_t bytes) {
  const std::int64_t call = ++allocate_calls_;
  const std::int64_t first = fail_first_.load();
  if (first == -1 || (first > 0 && call >= first && call < first + fail_count_.load())) {
    ++injected_;
    if (on_inject_) on_inject_();
    return absl::ResourceExhaustedError(
        str_cat("injected failure of upstream call ", call, " (", format_bytes(bytes), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<void*> FaultInjectingUpstream::allocate(std::size_t bytes) {
  STRATA_RETURN_IF_ERROR(count_allocate_call(bytes));
  return inner_->allocate(bytes);
}

absl::StatusOr<Upstream::Range> FaultInjectingUpstream::reserve_range(std::size_t max_bytes,
                                                                      std::size_t min_bytes) {
  STRATA_RETURN_IF_ERROR(count_allocate_call(max_bytes));
  return inner_->reserve_range(max_bytes, min_bytes);
}

absl::Status FaultInjectingUpstream::release_range(void* base, std::size_t bytes) {
  ++deallocate_calls_;
  return inner_->release_range(base, bytes);
}

absl::Status FaultInjectingUpstream::map_range(void* ptr, std::size_t bytes) {
  STRATA_RETURN_IF_ERROR(count_allocate_call(bytes));
  return inner_->map_range(ptr, bytes);
}

absl::Status FaultInjectingUpstream::unmap_range(void* ptr, std::size_t bytes) {
  ++deallocate_calls_;
  return inner_->unmap_range(ptr, bytes);
}

absl::Status FaultInjectingUpstream::deallocate(void* ptr, std::size_t bytes) {
  ++deallocate_calls_;
  return inner_->deallocate(ptr, bytes);
}

}  // namespace strata::alloc
