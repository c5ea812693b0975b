// optim/adam.h: the layer-by-layer optimizer, a client of the runtime; what it applies to each
// layer is its step rule's (See Note [Step rules] in step_rule.h): Adam / AdamW by default, or
// Lion. (It keeps the name Adam, its first and default rule.)
//
// It registers the states the rule declares for each parameter (Adam's: exp_avg and exp_avg_sq,
// max_exp_avg_sq with amsgrad, and for a bfloat16 or float16 parameter its float32 master copy
// master_param, initialized from the parameter) with the runtime as optimizer states (See Note
// [Declared states] in state_decl.h), so the policy decides where they live (See Note [Mixed
// precision] in adam_math.h). step() walks
// the layers in the policy's order, acquires each layer's tensors on the GPU for the compute
// stream, queues the fused kernel there (the CPU kernel, as a host function, on the simulated
// device) and releases them, which lets the policy write the layer back and prefetch the next one.
// Hyperparameters are per parameter group and the learning rate may change between steps; step
// counters are int64 on the host.
//
// Note [Overlapped step]
// ~~~~~~~~~~~~~~~~~~~~~~
// With overlap, the step is taken layer by layer during backward, each layer as soon as its
// gradients are final (step_layer), while its parameters and gradients are still on the GPU and the
// policy streams its states around backward's compute; finish_step then validates it. Clipping and
// loss scaling's inf check depend on every gradient, which backward has not all produced when the
// first layer steps, so the layers are stepped speculatively: dividing by the loss scale alone, as
// if clipping did not trigger and no gradient were inf or NaN, with the bytes they overwrite kept
// (Runtime::keep_for_undo; See Note [Undo log] in runtime/undo_log.cpp). finish_step reads the true
// grad_scale and found_inf (one host wait of a few bytes) and compares:
//   - equal, bit for bit, and no inf: the speculation was the step; what was kept is dropped, and
//     any layer backward could not step (not on the GPU then, no host memory for its undo, or
//     resting wholly on the GPU with no room there for its undo: See Note [Resting layers] in
//     adam_overlap.cpp) is stepped now, as step() would;
//   - otherwise (clipping triggered, or inf found): every kept byte goes back (a host wait for
//     every stream, and a copy back for what was copied off the GPU), and step() runs with the true
//     values. That costs one sequential step more, on the steps where it happens: rarely in a
//     long pretraining run, far more often in a short fine-tune with a tight threshold (for when
//     strata stops trying, See Note [When to step in backward] in strata/_when.py).
// Either way the result is bitwise the sequential step's: each element's update depends only on
// its own values and the step's scalars, never on the order in which layers step. What is kept:
// the parameters and every state the kernel writes (14 bytes a bfloat16 parameter with its float32
// master copy and moments), in host memory, from each layer's step until finish_step; gradients are
// only read, and stay where the policy put them (home, for a streamed gradient) until the next
// step zeroes them.
//
// Example:
//   AdamOptions options;
//   options.groups.push_back({.params = {{w0, w0_grad}, {w1, w1_grad}},
//                             .hyper = {.lr = 1e-3, .weight_decay = 0.01}});
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Adam> adam, Adam::create(runtime, options));
//   ...backward...
//   STRATA_RETURN_IF_ERROR(adam->step());
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <istream>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/thread_pool.h"
#include "optim/adam_math.h"
#include "optim/adam_slot.h"
#include "optim/host_speculation.h"
#include "optim/state_decl.h"
#include "optim/step_rule.h"
#include "runtime/runtime.h"

namespace strata::optim {

struct ParamGroup {
  // (parameter, its gradient), both registered with the runtime: float32, bfloat16 or float16
  // (the gradient in the parameter's dtype or float32), same shape and layer.
  std::vector<std::pair<rt::TensorHandle, rt::TensorHandle>> params;
  AdamHyper hyper;
};

struct AdamOptions {
  std::vector<ParamGroup> groups;
  // Note [Gradients given at each step]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // With this on, a parameter listed with an invalid gradient handle takes its gradient from
  // set_gradient at each step (memory the caller owns) instead of a registered tensor. Gradients
  // that no policy moves need not live in strata's pool: torch frees them at zero_grad() and makes
  // the next ones during backward in memory the activations leave, while a gradient bound in
  // strata's pool holds its bytes for the whole run and cannot share them
  // (bench/results/2026-11-25-H100-users-script traces what that costs). The kernel then reads the
  // gradient where autograd put it. Off: every parameter needs a registered gradient.
  bool gradients_given = false;
  // Host threads of the CPU kernel (the simulated device's, and a host-stepped layer's: See Note
  // [Host-stepped layers] in adam_host_step.cpp), started once (See Note [Persistent host threads]
  // in base/thread_pool.h); 0: as many as the machine has.
  int cpu_threads = 0;
  // How exp_avg and exp_avg_sq are stored, on every tier and on the link (See Note [Compressed
  // moments] in state_codec.h); compressed moments do not take amsgrad.
  StateType state_dtype = StateType::kF32;
  // The update each layer's step applies: its states and kernels (See Note [Step rules] in
  // step_rule.h). Null: Adam / AdamW (adam_rule()).
  std::shared_ptr<const StepRule> rule;
  // Under a policy that places steps: the rates its placement is made from, instead of measuring
  // them at create (See Note [Measuring the step's rates] in step_rates.h), e.g. a machine's
  // measured once, so that runs place alike.
  std::optional<rt::StepRates> step_rates;
};

class Adam {
 public:
  // Checks every parameter and gradient before registering any state: kInvalidArgument for a
  // dtype other than float32, bfloat16 or float16 (or a gradient in another low-precision dtype
  // than its parameter's), a shape or layer mismatch, a tensor of the wrong role, a parameter
  // listed twice, hyperparameters torch would refuse (lr or weight_decay negative or not finite, a
  // beta outside [0, 1), eps not positive; NaN anywhere); kNotFound for an unregistered handle;
  // kResourceExhausted for a layer whose parameters, gradients and moments together exceed the
  // GPU budget (the kernel reads GPU memory only, so such a layer could never be stepped). Then
  // registers the states, all or nothing: if one cannot be registered (a name taken, no room),
  // those registered before it are unregistered again. Finally the runtime's policy lays the
  // states out under the GPU budget (Runtime::prepare), so a budget too small is an error here
  // (kResourceExhausted naming what does not fit), not at the first step. The Adam unregisters them
  // when it is destroyed, so the runtime must outlive it (See Note [Adam owns its states] in
  // adam_create.cpp).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Adam>> create(rt::Runtime& runtime,
                                                                    AdamOptions options);
  // Unregisters the states this optimizer registered (the runtime must outlive it).
  ~Adam();

  // One optimizer step over every group. grad_scale / found_inf: device pointers or null (see
  // adam_step_cuda); on the simulated device they are host pointers read when the step runs.
  // Before any launch (and before the step counters move) it checks that every tensor is still
  // registered and that every layer still fits the GPU budget (which may have been lowered since
  // create), so those failures leave every parameter and moment as it was.
  // A step that fails part way leaves nothing held and the runtime ready for the next step.
  // See Note [A failed step] in adam.cpp for what it changed.
  [[nodiscard]] absl::Status step(const float* grad_scale = nullptr,
                                  const float* found_inf = nullptr);

  // See Note [Overlapped step]. Steps `layer` now, during backward, once its gradients are final
  // (after the runtime's after_backward(layer)), dividing its gradients by `grad_scale` (the loss
  // scale, a device scalar that stays alive until finish_step; null: 1) and keeping what a redo
  // needs. The step's first call begins it (the step counters move); every call of a step passes
  // the same grad_scale. A layer stepped on the host is posted to a host thread and its parameters
  // reach the GPU in finish_step (See Note [Host steps in backward] in adam_host_speculation.cpp).
  // A layer with a tensor not on the GPU (a policy that keeps it on the host during backward),
  // whose undo does not fit the host, that rests wholly on the GPU without room there for its
  // undo (See Note [Resting layers] in adam_overlap.cpp), or past the share set_backward_share
  // allows, is left for finish_step, not an error. A
  // failure leaves the layer unstepped and nothing held; finish_step still completes the step.
  [[nodiscard]] absl::Status step_layer(int layer, const float* grad_scale = nullptr);
  enum class StepOutcome {
    kSequential,   // no layer was stepped during backward: step() ran
    kSpeculation,  // the speculation held (layers backward left were stepped now)
    kRedone,       // clipping triggered or inf was found: rolled back and stepped again
  };
  // Completes the step step_layer began, with the true grad_scale and found_inf (as step() takes
  // them); without step_layer calls since the last step, it is step(). A failure rolls the step
  // back when it can (the error says which), so that it can be taken again. A failure after the
  // step held and was committed leaves it open: a call again finishes it without validating it
  // again, and cancel_step refuses it.
  [[nodiscard]] absl::StatusOr<StepOutcome> finish_step(const float* grad_scale = nullptr,
                                                        const float* found_inf = nullptr);
  // Takes back the step step_layer began, as if it had not run: every kept byte goes back and the
  // step counters too (for a backward that turned out not to be the step's last, or failed part
  // way). Nothing to do without one. A failure leaves it open; call again. kFailedPrecondition
  // where finish_step committed the step and then failed: its undo is gone; finish it instead
  // (step_layer refuses it too), or restore a checkpoint.
  [[nodiscard]] absl::Status cancel_step();
  // A step finish_step committed and then failed to finish, forgotten where a checkpoint is
  // restored (load, and strata.optim's load_state_dict, call it first): what it did not finish
  // stays undone. Nothing to do without one.
  [[nodiscard]] absl::Status drop_committed_step();
  // See Note [Step placement] in runtime/policy.h: the line the policy gave when it placed the
  // steps (empty for a policy that does not), or the last it gave when it moved them (See Note
  // [Measured split] in policies/split_search.h), and the layers stepped on the host, ascending.
  const std::string& placement() const { return placement_; }
  const std::vector<int>& host_layers() const { return host_layers_; }
  // The rates measured for the placement (See Note [Measuring the step's rates] in
  // step_rates.h); none when the policy places no steps.
  const std::optional<rt::StepRates>& step_rates() const { return step_rates_; }
  // Threads the host kernel runs on (AdamOptions::cpu_threads, or the machine's).
  int host_threads() const;
  // Bytes the host-stepped layers' copies queued so far: gradients out, parameters back.
  struct HostStepBytes {
    std::int64_t d2h = 0, h2d = 0;
  };
  HostStepBytes host_step_bytes() const { return host_step_bytes_; }
  // Seconds the host-stepped layers' work took so far, on the host (a step in backward included):
  // queued is from the step's start to the host's first wait for gradients, while the GPU layers'
  // step is queued; waited is the host blocked on gradients; kernel is the host kernel itself.
  struct HostStepSeconds {
    double queued = 0, waited = 0, kernel = 0;
  };
  HostStepSeconds host_step_seconds() const;
  // Whether step_layer began a step that finish_step has not completed.
  bool overlapped_step_open() const { return overlap_open_; }
  // See Note [A share of the step in backward] in adam_overlap.cpp: of each step, the layers
  // step_layer is called for first whose states crossing the link come to `share` of all that
  // cross it (to the nearest layer) are stepped in backward, and the others whose states cross
  // the link are left for finish_step. 1 (the default): every layer. Takes effect at the next
  // step; kInvalidArgument for a share outside [0, 1] (NaN included), and nothing changes.
  [[nodiscard]] absl::Status set_backward_share(double share);
  double backward_share() const { return backward_share_; }
  // What a step in backward puts on the device-to-host link, over the layers whose states cross
  // it (not resident on the GPU, not stepped on the host): their states' bytes, and the bytes of
  // their parameters and states resting on the GPU, which its undo copies to pinned memory unless
  // the runtime keeps it on the GPU (See Note [Undo log] in runtime/undo_log.cpp).
  struct BackwardBytes {
    std::size_t link_states = 0;
    std::size_t resting = 0;
  };
  BackwardBytes backward_bytes() const;
  // Layers stepped during backward in the open (or last) overlapped step, in order.
  const std::vector<int>& overlapped_layers() const { return overlapped_; }

  // The parameters the last step() stepped, in the order their kernels were queued: all of them
  // after a step that succeeded, none after one that failed before any kernel ran, and those before
  // the failure otherwise (See Note [A failed step] in adam.cpp); and their layers, each once.
  const std::vector<rt::TensorHandle>& last_step_parameters() const { return last_step_; }
  std::vector<int> last_step_layers() const;

  // Note [Per-parameter steps]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~
  // torch steps a parameter only when it has a gradient, so each parameter keeps its own step count
  // (its bias corrections follow it), and a parameter without a gradient in a step (frozen for a
  // while, an unused head, an MoE expert not routed) is left as it is: no decay, no moment update,
  // its count unchanged. skip_parameters names such parameters for the step about to run (or the
  // one step_layer began: a layer already stepped in backward stays stepped, so name them before
  // their layer's step_layer); the list is kept until a step completes (step, finish_step), so a
  // failed step retried, or one taken back (cancel_step) and redone, skips the same ones;
  // clear_skipped forgets it (a step abandoned). kNotFound, and nothing changes, for a handle that
  // is not one of the optimizer's parameters.
  [[nodiscard]] absl::Status skip_parameters(const std::vector<rt::TensorHandle>& params);
  void clear_skipped() {
    std::fill(skip_.begin(), skip_.end(), false);
    for (Slot& s : slots_) s.given_grad = nullptr;
  }

  // See Note [Gradients given at each step]. Where the gradient of `param` (one listed without a
  // registered gradient) is for the step about to run, or for its layer's step_layer: `data` on the
  // GPU (host memory on the simulated device), `type` the parameter's or float32, contiguous, as
  // many elements as the parameter, alive and unchanged until the step's kernels have run (on the
  // compute stream's order) and, for a layer stepped on the host during backward, until
  // finish_step or cancel_step returns (its copy to the host runs on a stream of its own). Kept
  // until the step completes, as skip_parameters' list. kNotFound for a handle that is not a
  // parameter; kFailedPrecondition for one whose gradient is registered; kInvalidArgument for a
  // null pointer or another low-precision type.
  [[nodiscard]] absl::Status set_gradient(rt::TensorHandle param, const void* data, ElemType type);
  bool skipped_this_step(rt::TensorHandle param) const;

  [[nodiscard]] absl::Status set_lr(std::size_t group, double lr);
  // Every hyperparameter of a group at once, as torch reads its param_groups at each step (an LR
  // schedule, a weight-decay change). amsgrad cannot change: its states exist or do not.
  [[nodiscard]] absl::Status set_hyper(std::size_t group, const AdamHyper& hyper);
  // Steps taken: a step that a found_inf flag skipped does not count (See Note [Skipped steps] in
  // adam_kernels.h). Once a step was given a flag, these wait for the compute stream. A group's
  // count is the most any of its parameters took (See Note [Per-parameter steps]).
  std::int64_t step_count(std::size_t group) const;
  [[nodiscard]] absl::StatusOr<std::int64_t> step_count_of(rt::TensorHandle param) const;
  // Sets the step count of every parameter of a group, or of one parameter, as loading a torch
  // state dict does (bias corrections follow it).
  [[nodiscard]] absl::Status set_step_count(std::size_t group, std::int64_t steps);
  [[nodiscard]] absl::Status set_step_count_of(rt::TensorHandle param, std::int64_t steps);
  const AdamHyper& hyper(std::size_t group) const { return groups_.at(group).hyper; }
  std::size_t num_groups() const { return groups_.size(); }
  // The state tensors of a parameter: exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad, and
  // the master copy of a bfloat16 or float16 parameter).
  [[nodiscard]] absl::StatusOr<std::vector<rt::TensorHandle>> state(rt::TensorHandle param) const;

  // Checkpoints: every group's step counter and hyperparameters and every state tensor, read
  // straight from whichever tier holds it (pinned or pageable states never visit the GPU), with a
  // checksum. A checkpoint holds optimizer state only: save the model's parameters with it.
  // load() expects an Adam made over the same parameters (names and sizes), whose policy has
  // already placed the states; it writes them where they are. It trusts nothing in the file
  // (See Note [Untrusted checkpoints] in adam_checkpoint.cpp): kInvalidArgument when the checkpoint
  // is for other parameters or holds hyperparameters torch would refuse; kDataLoss when it is
  // truncated or corrupt. A failed load changes nothing. It reads one checkpoint and leaves the
  // stream after it.
  [[nodiscard]] absl::Status save(std::ostream& out);
  [[nodiscard]] absl::Status load(std::istream& in);
  StateType state_dtype() const { return options_.state_dtype; }
  const StepRule& rule() const { return *options_.rule; }

  // A parameter's states as float32 values, one a parameter element each, by declared name
  // (torch's state dict: compressed moments decoded), read from whichever tier holds them.
  [[nodiscard]] absl::StatusOr<std::vector<std::pair<std::string, std::vector<float>>>>
  read_state_values(rt::TensorHandle param) const;
  // Writes the states named in `values` (numel float32 values each; the others are left as they
  // are), compressed moments encoded to the nearest code (decoded values come back exactly: See
  // Note [Compressed moments]). kInvalidArgument, and nothing written, for a name the parameter
  // has no state under or a size that is not the parameter's; a failed write puts back what it
  // wrote.
  [[nodiscard]] absl::Status write_state_values(
      rt::TensorHandle param,
      const std::vector<std::pair<std::string, std::vector<float>>>& values);

 private:
  // One parameter's registration (See optim/adam_slot.h).
  using Slot = AdamSlot;
  // The rule's view of slots_[index] for the step being queued, from the addresses of its
  // kernel_tensors().
  StepTensor kernel_tensor(std::size_t index, const std::array<void*, 2 + kMaxStates>& ptrs) const;
  // Queues the kernel for `list`, the tensors of slots `of` in group g; once it is queued, those
  // parameters count as stepped (their step counts move, last_step_ lists them).
  absl::Status launch(const std::vector<StepTensor>& list, const std::vector<std::size_t>& of,
                      std::size_t g, const float* grad_scale, const float* found_inf);
  // The step the optimizer is at, for messages: the most steps any parameter was queued for.
  std::int64_t step_number() const;
  // The slot of a parameter's handle; kNotFound for one that is not this optimizer's.
  absl::StatusOr<std::size_t> slot_of(rt::TensorHandle param) const;
  // The name a tensor of the slot was registered under.
  static std::string name_in(const Slot& s, rt::TensorHandle h);
  // The name of one of this optimizer's state tensors.
  std::string name_of_state(rt::TensorHandle h) const;
  Adam(rt::Runtime& runtime, AdamOptions options);
  // Hyperparameters the rule accepts (create, set_lr and load check them).
  absl::Status check_hyper(const AdamHyper& h, std::size_t group) const {
    return options_.rule->check(h, options_.state_dtype, group);
  }
  // The checks step() makes before it changes anything.
  absl::Status check_can_step();
  // Every layer's step working set (parameters, gradients, moments) fits the GPU budget: the
  // kernel reads GPU memory only, so a layer that cannot be brought there whole would fail its
  // step half way through the model.
  static absl::Status check_fits_gpu(rt::Runtime& runtime,
                                     const std::map<int, std::size_t>& step_bytes);
  // Every parameter of `slots` that takes part in the step has its gradient (registered or
  // given); the error names the first that has none.
  absl::Status check_gradients_given(const std::vector<std::size_t>& slots) const;
  // A step completed, taken the way `kind` says (kRedone where a step taken in backward was taken
  // back since the last): the lists kept for it (skipped parameters, given gradients) are
  // forgotten, and its time goes to a policy that measures steps (measure_step).
  absl::Status end_step(rt::StepKind kind) {
    clear_skipped();
    return measure_step(std::exchange(taken_back_, false) ? rt::StepKind::kRedone : kind);
  }
  // See Note [Measured split] in policies/split_search.h: while the policy wants step times,
  // time_step. The step was taken whatever happens here: a failure stops the search (the policy
  // puts back what it moved for this step), says why on stderr and in placement(), and returns OK.
  absl::Status measure_step(rt::StepKind kind);
  // The time from the last step's end to this one's, on the device's clock (one host wait a
  // step), handed to the policy, then follow_placement.
  absl::Status time_step(rt::StepKind kind);
  // The host-stepped layers as the policy has them now (it moves steps between two steps): every
  // layer stepped on the GPU checked to fit there and the host buffers and float32 masters made
  // for the new ones, or an error and nothing changed; then the old ones freed, all of them tried
  // (See Note [Float32 masters follow the split] in adam_placement.cpp). run_step and step_layer
  // call it as each step begins too, so that no step runs while the two disagree.
  absl::Status follow_placement();
  // The layer loop of step(): what it holds when it fails and the layer it was on
  // (See Note [A failed step] in adam.cpp); the parameters it stepped go to last_step_.
  absl::Status step_layers(const float* grad_scale, const float* found_inf,
                           std::vector<rt::TensorHandle>& held, int& failed_layer);
  // step()'s body; with new_step false, part of the step was taken in backward (finish_step).
  absl::Status run_step(const float* grad_scale, const float* found_inf, bool new_step);
  // Queues the kernel for `list` (tensors of group g) on the compute stream.
  absl::Status queue_kernel(const std::vector<StepTensor>& list, const AdamHyper& hyper,
                            const float* grad_scale, const float* found_inf);
  // Float32 device scalars' values (`absent` where null), with one host wait on the compute
  // stream.
  absl::StatusOr<std::array<float, 3>> read_scalars(const std::array<const float*, 3>& p,
                                                    const std::array<float, 3>& absent);
  // The parameters of `layer` in slots and whether each of their tensors is on the GPU.
  bool layer_on_gpu(int layer) const;
  // The slots of a layer in the order its staged states arrive; empty when it is not staged.
  const std::vector<std::size_t>& arrival_order(int layer);

  // See Note [Host-stepped layers] in adam_host_step.cpp.
  bool steps_on_host(int layer) const {
    return std::binary_search(host_layers_.begin(), host_layers_.end(), layer);
  }
  // create(): every input checked before anything is registered, then the declared states
  // registered (See adam_create.cpp).
  absl::Status check_groups();
  absl::Status register_states();
  // Registers state j of slots_[index] as `decl` declares it (a master from the parameter).
  absl::Status register_state(std::size_t index, int j, const StateDecl& decl);
  // create(): hands the policy each layer's costs and the measured rates, and keeps where it put
  // each layer's step.
  absl::Status place_steps();
  // See Note [Float32 masters follow the split] in adam_placement.cpp: the master a parameter
  // declares on the host only (nullopt when its states are the same on either side), or an error
  // when its states differ by more, so that its layer never moves.
  absl::StatusOr<std::optional<StateDecl>> host_master(const AdamHyper& hyper,
                                                       rt::DType param_dtype) const;
  // The master a float32 parameter's slot has on the host only; nullopt for another parameter.
  std::optional<StateDecl> float32_master_decl(const Slot& s) const;
  // The masters of `layer`'s float32 parameters, registered (their slots added to `added`), and
  // one slot's master unregistered.
  absl::Status add_masters(int layer, std::vector<std::size_t>& added);
  absl::Status drop_master(std::size_t index);
  // create(), for a policy that places steps: the pinned scalars host steps read, and for each
  // host-stepped layer the pinned buffer its gradients are copied into and its low-precision
  // parameters out of (make_layer_buffer). A gradient buffer holds float32 where gradients are
  // given at each step (set_gradient may give float32 for a low-precision parameter), else the
  // registered gradient's dtype.
  absl::Status make_host_buffers();
  // A layer's buffer, made (nothing if it has one) or freed, with its slots' host_slots_.
  absl::Status make_layer_buffer(int layer);
  absl::Status free_layer_buffer(int layer);
  std::size_t grad_buffer_elem(const Slot& s) const {
    return options_.gradients_given ? std::max(elem_size(s.grad_type), elem_size(ElemType::kF32))
                                    : elem_size(s.grad_type);
  }
  ThreadPool& pool();
  // Waits for the host steps' copy streams (gradients out, parameters back).
  absl::Status sync_host_streams();
  // step_layers() around and between the GPU layers (See Note [Host layers between GPU layers] in
  // adam_host_step.cpp): begin queues what the host kernel reads from the device and the first
  // host layers' gradient copies; step_host_layers(n) steps the host layers up to the n-th (in
  // `layers`' order), queueing gradients ahead and parameters back; finish steps the rest and
  // makes the compute stream wait for the parameters.
  absl::Status begin_host_steps(const std::vector<int>& layers, const float* grad_scale,
                                const float* found_inf);
  absl::Status step_host_layers(std::size_t upto);
  absl::Status finish_host_steps();
  // `layer`'s gradients queued to their pinned buffers on host_d2h_ once the compute stream
  // reaches `ready` (null: where it is now); the event they have arrived by.
  absl::StatusOr<rt::EventHandle> queue_gradients_out(int layer, rt::EventHandle ready = nullptr);
  // What the host kernel reads from the device for the slots of `layers` (grad_scale, found_inf
  // and bias corrections; null: 1 and 0), queued on the compute stream into host_scalars_.
  absl::Status queue_host_scalars(const std::vector<int>& layers, const float* grad_scale,
                                  const float* found_inf);
  // The host kernel's tensors of `layer`'s slots that take part in the step, by group, and those
  // slots.
  absl::Status host_kernel_tensors(int layer, std::vector<std::vector<StepTensor>>& per_group,
                                   std::vector<std::size_t>& stepped) const;
  // Host-stepped slots' parameters queued back to the GPU on host_h2d_, and the compute stream
  // made to wait for them.
  absl::Status queue_parameters_back(const std::vector<std::size_t>& stepped);
  absl::Status wait_for_parameters_back();
  // See Note [Host steps in backward] in adam_host_speculation.cpp. Steps a host layer during
  // backward (its states kept first), its parameters left for finish_step; OK without stepping it
  // where no host memory holds the undo.
  absl::Status speculate_host_layer(int layer);
  // The states a host step of slot `index` writes, where they rest.
  struct Written {
    void* data;
    std::size_t bytes;
    StateLayout layout;
  };
  absl::StatusOr<std::vector<Written>> host_written(std::size_t index) const;
  // Puts back the states of slot `index` a host step in backward kept at `undo` (the step is taken
  // back: HostSpeculation::take_back).
  void put_back_host_states(std::size_t index, const char* undo);
  // See Note [Finishing a held step] in adam_overlap.cpp; then forgets the host steps.
  absl::Status return_speculated_parameters(const float* grad_scale, const float* found_inf);
  // `spec`'s layer, whose job stepped nothing, stepped on the host as step() would.
  absl::Status step_failed_host_layer(HostSpeculation::Speculated& spec, const float* grad_scale,
                                      const float* found_inf);
  // Releases the events the host steps recorded (also after a failure).
  void end_host_steps();
  // A tensor's address where it rests on `tier`, for a host step (See Note [Host steps hold
  // nothing] in adam_host_step.cpp); kFailedPrecondition when it is elsewhere or moving.
  absl::StatusOr<void*> resting_address(rt::TensorHandle h, rt::Tier tier) const;

  rt::Runtime& runtime_;
  AdamOptions options_;
  std::string placement_;
  std::vector<int> host_layers_;
  // measure_step's: the event the last step ended at, on the compute stream, and host_kernel_ns_
  // and the host layers posted in backward so far (HostSpeculation::posted) then.
  rt::EventHandle step_end_ = nullptr;
  std::int64_t step_end_kernel_ns_ = 0;
  std::int64_t step_end_speculated_ = 0;
  std::optional<rt::StepRates> step_rates_;
  struct HostSlot {
    void* grad = nullptr;   // pinned: the gradient, copied from the GPU
    void* param = nullptr;  // pinned: a low-precision parameter, copied to the GPU; else null
    int request = 0;        // its bias corrections' index in host_bias_
  };
  std::vector<HostSlot> host_slots_;  // per slot; empty for a policy that places no steps
  HostStepBytes host_step_bytes_;
  // host_step_seconds(), in nanoseconds: a step in backward adds from its host thread.
  std::atomic<std::int64_t> host_queued_ns_{0}, host_waited_ns_{0}, host_kernel_ns_{0};
  std::chrono::steady_clock::time_point host_began_;  // begin_host_steps' start
  std::map<int, void*> host_buffers_;  // per host layer: the pinned memory host_slots_ point into
  rt::StreamHandle host_d2h_ = nullptr, host_h2d_ = nullptr;
  // This step's (begin_host_steps to end_host_steps): the host layers, in the order stepped; per
  // layer whose gradients are queued, the event they arrive by; the compute stream's point where
  // every gradient is final; on the simulated device, the event the scalars are read by; how many
  // layers are stepped; the kernel's 1 / grad_scale and found_inf; and whether parameters were
  // queued back.
  std::vector<int> host_pending_;
  std::vector<rt::EventHandle> host_arrived_;
  rt::EventHandle host_grads_ready_ = nullptr;
  rt::EventHandle host_scalars_read_ = nullptr;
  std::size_t host_stepped_ = 0;
  float host_inv_ = 1.0f;
  bool host_inf_ = false;
  bool host_params_queued_ = false;
  // Pinned: the step's grad_scale and found_inf as the host kernel reads them, then the rule's
  // scalars per request (See Note [Scalars from the device] in step_rule.h), room for one a slot.
  float* host_scalars_ = nullptr;
  // The host kernel's threads (simulated device), made at its first step.
  std::shared_ptr<ThreadPool> cpu_pool_;
  // See Note [Host steps in backward] in adam_host_speculation.cpp: the host steps taken in
  // backward, their thread and their undo.
  HostSpeculation host_speculation_{runtime_, host_waited_ns_, host_kernel_ns_};
  // roll_back ran since the last end_step: the next step is counted as redone (See Note [Measured
  // split] in policies/split_search.h).
  bool taken_back_ = false;
  std::vector<ParamGroup>& groups_ = options_.groups;
  std::vector<Slot> slots_;
  // Per slot: the parameter sits out the step (See Note [Per-parameter steps]).
  std::vector<bool> skip_;
  // Indices into slots_ by layer, built once: step() runs every iteration.
  std::map<int, std::vector<std::size_t>> by_layer_;
  // The slot each state tensor and each parameter (by handle id) belongs to.
  std::map<std::uint64_t, std::size_t> slot_of_state_;
  std::map<std::uint64_t, std::size_t> slot_of_param_;
  std::vector<rt::TensorHandle> last_step_;
  // Every state tensor this optimizer registered, in order: unregistered when it goes.
  std::vector<rt::TensorHandle> owned_;
  // arrival_order's buffers, kept so that a step allocates nothing once they are sized.
  std::vector<rt::TensorHandle> arrived_;
  std::vector<std::size_t> arrival_order_;
  // Bytes each layer needs on the GPU during its step (parameters, gradients and moments): every
  // layer's, and those stepped on the GPU.
  std::map<int, std::size_t> all_step_bytes_;
  std::map<int, std::size_t> step_bytes_;
  // Per slot, the steps a found_inf flag skipped, counted where the kernels run (pinned host memory
  // the GPU writes through unified addressing, 8 bytes a parameter); read only once a step was
  // given a flag (See Note [Skipped steps] in adam_kernels.h).
  std::int64_t* skipped_ = nullptr;
  // Where read_scalars' kernel writes, in the same pinned allocation, after skipped_.
  float* read_back_ = nullptr;
  bool skips_possible_ = false;
  // Waits for the compute stream, then sets the skipped counts to zero (a loaded checkpoint's
  // counters are exact).
  absl::Status reset_skipped();
  // Folds the skipped counts into the slots' step counts and resets them (before a count is set).
  absl::Status fold_skipped();
  // Runtime::unregistrations() when every handle was last found registered.
  std::uint64_t checked_unregistrations_ = ~std::uint64_t{0};
  // The step step_layer began, its speculative scale and its layers (See Note [Overlapped step]).
  bool overlap_open_ = false;
  // finish_step validated the open step and committed its undo; finishing the rest failed.
  bool overlap_committed_ = false;
  bool rest_stepped_ = false;  // See Note [Finishing a held step] in adam_overlap.cpp
  // See Note [A share of the step in backward] in adam_overlap.cpp: the share, and in the open
  // step the bytes of states it allows (kEveryLayer: no limit), those its layers took so far, and
  // whether one passed it.
  static constexpr std::size_t kEveryLayer = ~std::size_t{0};
  double backward_share_ = 1.0;
  std::size_t backward_allowed_ = kEveryLayer, backward_taken_ = 0;
  bool rest_after_backward_ = false;
  // The bytes of `layer`'s states that cross the link (not resting on the GPU); 0 for a layer
  // stepped on the host or not this optimizer's.
  std::size_t layer_link_bytes(int layer) const;
  const float* speculative_scale_ = nullptr;
  std::vector<int> overlapped_;
  // What step_layer could not release (a device error): tensors it still holds, and the release
  // of a stepped layer the policy has not seen; the next step_layer or finish_step finishes it.
  int unreleased_layer_ = -1;
  std::vector<rt::TensorHandle> unreleased_held_;
  absl::Status finish_release();
  // The undo log rolled back, and the step step_layer began taken back.
  absl::Status roll_back();
  // After the commit: the layers backward left stepped, the host-stepped layers' parameters back
  // to the GPU, and the step closed (See Note [Finishing a held step] in adam_overlap.cpp).
  absl::StatusOr<StepOutcome> finish_committed(const float* grad_scale, const float* found_inf);
  void close_committed();
  // drop_committed_step's part that cannot fail (Adam::load calls it once the checkpoint is in).
  void forget_committed_step();
  // Whether the last run_step stepped every layer it was to (a failure after that is the policy's
  // end of step only).
  bool stepped_every_layer_ = false;
};

}  // namespace strata::optim
