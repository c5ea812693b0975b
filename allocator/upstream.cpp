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

class SimulatedDeviceUpstream final : public Upstream {
 public:
  explicit SimulatedDeviceUpstream(SimulatedDeviceOptions options) : options_(options) {}

  std::string_view name() const override { return "simulated_device"; }

  absl::StatusOr<void*> allocate(std::size_t bytes) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (bytes > options_.capacity - in_use_) {
        return absl::ResourceExhaustedError(
            str_cat("simulated device out of memory: asked ", format_bytes(bytes), ", in use ",
                    format_bytes(in_use_), " of capacity ", format_bytes(options_.capacity)));
      }
      in_use_ += bytes;
    }
    // Address-only segments are PROT_NONE: any access faults, so a test that touches them is a bug.
    const int prot =
        options_.backing == SimulatedBacking::kMemory ? PROT_READ | PROT_WRITE : PROT_NONE;
    absl::StatusOr<void*> p = map_anonymous(bytes, prot, name());
    if (!p.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      in_use_ -= bytes;
    }
    return p;
  }

  absl::Status deallocate(void* ptr, std::size_t bytes) override {
    absl::Status s = unmap(ptr, bytes, name());
    if (s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      in_use_ -= bytes;
    }
    return s;
  }

 private:
  const SimulatedDeviceOptions options_;
  std::mutex mu_;
  std::size_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
};

// Address space only: one PROT_NONE reservation, carved first-fit. One mapping however many
// segments, so a model of terabytes in hundreds of thousands of segments stays within the kernel's
// mapping limit; any access faults, since nothing is backed.
//
// The reservation is made at the first allocate. Where the process cannot map the whole capacity
// (a sanitizer's shadow layout, a ulimit -v, a kernel without overcommit of PROT_NONE), it halves
// the request until a mapping succeeds, no smaller than that first segment: the capacity is then
// what could be reserved, and an out-of-memory message says so.
class AddressSpaceUpstream final : public Upstream {
 public:
  static constexpr std::size_t kMaxReservation = std::size_t{16} << 40;

  explicit AddressSpaceUpstream(std::size_t capacity)
      : capacity_(std::min(capacity, kMaxReservation) & ~(kSegmentAlignment - 1)) {}
  ~AddressSpaceUpstream() override {
    if (base_ != nullptr) munmap(base_, reserved_);
  }
  std::string_view name() const override { return "simulated_device(address_only)"; }

  absl::StatusOr<void*> allocate(std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    const std::size_t size = (bytes + kSegmentAlignment - 1) & ~(kSegmentAlignment - 1);
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

  absl::Status deallocate(void* ptr, std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    const std::size_t size = (bytes + kSegmentAlignment - 1) & ~(kSegmentAlignment - 1);
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
    return absl::OkStatus();
  }

 private:
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

void FaultInjectingUpstream::fail_allocate_calls(std::int64_t first, std::int64_t count) {
  allocate_calls_.store(0);
  fail_count_.store(count);
  fail_first_.store(first);
}

void FaultInjectingUpstream::fail_all_allocates() { fail_first_.store(-1); }

void FaultInjectingUpstream::disarm() { fail_first_.store(0); }

absl::StatusOr<void*> FaultInjectingUpstream::allocate(std::size_t bytes) {
  const std::int64_t call = ++allocate_calls_;
  const std::int64_t first = fail_first_.load();
  if (first == -1 || (first > 0 && call >= first && call < first + fail_count_.load())) {
    ++injected_;
    if (on_inject_) on_inject_();
    return absl::ResourceExhaustedError(
        str_cat("injected failure of upstream call ", call, " (", format_bytes(bytes), ")"));
  }
  return inner_->allocate(bytes);
}

absl::Status FaultInjectingUpstream::deallocate(void* ptr, std::size_t bytes) {
  ++deallocate_calls_;
  return inner_->deallocate(ptr, bytes);
}

}  // namespace strata::alloc
