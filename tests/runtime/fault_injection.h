// tests/runtime/fault_injection.h: a Device that fails chosen calls, for the fault-injection suites
// (a test-only library, strata_test_faults, outside the runtime library).
//
// FaultInjectingDevice wraps another Device (the simulated one in the CPU suites) and fails the
// k-th call of one kind: a copy, an event record, a stream-to-event wait, a host wait (on an event
// or a stream), an event query, a stream creation, a host function (the simulated device's
// "kernel" launch). With FaultInjectingUpstream (allocator/upstream.h) on each tier it covers every
// place the runtime can meet an error it did not cause, so a test can sweep k over every call a
// scenario makes and check what each failure leaves behind (RELIABILITY.md, F1-F5). A failed call
// returns kInternal naming the call, as a CUDA error would; nothing of the inner device is touched
// by it.
//
// A sticky error (fail_sticky) models what CUDA does after an illegal address or a failed kernel:
// from the k-th call of a kind on, every call of every kind fails until disarm(). A sticky copy
// fails asynchronously: the k-th copy returns OK but never happens, and the error surfaces at the
// next call, whatever it is.
//
// Example:
//   auto faulty = std::make_unique<FaultInjectingDevice>(std::make_unique<SimulatedDevice>());
//   FaultInjectingDevice* faults = faulty.get();
//   options.device_override = std::move(faulty);
//   ...create the runtime...
//   faults->fail_call(DeviceCall::kCopy, 3);   // the third copy from now fails
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>

#include "runtime/device.h"

namespace strata::rt {

enum class DeviceCall { kCopy, kRecord, kStreamWait, kHostWait, kQuery, kCreateStream, kLaunch };
inline constexpr int kNumDeviceCalls = 7;
std::string_view device_call_name(DeviceCall call);

class FaultInjectingDevice final : public Device {
 public:
  explicit FaultInjectingDevice(std::unique_ptr<Device> inner) : inner_(std::move(inner)) {}

  // Fails calls number first .. first + count - 1 of `call`, counted from now (first >= 1); other
  // kinds are left as they were.
  void fail_call(DeviceCall call, std::int64_t first, std::int64_t count = 1);
  // A sticky error from the first-th call of `call` (counted from now) on: see the header.
  void fail_sticky(DeviceCall call, std::int64_t first);
  // No more failures of any kind.
  void disarm();
  // While paused, calls pass through neither counted nor failed (a test's own checks in between).
  void set_paused(bool paused) { paused_.store(paused); }
  // Called each time a failure is injected (e.g. to ask the inner device what is in flight).
  void set_on_inject(std::function<void()> fn) { on_inject_ = std::move(fn); }
  // Calls of a kind since the last fail_call for it (or since construction).
  std::int64_t calls(DeviceCall call) const { return slot(call).calls.load(); }
  std::int64_t injected() const { return injected_.load(); }
  Device& inner() { return *inner_; }

  std::string name() const override { return inner_->name(); }
  bool is_simulated() const override { return inner_->is_simulated(); }
  absl::StatusOr<StreamHandle> create_stream() override;
  void destroy_stream(StreamHandle stream) override { inner_->destroy_stream(stream); }
  absl::Status copy_async(void* dst, const void* src, std::size_t bytes,
                          StreamHandle stream) override;
  absl::Status stream_wait(StreamHandle stream, EventHandle event) override;
  absl::Status enqueue_host(StreamHandle stream, std::function<void()> fn) override;
  absl::Status stream_synchronize(StreamHandle stream) override;
  absl::StatusOr<EventHandle> record_timed(StreamHandle stream) override;
  absl::StatusOr<double> elapsed_ms(EventHandle start, EventHandle end) override {
    return inner_->elapsed_ms(start, end);
  }
  void release_timed(EventHandle event) override { inner_->release_timed(event); }
  std::int64_t host_syncs() const override { return inner_->host_syncs(); }
  absl::StatusOr<EventHandle> record(StreamHandle stream) override;
  absl::StatusOr<bool> query(EventHandle event) override;
  absl::Status synchronize(EventHandle event) override;
  void release(EventHandle event) override { inner_->release(event); }

 private:
  struct Slot {
    std::atomic<std::int64_t> calls{0};
    std::atomic<std::int64_t> first{0};  // 0: no failure planned
    std::atomic<std::int64_t> count{0};
    std::atomic<bool> sticky{false};
  };
  Slot& slot(DeviceCall call) { return slots_[static_cast<int>(call)]; }
  const Slot& slot(DeviceCall call) const { return slots_[static_cast<int>(call)]; }
  // OK, or the injected failure of this call. `dropped` (copies only) is set when a sticky error
  // starts at this copy: it returns OK but must not happen.
  absl::Status check(DeviceCall call, bool* dropped = nullptr);
  absl::Status injected_failure(DeviceCall call, std::int64_t n);

  std::unique_ptr<Device> inner_;
  std::array<Slot, kNumDeviceCalls> slots_;
  std::atomic<std::int64_t> injected_{0};
  std::atomic<bool> paused_{false};
  std::atomic<bool> stuck_{false};  // a sticky error is on
  std::function<void()> on_inject_;
};

}  // namespace strata::rt
