#include "optim/step_rates.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "allocator/cuda_status.h"
#include "base/status.h"
#include "base/strings.h"
#include "optim/adam_kernels.h"

namespace strata::optim {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Memory from the runtime's allocator, given back when it goes.
class Buffer {
 public:
  Buffer(rt::Runtime& runtime, rt::Tier tier) : runtime_(runtime), tier_(tier) {}
  ~Buffer() {
    if (ptr_ != nullptr) (void)runtime_.allocator().deallocate(tier_, ptr_);
  }
  absl::Status allocate(std::size_t bytes) {
    STRATA_ASSIGN_OR_RETURN(
        ptr_, runtime_.allocator().allocate(tier_, bytes, {.owner = "measure_step_rates"}));
    return absl::OkStatus();
  }
  void* get() const { return ptr_; }
  float* floats(std::size_t offset) const { return static_cast<float*>(ptr_) + offset; }

 private:
  rt::Runtime& runtime_;
  rt::Tier tier_;
  void* ptr_ = nullptr;
};

// Two streams of the device, destroyed when it goes.
class Streams {
 public:
  explicit Streams(rt::Device& device) : device_(device) {}
  ~Streams() {
    for (rt::StreamHandle s : streams_) device_.destroy_stream(s);
  }
  absl::Status create(int n) {
    for (int i = 0; i < n; ++i) {
      STRATA_ASSIGN_OR_RETURN(rt::StreamHandle s, device_.create_stream());
      streams_.push_back(s);
    }
    return absl::OkStatus();
  }
  rt::StreamHandle operator[](int i) const { return streams_[i]; }

 private:
  rt::Device& device_;
  std::vector<rt::StreamHandle> streams_;
};

// Milliseconds from `start` to `end`, both timed events; releases them.
absl::StatusOr<double> elapsed(rt::Device& device, rt::EventHandle start, rt::EventHandle end) {
  absl::Status wait = device.synchronize(end);
  absl::StatusOr<double> ms =
      wait.ok() ? device.elapsed_ms(start, end) : absl::StatusOr<double>(wait);
  device.release_timed(start);
  device.release_timed(end);
  return ms;
}

// Seconds of one direction's copy alone: the best of `repeats`.
absl::StatusOr<double> time_copy(rt::Device& device, void* dst, const void* src, std::size_t bytes,
                                 int repeats, rt::StreamHandle stream) {
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    STRATA_ASSIGN_OR_RETURN(rt::EventHandle start, device.record_timed(stream));
    STRATA_RETURN_IF_ERROR(device.copy_async(dst, src, bytes, stream));
    STRATA_ASSIGN_OR_RETURN(rt::EventHandle end, device.record_timed(stream));
    STRATA_ASSIGN_OR_RETURN(double ms, elapsed(device, start, end));
    if (r == 0 || ms < best) best = ms;
  }
  return best / 1e3;
}

// Seconds until both directions' copies are done, started together: the best of `repeats`.
absl::StatusOr<double> time_both(rt::Device& device, void* gpu_in, const void* host_out,
                                 void* host_in, const void* gpu_out, std::size_t bytes, int repeats,
                                 const Streams& s) {
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    STRATA_ASSIGN_OR_RETURN(rt::EventHandle start, device.record_timed(s[0]));
    STRATA_ASSIGN_OR_RETURN(rt::EventHandle go, device.record(s[0]));
    STRATA_RETURN_IF_ERROR(device.stream_wait(s[1], go));
    device.release(go);
    STRATA_RETURN_IF_ERROR(device.copy_async(gpu_in, host_out, bytes, s[0]));
    STRATA_RETURN_IF_ERROR(device.copy_async(host_in, gpu_out, bytes, s[1]));
    STRATA_ASSIGN_OR_RETURN(rt::EventHandle joined, device.record(s[1]));
    STRATA_RETURN_IF_ERROR(device.stream_wait(s[0], joined));
    device.release(joined);
    STRATA_ASSIGN_OR_RETURN(rt::EventHandle end, device.record_timed(s[0]));
    STRATA_ASSIGN_OR_RETURN(double ms, elapsed(device, start, end));
    if (r == 0 || ms < best) best = ms;
  }
  return best / 1e3;
}

// A rule's view of n float32 parameters at `base` (parameter, gradient, two states in turn, n
// floats each: room for the states however they are stored; a rule with one uses the first).
StepTensor step_tensor(float* base, std::int64_t n, StateType moments) {
  StepTensor t;
  t.param = base;
  t.grad = base + n;
  t.states[0] = base + 2 * n;
  t.states[1] = base + 3 * n;
  t.numel = n;
  t.state_type = moments;
  return t;
}

constexpr AdamHyper kTimedHyper{.weight_decay = 0.01};

void host_step(const StepRule& rule, float* base, std::int64_t n, StateType moments,
               ThreadPool& pool) {
  const StepTensor t = step_tensor(base, n, moments);
  rule.step_host(&t, 1, kTimedHyper, 1.0f, &pool);
}

double best_of(int repeats, const std::function<void()>& run) {
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    const Clock::time_point start = Clock::now();
    run();
    const double s = seconds_since(start);
    if (r == 0 || s < best) best = s;
  }
  return best;
}

// One run of the host kernel beside copies both ways: its seconds, and each direction's bytes
// finished while it ran with the seconds they took.
struct Loaded {
  double kernel_s = 0;
  double h2d_bytes = 0, h2d_s = 0;
  double d2h_bytes = 0, d2h_s = 0;
};

// How many of `done` (a stream's events, in its order) have happened.
absl::StatusOr<int> events_done(rt::Device& device, const std::vector<rt::EventHandle>& done) {
  int k = 0;
  for (rt::EventHandle e : done) {
    STRATA_ASSIGN_OR_RETURN(bool happened, device.query(e));
    if (!happened) break;
    ++k;
  }
  return k;
}

// `copies` copies of `chunk` bytes each way (pinned h to GPU g, and GPU g + chunk to pinned
// h + chunk, the same bytes each time) with an event after each, and `passes` of the host kernel
// over n parameters at `base` on the pool meanwhile.
absl::StatusOr<Loaded> host_step_beside_copies(rt::Device& device, const StepRule& rule,
                                               float* base, std::int64_t n, StateType moments,
                                               ThreadPool& pool, int passes, char* g, char* h,
                                               std::size_t chunk, int copies, const Streams& s) {
  std::vector<rt::EventHandle> h2d, d2h;
  // On every return the copies are done (the buffers they use go when measure returns) and the
  // events released.
  struct Release {
    rt::Device& device;
    const Streams& streams;
    std::vector<rt::EventHandle>& a;
    std::vector<rt::EventHandle>& b;
    ~Release() {
      (void)device.stream_synchronize(streams[0]);
      (void)device.stream_synchronize(streams[1]);
      for (auto* list : {&a, &b}) {
        for (rt::EventHandle e : *list) device.release(e);
      }
    }
  } release{device, s, h2d, d2h};
  const Clock::time_point queued = Clock::now();
  for (int i = 0; i < copies; ++i) {
    STRATA_RETURN_IF_ERROR(device.copy_async(g, h, chunk, s[0]));
    STRATA_ASSIGN_OR_RETURN(rt::EventHandle in, device.record(s[0]));
    h2d.push_back(in);
    STRATA_RETURN_IF_ERROR(device.copy_async(h + chunk, g + chunk, chunk, s[1]));
    STRATA_ASSIGN_OR_RETURN(rt::EventHandle out, device.record(s[1]));
    d2h.push_back(out);
  }
  // Pieces done while the copies were queued ran beside no kernel: they are counted out.
  STRATA_ASSIGN_OR_RETURN(const int h2d_before, events_done(device, h2d));
  STRATA_ASSIGN_OR_RETURN(const int d2h_before, events_done(device, d2h));
  Loaded run;
  const Clock::time_point start = Clock::now();
  for (int p = 0; p < passes; ++p) host_step(rule, base, n, moments, pool);
  run.kernel_s = seconds_since(start);
  // A direction with no piece done while the kernel ran (a kernel shorter than a piece) is timed
  // to its next piece; one with every piece done before the kernel began, over all of them.
  auto bytes_and_seconds = [&](const std::vector<rt::EventHandle>& done, int before, double& bytes,
                               double& secs) -> absl::Status {
    STRATA_ASSIGN_OR_RETURN(int k, events_done(device, done));
    secs = run.kernel_s;
    if (before == static_cast<int>(done.size())) {
      before = 0;
      secs = seconds_since(queued);
    } else if (k == before) {
      STRATA_RETURN_IF_ERROR(device.synchronize(done[before]));
      secs = seconds_since(start);
      k = before + 1;
    }
    bytes = static_cast<double>(k - before) * static_cast<double>(chunk);
    return absl::OkStatus();
  };
  STRATA_RETURN_IF_ERROR(bytes_and_seconds(h2d, h2d_before, run.h2d_bytes, run.h2d_s));
  STRATA_RETURN_IF_ERROR(bytes_and_seconds(d2h, d2h_before, run.d2h_bytes, run.d2h_s));
  STRATA_RETURN_IF_ERROR(device.stream_synchronize(s[0]));
  STRATA_RETURN_IF_ERROR(device.stream_synchronize(s[1]));
  return run;
}

// measure_step_rates with its buffers; they go back to the allocator when it returns.
absl::StatusOr<rt::StepRates> measure(rt::Runtime& runtime, ThreadPool& pool,
                                      const MeasureOptions& options) {
  if (options.link_bytes == 0 || options.adam_params <= 0 || options.memory_bytes == 0 ||
      options.repeats <= 0 || !(options.loaded_seconds >= 0) ||
      !std::isfinite(options.loaded_seconds)) {
    return absl::InvalidArgumentError(
        "measure_step_rates: every size and repeat must be positive, loaded_seconds 0 or more");
  }
  rt::Device& device = runtime.device();
  const StepRule& rule = options.rule != nullptr ? *options.rule : *adam_rule();
  rt::StepRates rates;
  rates.host_threads = pool.size();
  const std::size_t bytes = options.link_bytes;
  const int repeats = options.repeats + 1;  // the first run faults pages in
  Buffer gpu(runtime, rt::Tier::kGpu), pinned(runtime, rt::Tier::kPinnedHost);
  STRATA_RETURN_IF_ERROR(gpu.allocate(2 * bytes));
  STRATA_RETURN_IF_ERROR(pinned.allocate(2 * bytes));
  std::memset(pinned.get(), 1, 2 * bytes);
  char* g = static_cast<char*>(gpu.get());
  char* h = static_cast<char*>(pinned.get());
  Streams streams(device);
  STRATA_RETURN_IF_ERROR(streams.create(2));

  // See Note [Measuring the step's rates].
  STRATA_ASSIGN_OR_RETURN(double h2d, time_copy(device, g, h, bytes, repeats, streams[0]));
  STRATA_ASSIGN_OR_RETURN(double d2h,
                          time_copy(device, h + bytes, g + bytes, bytes, repeats, streams[1]));
  STRATA_ASSIGN_OR_RETURN(double both,
                          time_both(device, g, h, h + bytes, g + bytes, bytes, repeats, streams));
  rates.link_h2d_gbps = static_cast<double>(bytes) / h2d / 1e9;
  rates.link_d2h_gbps = static_cast<double>(bytes) / d2h / 1e9;
  rates.link_both_gbps = static_cast<double>(bytes) / both / 1e9;

  // Host memory: a copy between two pageable buffers split over the pool.
  {
    const std::size_t n = options.memory_bytes;
    std::vector<char> src(n, 1), dst(n, 0);
    const int parts = pool.size() * 4;
    const std::size_t per = (n + parts - 1) / parts;
    const double s = best_of(repeats, [&] {
      pool.parallel_for(parts, [&](int part) {
        const std::size_t begin = std::min(n, per * part);
        const std::size_t end = std::min(n, begin + per);
        std::memcpy(dst.data() + begin, src.data() + begin, end - begin);
      });
    });
    rates.host_memory_gbps = 2.0 * static_cast<double>(n) / s / 1e9;
  }

  // The host kernel, alone and then while copies run both ways for longer than it does; over
  // fewer parameters (down to 2^20) where the pinned tier has no room for adam_params.
  std::int64_t n = options.adam_params;
  Buffer adam(runtime, rt::Tier::kPinnedHost);
  for (;;) {
    absl::Status got = adam.allocate(4 * static_cast<std::size_t>(n) * sizeof(float));
    if (got.ok()) break;
    if (got.code() != absl::StatusCode::kResourceExhausted || n / 2 < (std::int64_t{1} << 20)) {
      return got;
    }
    n /= 2;
  }
  std::fill(adam.floats(0), adam.floats(4 * n), 0.5f);
  const double alone =
      best_of(repeats, [&] { host_step(rule, adam.floats(0), n, options.moments, pool); });
  rates.host_params_per_s_alone = static_cast<double>(n) / alone;
  // See Note [Measuring the step's rates]: the kernel's passes last loaded_seconds, the copies
  // come in quarters of a link copy, enough each way to outlast the kernel twice over at the rate
  // both directions get, and those done by the time the kernel is are the link's bytes meanwhile.
  const int passes =
      static_cast<int>(std::clamp(std::ceil(options.loaded_seconds / alone), 1.0, 64.0));
  const std::size_t chunk = std::max<std::size_t>(bytes / 4, 1);
  const double chunk_s = both * static_cast<double>(chunk) / static_cast<double>(bytes);
  const int copies =
      static_cast<int>(std::clamp(2.0 * passes * alone / chunk_s + 2.0, 2.0, 4096.0));
  Loaded best;
  for (int r = 0; r < repeats; ++r) {
    STRATA_ASSIGN_OR_RETURN(
        Loaded run, host_step_beside_copies(device, rule, adam.floats(0), n, options.moments, pool,
                                            passes, g, h, chunk, copies, streams));
    if (r == 0 || run.kernel_s < best.kernel_s) best = run;
  }
  rates.host_params_per_s = static_cast<double>(n) * passes / best.kernel_s;
  rates.link_h2d_loaded_gbps = best.h2d_bytes / best.h2d_s / 1e9;
  rates.link_d2h_loaded_gbps = best.d2h_bytes / best.d2h_s / 1e9;

#ifdef STRATA_HAS_CUDA
  if (!device.is_simulated()) {
    // 2^24 parameters (a layer of a 4096 x 4096 weight) or the host's run if smaller: fewer
    // leave much of the GPU idle and understate its rate, more take GPU memory for nothing.
    const std::int64_t gn = std::min<std::int64_t>(n, std::int64_t{1} << 24);
    const std::size_t gpu_bytes = 4 * static_cast<std::size_t>(gn) * sizeof(float);
    Buffer on_gpu(runtime, rt::Tier::kGpu);
    STRATA_RETURN_IF_ERROR(on_gpu.allocate(gpu_bytes));
    STRATA_RETURN_IF_ERROR(device.copy_async(on_gpu.get(), adam.get(), gpu_bytes, streams[0]));
    const StepTensor t = step_tensor(on_gpu.floats(0), gn, options.moments);
    double best = 0;
    for (int r = 0; r < repeats; ++r) {
      STRATA_ASSIGN_OR_RETURN(rt::EventHandle start, device.record_timed(streams[0]));
      const cudaError_t err = rule.step_gpu(&t, 1, kTimedHyper, nullptr, nullptr,
                                            static_cast<cudaStream_t>(streams[0]));
      if (err != cudaSuccess) {
        device.release_timed(start);
        return alloc::cuda_status(err,
                                  str_cat("measure_step_rates: the GPU ", rule.name(), " kernel"));
      }
      STRATA_ASSIGN_OR_RETURN(rt::EventHandle end, device.record_timed(streams[0]));
      STRATA_ASSIGN_OR_RETURN(double ms, elapsed(device, start, end));
      if (r == 0 || ms < best) best = ms;
    }
    rates.gpu_params_per_s = static_cast<double>(gn) / (best / 1e3);
  }
#endif
  return rates;
}

}  // namespace

absl::StatusOr<rt::StepRates> measure_step_rates(rt::Runtime& runtime, ThreadPool& pool,
                                                 const MeasureOptions& options) {
  absl::StatusOr<rt::StepRates> rates = measure(runtime, pool, options);
  // The buffers' segments go back to the driver: they would otherwise stay in strata's pools, on
  // the GPU and pinned, for the whole run.
  for (rt::Tier tier : {rt::Tier::kGpu, rt::Tier::kPinnedHost}) {
    absl::StatusOr<std::size_t> trimmed = runtime.allocator().trim(tier);
    if (rates.ok() && !trimmed.ok()) return trimmed.status();
  }
  return rates;
}

}  // namespace strata::optim
