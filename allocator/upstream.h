// allocator/upstream.h: where a pool's segments come from.
//
// An Upstream hands out and takes back large segments; the pools above it split them into blocks.
// Upstreams are slow (cudaMalloc takes tens of microseconds, cudaHostAlloc hundreds per MiB;
// bench/ measures them), so a pool calls them only to grow or trim. Each upstream is its own class,
// RMM-style:
//   - CUDA device memory (virtual memory management, or cudaMalloc: DeviceMethod), for Tier::kGpu
//     on a machine with a GPU;
//   - pinned host memory, by cudaHostAlloc or by mmap + cudaHostRegister (PinnedMethod);
//   - pageable host memory (mmap);
//   - a simulated device: host memory standing in for GPU memory, with a capacity; the default
//     for Tier::kGpu where no GPU is found. With SimulatedBacking::kAddressOnly it reserves address
//     space that is never touched, so bookkeeping tests and benchmarks can model terabytes;
//   - FaultInjectingUpstream, an adaptor that fails the k-th call, for the fault tests.
// The CUDA virtual-memory and simulated device upstreams can also reserve address space and map
// memory into it piece by piece, for the GPU tier's expandable segments.
//
// Example:
//   auto device = strata::alloc::make_simulated_device_upstream({.capacity = 8 * kGiB});
//   absl::StatusOr<void*> segment = device->allocate(2 * kMiB);
//   if (segment.ok()) STRATA_CHECK(device->deallocate(*segment, 2 * kMiB).ok(), "release");
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace strata::alloc {

// Every segment an upstream returns is aligned to at least this (cudaMalloc gives 256 B or more;
// host upstreams map whole pages).
inline constexpr std::size_t kSegmentAlignment = 512;

class Upstream {
 public:
  virtual ~Upstream() = default;
  // "cuda_device", "pinned_host(cudaHostAlloc)", "pageable_host", "simulated_device", ...
  virtual std::string_view name() const = 0;
  // A segment of exactly `bytes` (> 0), aligned to kSegmentAlignment. Out of memory is
  // kResourceExhausted; nothing is held on failure.
  [[nodiscard]] virtual absl::StatusOr<void*> allocate(std::size_t bytes) = 0;
  // Returns a segment from allocate with its size. All work that may use it has completed: the pool
  // waits on an event recorded on the segment's stream before it releases a segment.
  [[nodiscard]] virtual absl::Status deallocate(void* ptr, std::size_t bytes) = 0;
  // True when the memory is real GPU memory (not host-readable).
  virtual bool is_device_memory() const { return false; }
  // Note [Pool visibility for memory checkers]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // The pool reports each block it hands out (with the bytes asked, not the rounded size) and each
  // block that returns to its free set, so a checker such as compute-sanitizer sees an access
  // outside every live block even where it falls inside a segment. The CUDA device upstream over
  // cudaMalloc forwards these to the NVTX memory API (compute-sanitizer refuses NVTX heaps on
  // virtual-memory mappings). Called with the pool's lock held; must be cheap. Default: nothing.
  virtual void on_block_live(const void* segment, const void* ptr, std::size_t bytes) {}
  virtual void on_block_dead(const void* segment, const void* ptr) {}

  // An upstream that can reserve address space and put physical memory behind parts of it lets a
  // pool grow a segment in place (See Note [Expandable segments] in block_pool_expand.cpp). These
  // five calls are that ability; an upstream without it returns 0 from expansion_granularity() and
  // kUnimplemented from the rest.
  //
  // The unit of map_range and unmap_range (a power of two), or 0: no expandable segments.
  virtual std::size_t expansion_granularity() const { return 0; }
  // The most address space worth reserving for one range (the device's memory).
  virtual std::size_t max_range_bytes() const { return 0; }
  // Address space of at most `max_bytes` and at least `min_bytes` (both multiples of the
  // granularity), with nothing behind it: a range's size is what could be had between the two.
  // kResourceExhausted when not even `min_bytes` can be reserved.
  struct Range {
    void* base = nullptr;
    std::size_t bytes = 0;
  };
  [[nodiscard]] virtual absl::StatusOr<Range> reserve_range(std::size_t max_bytes,
                                                            std::size_t min_bytes);
  // Gives back a range from reserve_range; nothing in it may still be mapped.
  [[nodiscard]] virtual absl::Status release_range(void* base, std::size_t bytes);
  // Puts `bytes` of memory behind [ptr, ptr + bytes) of a reserved range, readable and writable.
  // Out of memory is kResourceExhausted; nothing is mapped on failure.
  [[nodiscard]] virtual absl::Status map_range(void* ptr, std::size_t bytes);
  // Takes back exactly what one map_range call mapped at `ptr`. On failure it stays mapped.
  [[nodiscard]] virtual absl::Status unmap_range(void* ptr, std::size_t bytes);
};

enum class SimulatedBacking { kMemory, kAddressOnly };

struct SimulatedDeviceOptions {
  std::size_t capacity = std::size_t{16} << 30;
  SimulatedBacking backing = SimulatedBacking::kMemory;
};

std::unique_ptr<Upstream> make_simulated_device_upstream(SimulatedDeviceOptions options = {});
std::unique_ptr<Upstream> make_pageable_host_upstream();
// Pageable memory standing in for the pinned tier where there is no GPU to pin with.
std::unique_ptr<Upstream> make_simulated_pinned_upstream();

// How pinned host memory is obtained. Both are pinned once per segment and pooled by the pool
// above; which is the default was chosen by measurement (bench/results; See Note [Pinned upstream]
// in pinned_upstream.cpp).
enum class PinnedMethod { kCudaHostAlloc, kMmapRegister };
std::string_view pinned_method_name(PinnedMethod method);

// How GPU memory is obtained (See Note [Device memory method] in cuda_device_upstream.cpp): by
// CUDA's virtual memory management, whose frees do not wait for the device's other work, or by
// cudaMalloc, whose cudaFree waits until the whole device is idle. kAuto: virtual memory where the
// device and driver support it, cudaMalloc otherwise; the environment variable
// STRATA_GPU_MEMORY=virtual|cudamalloc decides kAuto instead (a memory checker's run wants
// cudaMalloc: block bounds are reported to it only on cudaMalloc'd segments).
enum class DeviceMethod { kAuto, kVirtualMemory, kCudaMalloc };
std::string_view device_method_name(DeviceMethod method);
// "auto", "virtual" or "cudamalloc" (strata-train's --strata_gpu_memory, STRATA_GPU_MEMORY).
absl::StatusOr<DeviceMethod> parse_device_method(std::string_view name);

// kUnavailable when strata was built without CUDA or no GPU is visible (or, for
// kVirtualMemory, when the device does not support it).
absl::StatusOr<std::unique_ptr<Upstream>> make_cuda_device_upstream(
    int device = 0, DeviceMethod method = DeviceMethod::kAuto);
// Pinned host memory, pinned in CUDA device `device`'s context (portable to every device).
absl::StatusOr<std::unique_ptr<Upstream>> make_pinned_host_upstream(PinnedMethod method,
                                                                    int device = 0);

// Number of CUDA devices visible; 0 when built without CUDA or when the driver reports none.
int cuda_device_count();
// "NVIDIA H100 80GB HBM3" or "none".
std::string cuda_device_name(int device = 0);

// Wraps an upstream and fails chosen calls, so tests can walk every allocation site (F1 of
// RELIABILITY.md). Calls are counted from 1 after each arm().
class FaultInjectingUpstream final : public Upstream {
 public:
  explicit FaultInjectingUpstream(std::unique_ptr<Upstream> inner) : inner_(std::move(inner)) {}

  // Fails allocate() calls number first .. first + count - 1, counted from this call on (first >=
  // 1), with kResourceExhausted. count 1 lets the pool's retry succeed; 2 defeats it.
  void fail_allocate_calls(std::int64_t first, std::int64_t count = 1);
  // Fails every allocate() call until disarm().
  void fail_all_allocates();
  void disarm();
  // Called each time a failure is injected (e.g. to ask a device what is in flight then).
  void set_on_inject(std::function<void()> fn) { on_inject_ = std::move(fn); }
  std::int64_t allocate_calls() const { return allocate_calls_.load(); }
  std::int64_t deallocate_calls() const { return deallocate_calls_.load(); }
  std::int64_t injected_failures() const { return injected_.load(); }

  std::string_view name() const override { return inner_->name(); }
  absl::StatusOr<void*> allocate(std::size_t bytes) override;
  absl::Status deallocate(void* ptr, std::size_t bytes) override;
  bool is_device_memory() const override { return inner_->is_device_memory(); }
  void on_block_live(const void* segment, const void* ptr, std::size_t bytes) override {
    inner_->on_block_live(segment, ptr, bytes);
  }
  void on_block_dead(const void* segment, const void* ptr) override {
    inner_->on_block_dead(segment, ptr);
  }
  // Reserving and mapping count as allocate calls: each may be the one that fails.
  std::size_t expansion_granularity() const override { return inner_->expansion_granularity(); }
  std::size_t max_range_bytes() const override { return inner_->max_range_bytes(); }
  absl::StatusOr<Range> reserve_range(std::size_t max_bytes, std::size_t min_bytes) override;
  absl::Status release_range(void* base, std::size_t bytes) override;
  absl::Status map_range(void* ptr, std::size_t bytes) override;
  absl::Status unmap_range(void* ptr, std::size_t bytes) override;

 private:
  // Counts an allocate-like call; an error when it is one chosen to fail.
  absl::Status count_allocate_call(std::size_t bytes);

  std::unique_ptr<Upstream> inner_;
  std::atomic<std::int64_t> allocate_calls_{0};
  std::atomic<std::int64_t> deallocate_calls_{0};
  std::atomic<std::int64_t> fail_first_{0};  // 0: none; -1: every call
  std::atomic<std::int64_t> fail_count_{0};
  std::atomic<std::int64_t> injected_{0};
  std::function<void()> on_inject_;
};

}  // namespace strata::alloc
