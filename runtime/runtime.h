// runtime/runtime.h: the tiering runtime: registry, migration engine, residency guards, staging
// and the hooks a training loop calls, driven by a ResidencyPolicy chosen at startup.
//
// The runtime owns every registered tensor's storage. Migrations are asynchronous: a copy is queued
// on a dedicated H2D or D2H stream (the two directions run at once), completion is tracked by
// events, and the source is released only once the copy's event completed, so until then the tensor
// reads from the source and a failed migration leaves it there bit for bit. acquire() makes a
// compute stream wait for the data (the host does not) and holds the tensor where it is until
// release(). Nothing here waits on the host in steady state; host waits are counted in
// RuntimeStats::host_syncs.
//
// Note [Staging ring]
// ~~~~~~~~~~~~~~~~~~~
// Streamed tensors (layer_prefetch's optimizer states) come to the GPU into a ring of slots, each
// the size of the largest staged layer, from a GPU pool kept apart from the main one, so streaming
// never fragments the pool that serves forward and backward. A slot is refilled by an H2D copy that
// waits, on the GPU, for the D2H copies that emptied it: no host wait, and the GPU never holds more
// than `slots` layers of staged data.
//
// Note [Staging order]
// ~~~~~~~~~~~~~~~~~~~~
// A staged layer's copies are queued in the order stage_layer is asked for, and staged_tensors()
// tells that order, so a consumer can compute each tensor as it arrives and write it back in the
// same order. A step that streams layers from an idle link spends the first tensor's fetch with
// only the H2D direction busy and the last tensor's write-back with only the D2H direction busy; so
// layer_prefetch asks for the first layer of a step smallest first and the last layer largest first
// (smallest last). Tensors of equal size keep their registration order, so the moments of one
// parameter, registered together, arrive together.
//
// Pageable host memory is never streamed directly: copies to and from it go through pinned bounce
// buffers in pieces of kBounceChunkBytes, and those migrations wait on the host (counted). The
// bounce buffers (kBounceSlots of them) and the staging ring come from pools of the runtime's own,
// outside the tiers' budgets: a spill to pageable memory happens when the pinned budget is full.
//
// Thread-safe as one mutex makes it: every public call takes it, hooks for the whole time the
// policy runs (See Note [Hooks hold the runtime's mutex] in hooks.cpp), so calls from several
// threads never interleave inside the runtime. The hooks follow the order of a step
// (See Note [Step states]).
//
// The implementation is split by concern (runtime_impl.h lists the rooms): registry.cpp,
// migration.cpp, staging.cpp, guards.cpp, hooks.cpp and this facade's runtime.cpp.
//
// Example (a training step under any policy):
//   STRATA_ASSIGN_OR_RETURN(auto rt, Runtime::create(std::move(options), builtin_policies()));
//   STRATA_ASSIGN_OR_RETURN(TensorHandle m, rt->register_tensor(spec, host_values));
//   STRATA_RETURN_IF_ERROR(rt->begin_step());
//   for (int l : layers) STRATA_RETURN_IF_ERROR(rt->before_forward(l));   // ...forward...
//   for (int l : reversed) STRATA_RETURN_IF_ERROR(rt->after_backward(l)); // ...backward...
//   STRATA_RETURN_IF_ERROR(rt->begin_optimizer_step());
//   for (int l : rt->optimizer_layer_order()) {
//     STRATA_ASSIGN_OR_RETURN(auto ptrs, rt->acquire_layer(l, kStates, Tier::kGpu, stream));
//     ...enqueue the Adam kernel on stream...
//     STRATA_RETURN_IF_ERROR(rt->release_layer(l, kStates, stream));
//   }
//   STRATA_RETURN_IF_ERROR(rt->end_optimizer_step());
//   STRATA_RETURN_IF_ERROR(rt->end_step());
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/tiered_allocator.h"
#include "runtime/device.h"
#include "runtime/policy.h"
#include "runtime/tensor.h"
#include "runtime/undo_memory.h"

namespace strata::rt {

inline constexpr std::size_t kBounceChunkBytes = std::size_t{16} << 20;
inline constexpr int kBounceSlots = 2;

// Note [One CUDA device a runtime]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A runtime runs on one CUDA device: the one RuntimeOptions::cuda_device names, else the calling
// thread's current device when the runtime is made, which is the one a distributed script chose
// with torch.cuda.set_device(local_rank) (every CUDA thread starts on device 0, so a fixed 0 put
// every rank's strata memory on the first GPU). Its streams, events, device and pinned memory,
// copies and stream waits go to that device whichever is current on the calling thread (a host
// step's worker thread too), through alloc::DeviceGuard, which puts back exactly the context the
// thread had, or none, so that no context is made on a device the process does not use. The
// kernels a client launches on the runtime's streams run where the client launches them, so
// strata.optim asks for the parameters' device and refuses one that is not current, and
// strata.Runtime reads "cuda" as torch's current device.
struct RuntimeOptions {
  // See choose_policy_name: this, else STRATA_POLICY, else the default. `policy_source` names
  // where a program took it from (its flag or argument), for the errors that name the choice.
  std::optional<std::string> policy;
  std::string policy_source = "RuntimeOptions::policy";
  PolicyConfig policy_config;
  DeviceKind device = DeviceKind::kAuto;
  // Which CUDA device, when `device` gives CUDA (See Note [One CUDA device a runtime]).
  int cuda_device = kCurrentCudaDevice;
  // Allocator settings (budgets, tracking, pinned method). Its device backend and CUDA device
  // follow `device` and `cuda_device`.
  alloc::AllocatorOptions allocator;
  // Tests: use this device (e.g. a deferred SimulatedDevice) instead of making one.
  std::unique_ptr<Device> device_override;
  // Tests: wraps the upstreams of the runtime's own pools (the staging ring's GPU memory, the
  // pinned bounce buffers), e.g. in an alloc::FaultInjectingUpstream.
  std::function<std::unique_ptr<alloc::Upstream>(std::unique_ptr<alloc::Upstream>)>
      wrap_internal_upstream;
};

// What offload_all moves, and what it does with the GPU memory it empties.
struct OffloadOptions {
  RoleSet roles = RoleSet::all();
  // Keep the emptied GPU memory in strata's pools, for a faster reload, instead of giving it back
  // to the driver for another engine (a rollout) to use.
  bool keep_cached = false;
};

struct RuntimeStats {
  std::int64_t migrated_bytes_h2d = 0;  // queued host -> GPU
  std::int64_t migrated_bytes_d2h = 0;  // queued GPU -> host
  std::int64_t migrated_bytes_h2h = 0;  // pinned <-> pageable
  std::int64_t num_migrations = 0;      // completed
  std::int64_t failed_migrations = 0;   // refused or failed, tensor left at its source
  // Time the H2D stream spent copying, over completed copies of 1 MiB or more (timing a smaller
  // copy costs as much host time as the copy; See Note [Timed copies] in migration.cpp).
  double h2d_busy_ms = 0;
  double d2h_busy_ms = 0;
  std::int64_t timed_bytes_h2d = 0;  // bytes of the copies behind h2d_busy_ms
  std::int64_t timed_bytes_d2h = 0;
  std::int64_t prefetch_hits = 0;      // acquire found the data already there
  std::int64_t prefetch_waits = 0;     // acquire made the compute stream wait for a copy
  std::int64_t prefetch_stall_ns = 0;  // how long compute streams waited (measured on the GPU)
  std::int64_t host_syncs = 0;         // host waits on the device
  std::int64_t staging_bytes = 0;      // bytes of the staging ring
  std::int64_t staged_peak_bytes = 0;  // most bytes of staged tensors on the GPU at once
  // strata's GPU memory: segments reserved by the GPU tier's pool and the staging ring together,
  // now and at most since the allocator's peaks were last reset; never above gpu_budget().
  std::int64_t gpu_reserved_bytes = 0;
  std::int64_t gpu_reserved_peak_bytes = 0;
  // Time spent taking GPU memory from the driver and giving it back (cudaMalloc and cudaFree, or
  // virtual memory's map and unmap), by the GPU tier and the staging ring together.
  std::int64_t gpu_upstream_alloc_ns = 0;
  std::int64_t gpu_upstream_free_ns = 0;
  // Host bytes kept for an overlapped step's redo, now and at most, and the bytes of them that had
  // to be copied off the GPU (tensors resting there; a staged tensor's old home block is kept
  // instead, with no copy; See Note [Undo log] in undo_log.cpp).
  std::int64_t undo_bytes = 0;
  std::int64_t undo_peak_bytes = 0;
  std::int64_t undo_copied_bytes = 0;
  double h2d_gbps() const { return h2d_busy_ms > 0 ? timed_bytes_h2d / h2d_busy_ms / 1e6 : 0; }
  double d2h_gbps() const { return d2h_busy_ms > 0 ? timed_bytes_d2h / d2h_busy_ms / 1e6 : 0; }
};

// Every RuntimeStats figure by name, in one list for whoever reports them (strata.Runtime.stats()
// is a dict of it): counts and bytes as integers, times in milliseconds ("..._ms"), link rates in
// GB/s ("..._gbps").
using StatValue = std::variant<std::int64_t, double>;
std::vector<std::pair<std::string_view, StatValue>> named_stats(const RuntimeStats& s);

class Runtime {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Runtime>> create(
      RuntimeOptions options, const PolicyRegistry& policies);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // --- registry ---
  // Copies `data` (spec bytes, host or device memory, or null for zeros) into storage the runtime
  // owns, placed by the policy (pinned host memory that has no room gives way to pageable); the
  // copy is complete when this returns, so `data` may be freed. kAlreadyExists for a name taken;
  // kInvalidArgument for a bad spec; kResourceExhausted when the tier has no room.
  [[nodiscard]] absl::StatusOr<TensorHandle> register_tensor(const TensorSpec& spec,
                                                             const void* data = nullptr);
  // Waits for a migration in flight, then frees the storage. kNotFound for an unknown handle,
  // kFailedPrecondition while held.
  [[nodiscard]] absl::Status unregister(TensorHandle tensor);
  [[nodiscard]] absl::StatusOr<TensorInfo> info(TensorHandle tensor) const;
  // Cheaper than info() where only registration matters.
  bool is_registered(TensorHandle tensor) const;
  // Tensors unregistered so far: a client that checked its handles need not check them again
  // until this changes (Adam does so before every step).
  std::uint64_t unregistrations() const;
  [[nodiscard]] absl::StatusOr<TensorHandle> find(std::string_view name) const;
  // Registration order.
  std::vector<TensorHandle> tensors() const;
  std::vector<TensorHandle> layer_tensors(int layer, RoleSet roles) const;
  // Distinct layer indices, ascending.
  std::vector<int> layers() const;
  // Bytes of a layer's tensors of `roles`.
  std::size_t layer_bytes(int layer, RoleSet roles) const;

  // --- data access (waits on the host: for initialization, checkpoints and tests) ---
  [[nodiscard]] absl::Status read(TensorHandle tensor, void* host_dst);
  [[nodiscard]] absl::Status write(TensorHandle tensor, const void* host_src);

  // --- migration engine ---
  // Queues a move of the tensor into `dst`'s main pool; returns at once. A no-op when already
  // there. kFailedPrecondition while held or in flight; kResourceExhausted (tensor unchanged) when
  // `dst` has no room.
  [[nodiscard]] absl::Status migrate(TensorHandle tensor, Tier dst);
  // Completes migrations whose copies finished (frees sources, updates placement). Never waits.
  [[nodiscard]] absl::Status poll();
  // Waits (on the host) until no migration is in flight.
  [[nodiscard]] absl::Status wait_all();

  // --- staging (See Note [Staging ring]) ---
  // Sizes the ring: `slots` slots, each the largest layer's bytes of `roles`. kInvalidArgument when
  // it does not fit the GPU budget.
  [[nodiscard]] absl::Status configure_staging(int slots, RoleSet roles);
  // Queues the layer's tensors of `roles` (default: the staging roles) into its slot: the next free
  // one, or the slot the layer already has (a layer staged for parameters can take its gradients
  // later). The tensors keep their home blocks while staged. kResourceExhausted when no slot is
  // free. `order`: the order of the copies (See Note [Staging order]).
  [[nodiscard]] absl::Status stage_layer(int layer, std::optional<RoleSet> roles = std::nullopt,
                                         StageOrder order = StageOrder::kRegistered);
  // Ends the layer's staging. Tensors with a role in `write_back` (default: all) are copied back
  // into their home blocks; the others are discarded (their home block still holds the data: use it
  // for what compute only read). The slot becomes reusable on the GPU once those copies and the
  // compute that used the slot are done.
  [[nodiscard]] absl::Status unstage_layer(int layer,
                                           std::optional<RoleSet> write_back = std::nullopt);
  bool is_staged(int layer) const;
  // The layer's staged tensors in the order their copies were queued into its slot (arrival
  // order); `out` is cleared first and left empty when the layer is not staged.
  void staged_tensors(int layer, std::vector<TensorHandle>& out) const;

  // --- residency guards ---
  // The tensor's address on `tier` for work on `stream`: the stream waits for any copy bringing it
  // there; a tensor elsewhere is moved first. The tensor does not move until release().
  [[nodiscard]] absl::StatusOr<void*> acquire(TensorHandle tensor, Tier tier, StreamHandle stream);
  // Work queued on `stream` so far may use the tensor; later moves wait for it. A failure (an
  // event that cannot be recorded) leaves the tensor held; call again.
  [[nodiscard]] absl::Status release(TensorHandle tensor, StreamHandle stream);
  // release() for several tensors, all or nothing.
  [[nodiscard]] absl::Status release(const std::vector<TensorHandle>& tensors, StreamHandle stream);
  // acquire / release for every tensor of a layer with a role in `roles`, in layer_tensors order.
  [[nodiscard]] absl::StatusOr<std::vector<void*>> acquire_layer(int layer, RoleSet roles,
                                                                 Tier tier, StreamHandle stream);
  // Releases the layer's tensors, then lets the policy act (write-back, next prefetch). If either
  // fails, the tensors are held as before and the call can be repeated.
  [[nodiscard]] absl::Status release_layer(int layer, RoleSet roles, StreamHandle stream);

  // --- hooks ---
  // Lets the policy lay out, under the GPU budget, what the registered tensors need (a staging
  // ring, layers kept on the GPU, ...; ResidencyPolicy::on_prepare), so that a budget too small
  // is an error at setup, naming what does not fit, never half way through a step. Call it once
  // everything is registered (Adam::create does); otherwise the first step does it. Between steps
  // only (kFailedPrecondition otherwise).
  [[nodiscard]] absl::Status prepare();
  [[nodiscard]] absl::Status begin_step();
  [[nodiscard]] absl::Status end_step();
  [[nodiscard]] absl::Status before_forward(int layer);
  // Once the layer's backward is about to start: the gradient of its output is complete and
  // nothing of the layer's backward has been queued yet. Optional, but a model whose layers'
  // backward passes do not run in the reverse order of their forward (parallel branches, several
  // embeddings feeding one sum) must call it so the policy can hold the layer before autograd
  // touches its tensors (See Note [Backward out of order] in policies/parameter_streaming.cpp).
  [[nodiscard]] absl::Status before_backward(int layer);
  [[nodiscard]] absl::Status after_backward(int layer);
  [[nodiscard]] absl::Status begin_optimizer_step();
  [[nodiscard]] absl::Status end_optimizer_step();
  // Phase switches, under every policy (See Note [Phase switches] in phase.cpp): offload_all moves
  // every registered tensor of `options.roles` that is on the GPU to host memory (pinned while it
  // has room, pageable after) and gives the GPU memory it empties (the GPU tier's segments and the
  // staging ring) back to the driver as the copies land, unless options.keep_cached; reload_all
  // takes GPU memory for all of it first (when that does not fit it moves nothing and fails with
  // kResourceExhausted), then brings back what offload_all moved and lets the policy resume where
  // it was. Until
  // then a step cannot begin (kFailedPrecondition); tensors can still be read. A tensor held by an
  // acquire cannot move: offload_all fails naming it, having moved nothing of it.
  [[nodiscard]] absl::Status offload_all(OffloadOptions options = {});
  [[nodiscard]] absl::Status reload_all();
  // Whether the runtime is between offload_all and reload_all.
  bool offloaded() const;

  // --- undo log (See Note [Undo log] in undo_log.cpp): what an optimizer step taken during
  // backward, before it is known to be valid, keeps so that it can be redone exactly --- Keeps the
  // tensor's bytes as they are before the work queued on `stream` after this call writes it. The
  // tensor must be held on the GPU (acquire). A staged tensor costs no copy: its write-back goes to
  // a fresh block of its home tier and the old home block is kept; a tensor resting on the GPU is
  // copied to pinned host memory on the D2H stream, and `stream` waits for that copy. A tensor kept
  // already is left as it is. kResourceExhausted when the host has no room for it, or when
  // `over_link` is false and a tensor resting on the GPU cannot be kept on the GPU (nothing kept,
  // nothing changed); kFailedPrecondition when it is not held on the GPU.
  [[nodiscard]] absl::Status keep_for_undo(TensorHandle tensor, StreamHandle stream,
                                           bool over_link = true);
  // The step stands: the kept bytes are dropped, freed behind the copy streams (no host wait).
  [[nodiscard]] absl::Status commit_undo();
  // Puts back every kept tensor's bytes wherever the tensor is now and frees what was kept, then
  // lets the policy know (ResidencyPolicy::on_undo_rolled_back); a tensor still staged gets them in
  // its slot and its home block. Waits on the host for every stream. kFailedPrecondition while a
  // kept tensor is held. A failure part way keeps what is not yet put back; call again.
  [[nodiscard]] absl::Status rollback_undo();
  // Tensors kept now.
  std::size_t undo_tensors() const;
  // Where the undo of a tensor resting on the GPU goes from the next keep_for_undo on: the GPU
  // (while its tier has room under the budget) or pinned host memory. It starts as
  // PolicyConfig::undo_on_gpu; strata.optim turns it on once it has measured the room
  // (See Note [The undo on the GPU when there is room] in python/strata/budget.py). Between steps,
  // with nothing kept: kFailedPrecondition otherwise.
  [[nodiscard]] absl::Status set_undo_on_gpu(bool on);
  bool undo_on_gpu() const;
  // Where copies kept on the GPU for an undo come from: `memory`, or strata's GPU pool when null
  // (See Note [The undo in the framework's memory] in undo_log.cpp); their bytes count in the GPU
  // budget either way. The bridge sets torch's caching allocator. Between steps, with nothing
  // kept: kFailedPrecondition otherwise.
  [[nodiscard]] absl::Status set_undo_memory(std::shared_ptr<UndoMemory> memory);
  std::vector<int> optimizer_layer_order() const;
  // See Note [Step placement] in policy.h. Whether the policy places steps; handing it the
  // optimizer's costs (before the optimizer registers its states: kFailedPrecondition once any
  // optimizer state is registered) returns the line that says what it decided; where `layer`
  // steps.
  bool places_steps() const;
  [[nodiscard]] absl::StatusOr<std::string> place_steps(const StepCosts& costs);
  StepPlace step_place(int layer) const;
  // See Note [Measured split] in policies/split_search.h. Whether the policy wants step times;
  // handing it one step's times (between steps: kFailedPrecondition during an optimizer step,
  // while anything is kept for undo, or while offloaded) returns its line when it ended its
  // search, else empty.
  bool wants_step_times() const;
  [[nodiscard]] absl::StatusOr<std::string> step_measured(const StepTimes& times);
  // The optimizer could not measure a step or follow what step_measured moved: the policy stops
  // measuring and moves back what the last step_measured moved.
  [[nodiscard]] absl::Status refuse_step_move();

  // Calls fn(tensor, tier, address) on the host whenever the address that compute should use for a
  // tensor changes: when a migration completes, and when a staged tensor's copy is chained on the
  // GPU (its data may still be arriving then; staged tensors are used between acquire and release
  // only; an address on a host tier may likewise still be receiving a copy from the GPU, so read
  // it on the host after wait_all() or through read()). fn runs with the runtime's lock held and
  // must not call the runtime. Returns an id for remove_on_moved.
  int add_on_moved(std::function<void(TensorHandle, Tier, void*)> fn);
  void remove_on_moved(int id);
  // Calls fn() at the start of every optimizer step (begin_optimizer_step), before the policy
  // stages anything; an error fails the step before anything changed. fn runs with the runtime's
  // lock held and must not call the runtime. The bridge checks there that a model's gradients
  // are still the ones strata holds. Returns an id for remove_before_optimizer_step.
  int add_before_optimizer_step(std::function<absl::Status()> fn);
  void remove_before_optimizer_step(int id);

  // The stream the training loop computes on (default: compute_stream()). Every hook makes the
  // copy streams wait for the work queued on it so far, so data a kernel still uses is never moved
  // under it. nullptr is the legacy default stream. The bridge passes torch's current stream.
  void set_compute_stream(StreamHandle stream);

  RuntimeStats stats() const;
  // The GPU memory strata may reserve, the GPU tier's pool and the staging ring together (they draw
  // on one alloc::Budget); alloc::kNoBudget for none.
  std::size_t gpu_budget() const;
  // Sets the GPU budget (alloc::kNoBudget: none) between steps, with nothing kept for a redo and
  // nothing offloaded; a budget below what strata holds on the GPU now is refused. The policy lays
  // out again what it keeps on the GPU (layer_prefetch: its ring and resident layers,
  // See Note [Resident layers]); if that fails the old budget is back. strata.optim's
  // gpu_budget="auto" sets it once the first step measured torch's peak.
  //   STRATA_RETURN_IF_ERROR(rt.set_gpu_budget(24 * kGiB));
  [[nodiscard]] absl::Status set_gpu_budget(std::size_t budget);
  alloc::TieredAllocator& allocator();
  Device& device();
  // The CUDA device the runtime runs on; -1 on the simulated device.
  int cuda_device() const;
  const ResidencyPolicy& policy() const;
  // Where the policy name came from (see choose_policy_name).
  const PolicyChoice& policy_choice() const;
  // The compute stream: the one set_compute_stream gave, else one the runtime made.
  StreamHandle compute_stream() const;
  // The dedicated copy streams, for instrumentation and tests (e.g. delaying copies on purpose).
  StreamHandle h2d_stream() const;
  StreamHandle d2h_stream() const;

 private:
  friend class PolicyContext;
  struct Impl;
  explicit Runtime(std::unique_ptr<Impl> impl);
  enum class LayerHook { kBeforeForward, kBeforeBackward, kAfterBackward };
  // before_forward, before_backward and after_backward (hooks.cpp).
  absl::Status layer_hook(LayerHook hook, int layer);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::rt
