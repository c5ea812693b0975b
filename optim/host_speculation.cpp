// optim/host_speculation.cpp: the host steps an Adam takes during backward, in flight (See Note
// [Host steps in backward] in adam_host_speculation.cpp): their thread and jobs, the undo buffer,
// and waiting for them, taking them back and forgetting them.
#include "optim/host_speculation.h"

#include <algorithm>
#include <chrono>
#include <utility>

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

#include "base/status.h"
#include "base/strings.h"

namespace strata::optim {

HostSpeculation::HostSpeculation(rt::Runtime& runtime, std::atomic<std::int64_t>& waited_ns,
                                 std::atomic<std::int64_t>& kernel_ns)
    : runtime_(runtime), waited_ns_(waited_ns), kernel_ns_(kernel_ns) {}

HostSpeculation::~HostSpeculation() { close(); }

absl::Status HostSpeculation::make_undo(const std::vector<std::size_t>& slot_bytes) {
  std::size_t bytes = 0;
  undo_at_.assign(slot_bytes.size(), 0);
  for (std::size_t i = 0; i < slot_bytes.size(); ++i) {
    undo_at_[i] = bytes;
    bytes += slot_bytes[i];
  }
  absl::StatusOr<void*> undo = runtime_.allocator().allocate(
      rt::Tier::kPageableHost, std::max<std::size_t>(bytes, 1),
      {.owner = "Adam: the states of host steps taken in backward, for a redo"});
  if (undo.status().code() == absl::StatusCode::kResourceExhausted) {
    undo_refused_ = true;
    return absl::OkStatus();
  }
  STRATA_RETURN_IF_ERROR(undo.status());
  undo_ = *undo;
  return absl::OkStatus();
}

void* HostSpeculation::forget_undo() {
  undo_at_.clear();
  undo_refused_ = false;
  return std::exchange(undo_, nullptr);
}

absl::Status HostSpeculation::free_undo(void* undo) {
  if (undo == nullptr) return absl::OkStatus();
  return runtime_.allocator().deallocate(rt::Tier::kPageableHost, undo);
}

HostSpeculation::Speculated& HostSpeculation::add(int layer) {
  Speculated& spec = speculated_.emplace_back();
  spec.layer = layer;
  return spec;
}

void HostSpeculation::drop_unposted() {
  if (speculated_.back().arrived != nullptr) runtime_.device().release(speculated_.back().arrived);
  speculated_.pop_back();
}

void HostSpeculation::post(Speculated& spec, std::function<void()> kernel) {
  ++posted_;
  rt::Device& dev = runtime_.device();
  if (worker_ == nullptr && !dev.is_simulated()) {
    worker_ = std::make_unique<SerialWorker>();
    // The worker's CUDA calls go to the runtime's device: a new thread's current device is device
    // 0, where its first call would make a context (on every rank of a multi-GPU run; See Note
    // [One CUDA device a runtime] in runtime/runtime.h).
    gpu_ = dev.cuda_device();
  }
  const int gpu = gpu_;
  Speculated* out = &spec;
  std::atomic<std::int64_t>* waited_ns = &waited_ns_;
  std::atomic<std::int64_t>* kernel_ns = &kernel_ns_;
  auto job = [&dev, out, kernel = std::move(kernel), gpu, waited_ns, kernel_ns] {
    using Clock = std::chrono::steady_clock;
    auto ns = [](Clock::time_point from) {
      return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - from).count();
    };
#ifdef STRATA_HAS_CUDA
    if (gpu >= 0 && cudaSetDevice(gpu) != cudaSuccess) {
      out->status = absl::InternalError(str_cat("cudaSetDevice(", gpu, ") failed"));
      return;
    }
#else
    (void)gpu;
#endif
    Clock::time_point t = Clock::now();
    out->status = dev.synchronize(out->arrived);
    *waited_ns += ns(t);
    if (!out->status.ok()) return;
    // A step being taken back steps nothing more (See Note [Taking back host steps]).
    if (out->cancelled.load()) return;
    t = Clock::now();
    // The kernel keeps every state before it overwrites it, and cannot fail part way.
    out->kept = true;
    kernel();
    *kernel_ns += ns(t);  // the undo's writes included
  };
  if (dev.is_simulated()) {
    job();
  } else {
    spec.ticket = worker_->post(std::move(job));
  }
}

void HostSpeculation::wait_for_host_steps() const {
  if (worker_ != nullptr) worker_->drain();
}

void HostSpeculation::wait_for_host_step(const Speculated& spec) const {
  if (worker_ != nullptr && spec.ticket != 0) worker_->wait(spec.ticket);
}

void HostSpeculation::take_back(
    absl::FunctionRef<void(std::size_t slot, const char* undo)> put_back) {
  // Note [Taking back host steps]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A host job that has not begun its kernel when the step is taken back would step a layer only
  // for its states to be put back: each is told to step nothing (Speculated::cancelled), so the
  // redo waits only for the kernels already running. A job that stepped nothing kept nothing, and
  // only what was kept is put back; Adam::roll_back gives every slot's step count back alike.
  for (Speculated& spec : speculated_) spec.cancelled.store(true);
  wait_for_host_steps();
  for (const Speculated& spec : speculated_) {
    if (!spec.kept) continue;
    for (std::size_t index : spec.stepped) put_back(index, undo_at(index));
  }
  forget();
}

void HostSpeculation::forget() {
  // Their jobs read the events released below, and write into speculated_.
  wait_for_host_steps();
  for (const Speculated& spec : speculated_) runtime_.device().release(spec.arrived);
  speculated_.clear();
}

void HostSpeculation::close() {
  forget();  // waits for the jobs: those still running write into what is freed below
  (void)free_undo(std::exchange(undo_, nullptr));
}

}  // namespace strata::optim
