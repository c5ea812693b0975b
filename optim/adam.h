// optim/adam.h: Adam / AdamW as a client of the runtime.
//
// Adam registers each parameter's moments with the runtime (roles exp_avg, exp_avg_sq, and
// max_exp_avg_sq as role other with amsgrad), and for a bfloat16 or float16 parameter its float32
// master copy (role master_param, initialized from the parameter), so the policy decides where they
// live (Note [Mixed precision] in adam_math.h). step() walks
// the layers in the policy's order, acquires each layer's tensors on the GPU for the compute
// stream, queues the fused kernel there (the CPU kernel, as a host function, on the simulated
// device) and releases them, which lets the policy write the layer back and prefetch the next one.
// Hyperparameters are per parameter group and the learning rate may change between steps; step
// counters are int64 on the host.
//
// Example:
//   AdamOptions options;
//   options.groups.push_back({.params = {{w0, w0_grad}, {w1, w1_grad}},
//                             .hyper = {.lr = 1e-3, .weight_decay = 0.01}});
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Adam> adam, Adam::create(runtime, options));
//   ...backward...
//   STRATA_RETURN_IF_ERROR(adam->step());
#pragma once

#include <array>
#include <cstdint>
#include <istream>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "optim/adam_math.h"
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
  // Host threads of the CPU kernel (simulated device).
  int cpu_threads = 8;
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
  // (kResourceExhausted naming what does not fit), not at the first step. Note [Adam owns its
  // states]: the Adam unregisters them when it is destroyed, so the runtime must outlive it.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Adam>> create(rt::Runtime& runtime,
                                                                    AdamOptions options);
  // Unregisters the states this optimizer registered (the runtime must outlive it).
  ~Adam();

  // One optimizer step over every group. grad_scale / found_inf: device pointers or null (see
  // adam_step_cuda); on the simulated device they are host pointers read when the step runs.
  // Before any launch (and before the step counters move) it checks that every tensor is still
  // registered and that every layer still fits the GPU budget (which may have been lowered since
  // create), so those failures leave every parameter and moment as it was.
  // A step that fails part way leaves nothing held and the runtime ready for the next step; see
  // Note [A failed step] in adam.cpp for what it changed.
  [[nodiscard]] absl::Status step(const float* grad_scale = nullptr,
                                  const float* found_inf = nullptr);

  // The parameters the last step() stepped, in the order their kernels were queued: all of them
  // after a step that succeeded, none after one that failed before any kernel ran, and those before
  // the failure otherwise (Note [A failed step] in adam.cpp); and their layers, each once.
  const std::vector<rt::TensorHandle>& last_step_parameters() const { return last_step_; }
  std::vector<int> last_step_layers() const;

  [[nodiscard]] absl::Status set_lr(std::size_t group, double lr);
  // Every hyperparameter of a group at once, as torch reads its param_groups at each step (an LR
  // schedule, a weight-decay change). amsgrad cannot change: its states exist or do not.
  [[nodiscard]] absl::Status set_hyper(std::size_t group, const AdamHyper& hyper);
  // Steps taken by the group: a step that a found_inf flag skipped does not count (Note [Skipped
  // steps] in adam_math.h). Once a step was given a flag, this waits for the compute stream.
  std::int64_t step_count(std::size_t group) const;
  // Sets a group's step counter, as loading a torch state dict does (bias corrections follow it).
  [[nodiscard]] absl::Status set_step_count(std::size_t group, std::int64_t steps);
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
  // (Note [Untrusted checkpoints] in adam_checkpoint.cpp): kInvalidArgument when the checkpoint is
  // for other parameters or holds hyperparameters torch would refuse; kDataLoss when it is
  // truncated or corrupt. A failed load changes nothing. It reads one checkpoint and leaves the
  // stream after it.
  [[nodiscard]] absl::Status save(std::ostream& out);
  [[nodiscard]] absl::Status load(std::istream& in);

 private:
  struct Slot {
    rt::TensorHandle param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, master;
    std::size_t group = 0;
    int layer = 0;
    std::int64_t numel = 0;
    ElemType param_type = ElemType::kF32;
    ElemType grad_type = ElemType::kF32;
    std::string param_name, grad_name;  // for messages: handles outlive their tensors
    // The optimizer's state tensors of this parameter, valid or not, in checkpoint order.
    std::array<rt::TensorHandle, 4> states() const {
      return {exp_avg, exp_avg_sq, max_exp_avg_sq, master};
    }
  };
  // The name a tensor of the slot was registered under.
  static std::string name_in(const Slot& s, rt::TensorHandle h);
  // The name of one of this optimizer's state tensors.
  std::string name_of_state(rt::TensorHandle h) const;
  Adam(rt::Runtime& runtime, AdamOptions options);
  // Hyperparameters torch would accept (create, set_lr and load check them).
  static absl::Status check_hyper(const AdamHyper& h, std::size_t group);
  // The checks step() makes before it changes anything.
  absl::Status check_can_step();
  // The layer loop of step(): what it holds when it fails and the layer it was on (Note [A failed
  // step] in adam.cpp); the parameters it stepped go to last_step_.
  absl::Status step_layers(const float* grad_scale, const float* found_inf,
                           std::vector<rt::TensorHandle>& held, int& failed_layer);
  // The slots of a layer in the order its staged states arrive; empty when it is not staged.
  const std::vector<std::size_t>& arrival_order(int layer);

  rt::Runtime& runtime_;
  AdamOptions options_;
  std::vector<ParamGroup>& groups_ = options_.groups;
  std::vector<std::int64_t> steps_;
  std::vector<Slot> slots_;
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
  // Bytes each layer needs on the GPU during its step: parameters, gradients and moments.
  std::map<int, std::size_t> step_bytes_;
  // Note [Skipped steps]: per group, the steps a found_inf flag skipped, counted where the kernels
  // run (pinned host memory the GPU writes through unified addressing, 8 bytes a group); read
  // only once a step was given a flag.
  std::int64_t* skipped_ = nullptr;
  bool skips_possible_ = false;
  // Waits for the compute stream, then sets the skipped counts to zero (a loaded checkpoint's
  // counters are exact).
  absl::Status reset_skipped();
  absl::Status count_skipped(const float* found_inf);
  // Runtime::unregistrations() when every handle was last found registered.
  std::uint64_t checked_unregistrations_ = ~std::uint64_t{0};
};

}  // namespace strata::optim
