#include "allocator/upstream.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
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

  std::string_view name() const override {
    return options_.backing == SimulatedBacking::kMemory ? "simulated_device"
                                                         : "simulated_device(address_only)";
  }

  absl::StatusOr<void*> allocate(std::size_t bytes) override {
    {
      absl::MutexLock lock(&mu_);
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
      absl::MutexLock lock(&mu_);
      in_use_ -= bytes;
    }
    return p;
  }

  absl::Status deallocate(void* ptr, std::size_t bytes) override {
    absl::Status s = unmap(ptr, bytes, name());
    if (s.ok()) {
      absl::MutexLock lock(&mu_);
      in_use_ -= bytes;
    }
    return s;
  }

 private:
  const SimulatedDeviceOptions options_;
  absl::Mutex mu_;
  std::size_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
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
  return std::make_unique<SimulatedDeviceUpstream>(options);
}

std::unique_ptr<Upstream> make_pageable_host_upstream() {
  return std::make_unique<PageableHostUpstream>("pageable_host");
}

std::unique_ptr<Upstream> make_simulated_pinned_upstream() {
  return std::make_unique<PageableHostUpstream>("simulated_pinned_host");
}

std::string_view pinned_method_name(PinnedMethod method) {
  return method == PinnedMethod::kCudaHostAlloc ? "cudaHostAlloc" : "mmap+cudaHostRegister";
}

void FaultInjectingUpstream::fail_allocate_call(std::int64_t k) {
  allocate_calls_.store(0);
  fail_at_.store(k);
}

void FaultInjectingUpstream::fail_all_allocates() { fail_at_.store(-1); }

void FaultInjectingUpstream::disarm() { fail_at_.store(0); }

absl::StatusOr<void*> FaultInjectingUpstream::allocate(std::size_t bytes) {
  const std::int64_t call = ++allocate_calls_;
  const std::int64_t fail_at = fail_at_.load();
  if (fail_at == -1 || call == fail_at) {
    ++injected_;
    return absl::ResourceExhaustedError(str_cat(inner_->name(), ": injected failure of call ", call,
                                                " (", format_bytes(bytes), ")"));
  }
  return inner_->allocate(bytes);
}

absl::Status FaultInjectingUpstream::deallocate(void* ptr, std::size_t bytes) {
  ++deallocate_calls_;
  return inner_->deallocate(ptr, bytes);
}

}  // namespace strata::alloc
