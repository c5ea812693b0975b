#include "tests/runtime/fault_injection.h"

#include "base/status.h"
#include "base/strings.h"

namespace strata::rt {

std::string_view device_call_name(DeviceCall call) {
  switch (call) {
    case DeviceCall::kCopy:
      return "copy";
    case DeviceCall::kRecord:
      return "event record";
    case DeviceCall::kStreamWait:
      return "stream wait";
    case DeviceCall::kHostWait:
      return "host wait";
    case DeviceCall::kQuery:
      return "event query";
    case DeviceCall::kCreateStream:
      return "stream creation";
    case DeviceCall::kLaunch:
      return "launch";
  }
  return "?";
}

void FaultInjectingDevice::fail_call(DeviceCall call, std::int64_t first, std::int64_t count) {
  Slot& s = slot(call);
  s.calls.store(0);
  s.count.store(count);
  s.sticky.store(false);
  s.first.store(first);
}

void FaultInjectingDevice::fail_sticky(DeviceCall call, std::int64_t first) {
  Slot& s = slot(call);
  s.calls.store(0);
  s.count.store(1);
  s.sticky.store(true);
  s.first.store(first);
}

void FaultInjectingDevice::disarm() {
  for (Slot& s : slots_) s.first.store(0);
  stuck_.store(false);
}

absl::Status FaultInjectingDevice::injected_failure(DeviceCall call, std::int64_t n) {
  ++injected_;
  if (on_inject_) on_inject_();
  return absl::InternalError(str_cat("injected failure of ", device_call_name(call), " call ", n,
                                     stuck_.load() ? " (sticky device error)" : ""));
}

absl::Status FaultInjectingDevice::check(DeviceCall call, bool* dropped) {
  if (paused_.load()) return absl::OkStatus();
  Slot& s = slot(call);
  const std::int64_t n = ++s.calls;
  if (stuck_.load()) return injected_failure(call, n);
  const std::int64_t first = s.first.load();
  if (first == 0 || n < first || n >= first + s.count.load()) return absl::OkStatus();
  if (!s.sticky.load()) return injected_failure(call, n);
  stuck_.store(true);
  if (dropped != nullptr) {  // an asynchronous error: the copy "ran" and failed on the device
    ++injected_;
    if (on_inject_) on_inject_();
    *dropped = true;
    return absl::OkStatus();
  }
  return injected_failure(call, n);
}

absl::StatusOr<StreamHandle> FaultInjectingDevice::create_stream() {
  STRATA_RETURN_IF_ERROR(check(DeviceCall::kCreateStream));
  return inner_->create_stream();
}

absl::Status FaultInjectingDevice::copy_async(void* dst, const void* src, std::size_t bytes,
                                              StreamHandle stream) {
  bool dropped = false;
  STRATA_RETURN_IF_ERROR(check(DeviceCall::kCopy, &dropped));
  if (dropped) return absl::OkStatus();
  return inner_->copy_async(dst, src, bytes, stream);
}

absl::Status FaultInjectingDevice::stream_wait(StreamHandle stream, EventHandle event) {
  STRATA_RETURN_IF_ERROR(check(DeviceCall::kStreamWait));
  return inner_->stream_wait(stream, event);
}

absl::Status FaultInjectingDevice::enqueue_host(StreamHandle stream, std::function<void()> fn) {
  STRATA_RETURN_IF_ERROR(check(DeviceCall::kLaunch));
  return inner_->enqueue_host(stream, std::move(fn));
}

absl::Status FaultInjectingDevice::stream_synchronize(StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(check(DeviceCall::kHostWait));
  return inner_->stream_synchronize(stream);
}

absl::StatusOr<EventHandle> FaultInjectingDevice::record_timed(StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(check(DeviceCall::kRecord));
  return inner_->record_timed(stream);
}

absl::StatusOr<EventHandle> FaultInjectingDevice::record(StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(check(DeviceCall::kRecord));
  return inner_->record(stream);
}

absl::StatusOr<bool> FaultInjectingDevice::query(EventHandle event) {
  STRATA_RETURN_IF_ERROR(check(DeviceCall::kQuery));
  return inner_->query(event);
}

absl::Status FaultInjectingDevice::synchronize(EventHandle event) {
  STRATA_RETURN_IF_ERROR(check(DeviceCall::kHostWait));
  return inner_->synchronize(event);
}

}  // namespace strata::rt
