// runtime/copy_trace.h: when each copy of a step ran, per direction, and how much of the step each
// direction of the link spent alone, together with the other, or idle. A benchmark or strata-train
// puts a CopyTracer between the runtime and its device (RuntimeOptions::device_override); between
// start() and finish() every copy is bracketed by two timed events on its own stream.
//
// Example:
//   auto tracer = std::make_unique<CopyTracer>(*rt::make_device(rt::DeviceKind::kCuda));
//   CopyTracer* trace = tracer.get();
//   options.device_override = std::move(tracer);
//   ...
//   STRATA_RETURN_IF_ERROR(trace->start(runtime.h2d_stream()));   // device idle
//   ...one step, then wait for the device...
//   STRATA_ASSIGN_OR_RETURN(std::vector<CopySpan> spans, trace->finish());
//   LinkUse use = link_use(spans, runtime.h2d_stream(), runtime.d2h_stream());
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status.h"
#include "runtime/device.h"

namespace strata::rt {

struct CopySpan {
  rt::StreamHandle stream = nullptr;
  std::size_t bytes = 0;
  double start_ms = 0;  // from start()'s origin event
  double end_ms = 0;
};

class CopyTracer final : public rt::Device {
 public:
  explicit CopyTracer(std::unique_ptr<rt::Device> inner) : inner_(std::move(inner)) {}
  ~CopyTracer() override { drop(); }

  // Traces the copies queued from now on; times count from an event recorded on `stream` now.
  absl::Status start(rt::StreamHandle stream) {
    drop();
    STRATA_ASSIGN_OR_RETURN(origin_, inner_->record_timed(stream));
    return absl::OkStatus();
  }
  // While tracing: a labelled point on `stream` (where a layer's backward ended, say), whose time
  // finish() puts in marks().
  absl::Status mark(rt::StreamHandle stream, std::string label) {
    if (origin_ == nullptr) return absl::OkStatus();
    STRATA_ASSIGN_OR_RETURN(rt::EventHandle event, inner_->record_timed(stream));
    pending_marks_.push_back({std::move(label), event});
    return absl::OkStatus();
  }
  // The last trace's marks, in ms from its origin, in the order they were made.
  const std::vector<std::pair<std::string, double>>& marks() const { return marks_; }

  // Stops tracing and returns the traced copies, waiting for them on the host.
  absl::StatusOr<std::vector<CopySpan>> finish() {
    std::vector<CopySpan> out;
    absl::Status status;
    marks_.clear();
    for (const auto& [label, event] : pending_marks_) {
      if (status.ok()) status = inner_->synchronize(event);
      absl::StatusOr<double> at =
          status.ok() ? inner_->elapsed_ms(origin_, event) : absl::StatusOr<double>(status);
      if (!at.ok()) status = at.status();
      if (status.ok()) marks_.emplace_back(label, *at);
    }
    for (const Pending& p : pending_) {
      if (status.ok()) status = inner_->synchronize(p.end);
      absl::StatusOr<double> a =
          status.ok() ? inner_->elapsed_ms(origin_, p.start) : absl::StatusOr<double>(status);
      absl::StatusOr<double> b = a.ok() ? inner_->elapsed_ms(origin_, p.end) : a;
      if (!b.ok()) status = b.status();
      if (status.ok()) out.push_back({p.stream, p.bytes, *a, *b});
    }
    drop();
    if (!status.ok()) return status;
    return out;
  }

  std::string name() const override { return inner_->name(); }
  bool is_simulated() const override { return inner_->is_simulated(); }
  int cuda_device() const override { return inner_->cuda_device(); }
  absl::StatusOr<rt::StreamHandle> create_stream() override { return inner_->create_stream(); }
  void destroy_stream(rt::StreamHandle stream) override { inner_->destroy_stream(stream); }
  absl::Status copy_async(void* dst, const void* src, std::size_t bytes,
                          rt::StreamHandle stream) override {
    if (origin_ == nullptr) return inner_->copy_async(dst, src, bytes, stream);
    STRATA_ASSIGN_OR_RETURN(rt::EventHandle start, inner_->record_timed(stream));
    absl::Status s = inner_->copy_async(dst, src, bytes, stream);
    absl::StatusOr<rt::EventHandle> end =
        s.ok() ? inner_->record_timed(stream) : absl::StatusOr<rt::EventHandle>(s);
    if (!end.ok()) {
      (void)inner_->synchronize(start);
      inner_->release_timed(start);
      return end.status();
    }
    pending_.push_back({stream, bytes, start, *end});
    return absl::OkStatus();
  }
  absl::Status stream_wait(rt::StreamHandle stream, rt::EventHandle event) override {
    return inner_->stream_wait(stream, event);
  }
  absl::Status enqueue_host(rt::StreamHandle stream, std::function<void()> fn) override {
    return inner_->enqueue_host(stream, std::move(fn));
  }
  absl::Status stream_synchronize(rt::StreamHandle stream) override {
    return inner_->stream_synchronize(stream);
  }
  absl::StatusOr<rt::EventHandle> record_timed(rt::StreamHandle stream) override {
    return inner_->record_timed(stream);
  }
  absl::StatusOr<double> elapsed_ms(rt::EventHandle start, rt::EventHandle end) override {
    return inner_->elapsed_ms(start, end);
  }
  void release_timed(rt::EventHandle event) override { inner_->release_timed(event); }
  std::int64_t host_syncs() const override { return inner_->host_syncs(); }
  absl::StatusOr<rt::EventHandle> record(rt::StreamHandle stream) override {
    return inner_->record(stream);
  }
  absl::StatusOr<bool> query(rt::EventHandle event) override { return inner_->query(event); }
  absl::Status synchronize(rt::EventHandle event) override { return inner_->synchronize(event); }
  void release(rt::EventHandle event) override { inner_->release(event); }

 private:
  struct Pending {
    rt::StreamHandle stream;
    std::size_t bytes;
    rt::EventHandle start;
    rt::EventHandle end;
  };

  // Forgets the trace; its events are released once the copies they follow are done.
  void drop() {
    for (const Pending& p : pending_) {
      (void)inner_->synchronize(p.end);
      inner_->release_timed(p.start);
      inner_->release_timed(p.end);
    }
    pending_.clear();
    for (const auto& [label, event] : pending_marks_) {
      (void)inner_->synchronize(event);
      inner_->release_timed(event);
    }
    pending_marks_.clear();
    if (origin_ != nullptr) inner_->release_timed(origin_);
    origin_ = nullptr;
  }

  std::unique_ptr<rt::Device> inner_;
  rt::EventHandle origin_ = nullptr;
  std::vector<Pending> pending_;
  std::vector<std::pair<std::string, rt::EventHandle>> pending_marks_;
  std::vector<std::pair<std::string, double>> marks_;
};

// How a step used the two directions of the link, from its copies: from the origin to the last
// copy's end, the time both directions copied, one alone, or neither; and the bytes each moved
// while the other copied too or while it was alone (a copy's bytes spread evenly over its span).
struct LinkUse {
  double span_ms = 0;
  double both_ms = 0;
  double h2d_alone_ms = 0;
  double d2h_alone_ms = 0;
  double neither_ms = 0;
  double h2d_bytes_both = 0;
  double h2d_bytes_alone = 0;
  double d2h_bytes_both = 0;
  double d2h_bytes_alone = 0;
};

namespace copy_trace_internal {

using Intervals = std::vector<std::pair<double, double>>;

// The union of the spans of `stream`, sorted and merged.
inline Intervals busy(const std::vector<CopySpan>& spans, rt::StreamHandle stream) {
  Intervals v;
  for (const CopySpan& s : spans) {
    if (s.stream == stream && s.end_ms > s.start_ms) v.push_back({s.start_ms, s.end_ms});
  }
  std::sort(v.begin(), v.end());
  Intervals out;
  for (const auto& iv : v) {
    if (!out.empty() && iv.first <= out.back().second) {
      out.back().second = std::max(out.back().second, iv.second);
    } else {
      out.push_back(iv);
    }
  }
  return out;
}

inline double length(const Intervals& v) {
  double total = 0;
  for (const auto& [a, b] : v) total += b - a;
  return total;
}

// Length of [a, b) covered by the merged intervals `v`.
inline double covered(const Intervals& v, double a, double b) {
  double total = 0;
  for (const auto& [x, y] : v) total += std::max(0.0, std::min(b, y) - std::max(a, x));
  return total;
}

}  // namespace copy_trace_internal

inline LinkUse link_use(const std::vector<CopySpan>& spans, rt::StreamHandle h2d,
                        rt::StreamHandle d2h) {
  using namespace copy_trace_internal;
  const Intervals up = busy(spans, h2d);
  const Intervals down = busy(spans, d2h);
  LinkUse u;
  for (const CopySpan& s : spans) u.span_ms = std::max(u.span_ms, s.end_ms);
  for (const auto& [a, b] : up) u.both_ms += covered(down, a, b);
  u.h2d_alone_ms = length(up) - u.both_ms;
  u.d2h_alone_ms = length(down) - u.both_ms;
  u.neither_ms = u.span_ms - u.both_ms - u.h2d_alone_ms - u.d2h_alone_ms;
  for (const CopySpan& s : spans) {
    const bool is_h2d = s.stream == h2d;
    if (!is_h2d && s.stream != d2h) continue;
    const double ms = s.end_ms - s.start_ms;
    const double shared = ms > 0 ? covered(is_h2d ? down : up, s.start_ms, s.end_ms) / ms : 0;
    const double bytes = static_cast<double>(s.bytes);
    (is_h2d ? u.h2d_bytes_both : u.d2h_bytes_both) += bytes * shared;
    (is_h2d ? u.h2d_bytes_alone : u.d2h_bytes_alone) += bytes * (1 - shared);
  }
  return u;
}

}  // namespace strata::rt
