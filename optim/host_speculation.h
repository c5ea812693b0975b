// optim/host_speculation.h: HostSpeculation, what an Adam holds of the host steps it takes during
// backward, speculatively (See Note [Host steps in backward] in adam_host_speculation.cpp): the
// thread their jobs run on, each layer's job and what it left, and the undo buffer the states they
// overwrite are kept in; and waiting for the jobs, taking them back and forgetting them. Adam
// decides which layers step and with which kernel, and counts their steps. Internal to Adam:
// installed because adam.h includes it, not an interface of its own.
//
//   HostSpeculation host(runtime, waited_ns, kernel_ns);
//   if (!host.has_undo()) STRATA_RETURN_IF_ERROR(host.make_undo(slot_bytes));
//   if (host.undo_refused()) return absl::OkStatus();  // no host memory for it: not stepped now
//   HostSpeculation::Speculated& spec = host.add(layer);
//   spec.arrived = arrived;  // the event its gradients arrive by
//   spec.stepped = slots;    // the kernel keeps their states at host.undo_at(slot)
//   host.post(spec, [=] { rule->step_host(...); });  // returns at once
//   ...
//   // Held: each job waited for in turn (spec.status says how it went), then all forgotten.
//   for (HostSpeculation::Speculated& s : host.speculated()) host.wait_for_host_step(s);
//   host.forget();
//   // Or taken back: what the jobs kept put back, then all forgotten.
//   host.take_back([&](std::size_t slot, const char* undo) { /* copy undo back */ });
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "base/serial_worker.h"
#include "runtime/runtime.h"

namespace strata::optim {

class HostSpeculation {
 public:
  // A host layer posted in backward.
  struct Speculated {
    int layer = -1;
    rt::EventHandle arrived = nullptr;  // its gradients are in the pinned buffers
    std::vector<std::size_t> stepped;   // its slots that took the step
    SerialWorker::Ticket ticket = 0;    // its job on the host thread (0: ran in step_layer)
    // Written by the host step, read once its job ran (wait_for_host_step).
    bool kept = false;  // its states are in the undo buffer
    absl::Status status;
    std::atomic<bool> cancelled{false};  // taken back: a job not begun steps nothing
    bool counted_back = false;           // its job failed: its step counts were given back
  };

  // The jobs add the nanoseconds they wait for gradients to `waited_ns`, and those of their kernel
  // to `kernel_ns` (Adam's host_step_seconds), both alive as long as this.
  HostSpeculation(rt::Runtime& runtime, std::atomic<std::int64_t>& waited_ns,
                  std::atomic<std::int64_t>& kernel_ns);
  // close().
  ~HostSpeculation();
  HostSpeculation(const HostSpeculation&) = delete;
  HostSpeculation& operator=(const HostSpeculation&) = delete;

  // The pageable copy of every host slot's states a redo puts back, made at the first step in
  // backward: `slot_bytes[i]` bytes at undo_at(i) for slot i (0 for a slot not stepped on the
  // host). Where the pageable tier has no room for it, none is made and it returns OK:
  // undo_refused() then holds until forget_undo.
  [[nodiscard]] absl::Status make_undo(const std::vector<std::size_t>& slot_bytes);
  bool has_undo() const { return undo_ != nullptr; }
  bool undo_refused() const { return undo_refused_; }
  char* undo_at(std::size_t slot) const { return static_cast<char*>(undo_) + undo_at_[slot]; }
  // The undo buffer forgotten, to be made again at the next step in backward (sized for the host
  // slots then), and returned (null: none) for free_undo once no host step uses it.
  [[nodiscard]] void* forget_undo();
  [[nodiscard]] absl::Status free_undo(void* undo);

  // This step's host layers posted in backward, in order; stable addresses: a job writes into its
  // own.
  std::deque<Speculated>& speculated() { return speculated_; }
  // A layer added, to be posted; drop_unposted forgets the last one added, not posted (its
  // `arrived` released).
  Speculated& add(int layer);
  void drop_unposted();
  // Posts `spec`'s job to the host thread (made at the first, its CUDA calls going to the
  // runtime's device; on the simulated device the job runs here, now): once its gradients have
  // arrived, unless cancelled, it marks its states kept and runs `kernel`, which keeps every state
  // before it overwrites it and cannot fail part way. A job fails only before its kernel
  // (spec.status).
  void post(Speculated& spec, std::function<void()> kernel);
  // Host layers posted in backward so far, over the run.
  std::int64_t posted() const { return posted_; }

  // Returns once every job posted has run (what touches their states waits).
  void wait_for_host_steps() const;
  void wait_for_host_step(const Speculated& spec) const;  // once its job ran
  // See Note [Taking back host steps] in host_speculation.cpp: the jobs not begun step nothing,
  // those running are waited for, and `put_back(slot, undo)` puts back, from `undo`, the states a
  // job kept of each of its slots; then forget().
  void take_back(absl::FunctionRef<void(std::size_t slot, const char* undo)> put_back);
  // Waits for the jobs posted, then forgets them (their `arrived` released).
  void forget();
  // Waits for the jobs posted, forgets them, and frees the undo buffer: called before what the
  // jobs use is freed.
  void close();

 private:
  rt::Runtime& runtime_;
  std::atomic<std::int64_t>& waited_ns_;
  std::atomic<std::int64_t>& kernel_ns_;
  std::int64_t posted_ = 0;
  // The thread host steps in backward run on (a CUDA device only), the pageable copy of every host
  // slot's states a redo puts back (at undo_at_[slot]; refused once: no host memory for it), and
  // this step's host layers stepped in backward.
  std::unique_ptr<SerialWorker> worker_;
  int gpu_ = -1;  // the device worker_ makes current (-1: simulated)
  void* undo_ = nullptr;
  std::vector<std::size_t> undo_at_;
  bool undo_refused_ = false;
  std::deque<Speculated> speculated_;  // stable addresses: the worker writes into them
};

}  // namespace strata::optim
