#include "runtime/device.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <vector>

#include <mutex>
#include "allocator/upstream.h"
#include "base/strings.h"

namespace strata::rt {

absl::StatusOr<DeviceChoice> parse_device(std::string_view name) {
  if (name == "auto") return DeviceChoice{DeviceKind::kAuto};
  if (name == "cuda") return DeviceChoice{DeviceKind::kCuda};
  if (name == "simulated") return DeviceChoice{DeviceKind::kSimulated};
  constexpr std::string_view kCudaColon = "cuda:";
  if (name.size() > kCudaColon.size() && name.size() <= kCudaColon.size() + 4 &&
      name.substr(0, kCudaColon.size()) == kCudaColon) {
    const std::string_view digits = name.substr(kCudaColon.size());
    if (std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      int index = 0;
      for (char c : digits) index = index * 10 + (c - '0');
      return DeviceChoice{DeviceKind::kCuda, index};
    }
  }
  return absl::InvalidArgumentError(
      str_cat("unknown device '", name,
              "'; use auto (the GPU if there is one), cuda (the current CUDA device), cuda:N "
              "(CUDA device N) or simulated"));
}

absl::StatusOr<std::unique_ptr<Device>> make_device(DeviceKind kind, int cuda_device) {
  switch (kind) {
    case DeviceKind::kSimulated:
      return std::unique_ptr<Device>(new SimulatedDevice());
    case DeviceKind::kCuda:
      return make_cuda_device(cuda_device);
    case DeviceKind::kAuto:
      if (alloc::cuda_device_count() > 0) return make_cuda_device(cuda_device);
      return std::unique_ptr<Device>(new SimulatedDevice());
  }
  return absl::InvalidArgumentError("unknown device kind");
}

// Each stream is a queue of operations. An event is shared state that a record operation completes;
// a wait operation holds the state itself, so releasing the event id after stream_wait() (as CUDA
// allows) does not lose the dependency.
struct SimulatedDevice::State {
  struct EventState {
    bool done = false;
    std::chrono::steady_clock::time_point when{};
  };
  struct Op {
    enum Kind { kCopy, kRecord, kWait, kHost };
    explicit Op(Kind k) : kind(k) {}
    Kind kind;
    void* dst = nullptr;
    const void* src = nullptr;
    std::size_t bytes = 0;
    std::shared_ptr<EventState> event;
    std::function<void()> fn;
  };

  std::mutex mu;
  bool deferred = false;
  std::optional<std::mt19937_64> random;  // random completion
  std::uintptr_t next_stream = 1;
  std::uintptr_t next_event = 1;
  std::map<std::uintptr_t, std::deque<Op>> streams;  // 0 is the legacy default stream
  std::map<std::uintptr_t, std::shared_ptr<EventState>> events;
  std::int64_t host_syncs = 0;

  // Runs the front operation of a stream if it can run.
  bool run_front(std::deque<Op>& q) {
    if (q.empty()) return false;
    Op& op = q.front();
    switch (op.kind) {
      case Op::kWait:
        if (!op.event->done) return false;
        break;
      case Op::kCopy:
        if (op.bytes > 0) std::memmove(op.dst, op.src, op.bytes);
        break;
      case Op::kRecord:
        op.event->done = true;
        op.event->when = std::chrono::steady_clock::now();
        break;
      case Op::kHost:
        op.fn();
        break;
    }
    q.pop_front();
    return true;
  }

  int run_all() {
    int ran = 0;
    for (bool progress = true; progress;) {
      progress = false;
      for (auto& [id, q] : streams) {
        while (run_front(q)) {
          ++ran;
          progress = true;
        }
      }
    }
    return ran;
  }

  // Runs operations, one per stream in turn, until `e` completes or nothing can run: a host wait on
  // one event leaves work queued behind it (or on other streams) still to run, as on a GPU.
  void run_until(const EventState& e) {
    for (bool progress = true; progress && !e.done;) {
      progress = false;
      for (auto& [id, q] : streams) {
        if (run_front(q)) progress = true;
        if (e.done) return;
      }
    }
  }

  // Random completion: up to two runnable operations, each of a stream picked at random.
  void run_some() {
    if (!deferred || !random.has_value()) return;
    const int n = static_cast<int>((*random)() % 3);
    for (int i = 0; i < n; ++i) {
      std::vector<std::deque<Op>*> runnable;
      for (auto& [id, q] : streams) {
        if (!q.empty() && (q.front().kind != Op::kWait || q.front().event->done)) {
          runnable.push_back(&q);
        }
      }
      if (runnable.empty()) return;
      run_front(*runnable[(*random)() % runnable.size()]);
    }
  }

  absl::Status enqueue(StreamHandle stream, Op op) {
    auto it = streams.find(reinterpret_cast<std::uintptr_t>(stream));
    if (it == streams.end()) {
      return absl::InvalidArgumentError(str_cat("simulated device: unknown stream ", stream));
    }
    it->second.push_back(std::move(op));
    if (!deferred) run_all();
    run_some();
    return absl::OkStatus();
  }

  std::shared_ptr<EventState> find_event(EventHandle e) {
    auto it = events.find(reinterpret_cast<std::uintptr_t>(e));
    return it == events.end() ? nullptr : it->second;
  }
};

SimulatedDevice::SimulatedDevice() : state_(std::make_unique<State>()) {
  state_->streams[0];  // the legacy default stream
}

SimulatedDevice::~SimulatedDevice() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->run_all();
}

absl::StatusOr<StreamHandle> SimulatedDevice::create_stream() {
  std::lock_guard<std::mutex> lock(state_->mu);
  const std::uintptr_t id = state_->next_stream++;
  state_->streams[id];
  return reinterpret_cast<StreamHandle>(id);
}

void SimulatedDevice::destroy_stream(StreamHandle stream) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->run_all();
  state_->streams.erase(reinterpret_cast<std::uintptr_t>(stream));
}

absl::Status SimulatedDevice::copy_async(void* dst, const void* src, std::size_t bytes,
                                         StreamHandle stream) {
  std::lock_guard<std::mutex> lock(state_->mu);
  State::Op op(State::Op::kCopy);
  op.dst = dst;
  op.src = src;
  op.bytes = bytes;
  return state_->enqueue(stream, std::move(op));
}

absl::Status SimulatedDevice::stream_wait(StreamHandle stream, EventHandle event) {
  std::lock_guard<std::mutex> lock(state_->mu);
  std::shared_ptr<State::EventState> e = state_->find_event(event);
  if (e == nullptr) {
    return absl::InvalidArgumentError(str_cat("simulated device: wait on unknown event ", event));
  }
  State::Op op(State::Op::kWait);
  op.event = std::move(e);
  return state_->enqueue(stream, std::move(op));
}

absl::Status SimulatedDevice::enqueue_host(StreamHandle stream, std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(state_->mu);
  State::Op op(State::Op::kHost);
  op.fn = std::move(fn);
  return state_->enqueue(stream, std::move(op));
}

absl::Status SimulatedDevice::stream_synchronize(StreamHandle stream) {
  std::lock_guard<std::mutex> lock(state_->mu);
  ++state_->host_syncs;
  state_->run_all();
  auto it = state_->streams.find(reinterpret_cast<std::uintptr_t>(stream));
  if (it == state_->streams.end()) {
    return absl::InvalidArgumentError(str_cat("simulated device: unknown stream ", stream));
  }
  if (!it->second.empty()) {
    return absl::DeadlineExceededError(
        "simulated device: stream waits on an event that is never recorded (deadlock)");
  }
  return absl::OkStatus();
}

absl::StatusOr<EventHandle> SimulatedDevice::record(StreamHandle stream) {
  std::lock_guard<std::mutex> lock(state_->mu);
  const std::uintptr_t id = state_->next_event++;
  auto e = std::make_shared<State::EventState>();
  state_->events[id] = e;
  State::Op op(State::Op::kRecord);
  op.event = e;
  absl::Status s = state_->enqueue(stream, std::move(op));
  if (!s.ok()) {
    state_->events.erase(id);
    return s;
  }
  return reinterpret_cast<EventHandle>(id);
}

absl::StatusOr<EventHandle> SimulatedDevice::record_timed(StreamHandle stream) {
  return record(stream);
}

absl::StatusOr<bool> SimulatedDevice::query(EventHandle event) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->run_some();
  std::shared_ptr<State::EventState> e = state_->find_event(event);
  if (e == nullptr) {
    return absl::InvalidArgumentError(str_cat("simulated device: query of unknown event ", event));
  }
  return e->done;
}

absl::Status SimulatedDevice::synchronize(EventHandle event) {
  std::lock_guard<std::mutex> lock(state_->mu);
  ++state_->host_syncs;
  std::shared_ptr<State::EventState> e = state_->find_event(event);
  if (e == nullptr) {
    return absl::InvalidArgumentError(
        str_cat("simulated device: synchronize on unknown event ", event));
  }
  if (!e->done) state_->run_until(*e);
  if (!e->done) {
    return absl::DeadlineExceededError(
        "simulated device: the event can never complete (its stream waits on an unrecorded event)");
  }
  return absl::OkStatus();
}

absl::StatusOr<double> SimulatedDevice::elapsed_ms(EventHandle start, EventHandle end) {
  std::lock_guard<std::mutex> lock(state_->mu);
  std::shared_ptr<State::EventState> a = state_->find_event(start);
  std::shared_ptr<State::EventState> b = state_->find_event(end);
  if (a == nullptr || b == nullptr) {
    return absl::InvalidArgumentError("simulated device: elapsed_ms of an unknown event");
  }
  if (!a->done || !b->done) {
    return absl::FailedPreconditionError("simulated device: elapsed_ms of a pending event");
  }
  return std::chrono::duration<double, std::milli>(b->when - a->when).count();
}

void SimulatedDevice::release(EventHandle event) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->events.erase(reinterpret_cast<std::uintptr_t>(event));
}

void SimulatedDevice::release_timed(EventHandle event) { release(event); }

std::int64_t SimulatedDevice::host_syncs() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->host_syncs;
}

void SimulatedDevice::set_deferred(bool deferred) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->deferred = deferred;
  if (!deferred) state_->run_all();
}

int SimulatedDevice::run_pending() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->run_all();
}

bool SimulatedDevice::run_one(StreamHandle stream) {
  std::lock_guard<std::mutex> lock(state_->mu);
  auto it = state_->streams.find(reinterpret_cast<std::uintptr_t>(stream));
  return it != state_->streams.end() && state_->run_front(it->second);
}

void SimulatedDevice::set_random_completion(std::optional<std::uint64_t> seed) {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (seed.has_value()) {
    state_->random.emplace(*seed);
  } else {
    state_->random.reset();
  }
}

int SimulatedDevice::pending_operations() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  int n = 0;
  for (const auto& [id, q] : state_->streams) n += static_cast<int>(q.size());
  return n;
}

int SimulatedDevice::pending_copies() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  int n = 0;
  for (const auto& [id, q] : state_->streams) {
    for (const State::Op& op : q) n += op.kind == State::Op::kCopy ? 1 : 0;
  }
  return n;
}

int SimulatedDevice::live_events() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return static_cast<int>(state_->events.size());
}

int SimulatedDevice::live_streams() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return static_cast<int>(state_->streams.size()) - 1;  // not the legacy default stream
}

}  // namespace strata::rt
