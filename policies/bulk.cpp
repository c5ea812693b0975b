#include <memory>
#include <utility>
#include <vector>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

namespace strata::policy {
namespace {

// bulk keeps every tensor at its home tier; its phase switches are the runtime's
// (See Note [Phase switches] in runtime/phase.cpp), every role to host memory and back in bulk.
//
// Note [Bulk over budget]
// ~~~~~~~~~~~~~~~~~~~~~~~
// With offload_after_step, the tensors of the configured roles rest in host memory between steps
// (from registration on) and come back for each step in one of three ways, the first that fits the
// GPU budget, chosen by trying them in this order once per change in the registry (on_prepare, at
// setup):
//   - everything comes back at the start of a step, in bulk, and one host wait puts it in place
//     (as reload_all does);
//   - what forward and backward need (parameters, gradients) comes back, and the optimizer states
//     (and amsgrad's maximum, role other) stream through a one-slot staging ring during the
//     optimizer step: layer_prefetch at depth 0 over the states, without resident layers;
//   - nothing comes back, and the whole step (forward, backward and the optimizer step) streams a
//     layer at a time through a one-slot ring: layer_prefetch at depth 0 over every role.
// A budget in which not even the last fits (one layer in one slot, beside what stays on the GPU) is
// an error at setup. Each way's GPU memory is fixed once chosen (what comes back takes the same
// blocks each step; the ring is reserved once), so a budget that trains keeps training, and a
// larger one trains too: it can only pick an earlier way. Should what comes back not fit at the
// start of a step after all (a different packing), bulk takes the next way from then on. Slower
// than layer_prefetch (less or no overlap) but the same kernels on the same values: the same
// numbers, in a GPU budget smaller than the states, or than the whole model.
class Bulk final : public rt::ResidencyPolicy {
 public:
  explicit Bulk(const rt::PolicyConfig& c) : ResidencyPolicy(c) {}
  std::string_view name() const override { return "bulk"; }

  rt::Tier placement(const rt::TensorSpec& spec) const override {
    return rests_on_host(spec.role) ? rt::Tier::kPinnedHost : spec.home;
  }

  absl::Status on_register(rt::PolicyContext& rt, rt::TensorHandle h) override {
    plan_ = Plan::kNone;  // chosen again for the tensors registered now
    return streamer_ ? streamer_->on_register(rt, h) : absl::OkStatus();
  }

  absl::Status on_prepare(rt::PolicyContext& rt) override {
    if (!config().offload_after_step || plan_ != Plan::kNone) return absl::OkStatus();
    return choose(rt, Plan::kEverythingBack);
  }

  // Phase switches (See Note [Phase switches] in runtime/phase.cpp): a step streaming layers puts
  // what it staged home first (staged tensors cannot move), and takes its ring again after.
  absl::Status on_offload_all(rt::PolicyContext& rt) override {
    return layered_ ? layered_->on_offload_all(rt) : absl::OkStatus();
  }

  absl::Status on_reload_all(rt::PolicyContext& rt) override {
    return layered_ ? layered_->on_reload_all(rt) : absl::OkStatus();
  }

  absl::Status on_begin_step(rt::PolicyContext& rt) override {
    if (!config().offload_after_step) return absl::OkStatus();
    if (plan_ == Plan::kNone) STRATA_RETURN_IF_ERROR(choose(rt, Plan::kEverythingBack));
    absl::Status s = start(rt, plan_);
    if (s.code() == absl::StatusCode::kResourceExhausted && plan_ != Plan::kStreamEverything) {
      // What came back last step did not fit this time (See Note [Bulk over budget]).
      STRATA_RETURN_IF_ERROR(to_host_all(rt, config().roles));
      STRATA_RETURN_IF_ERROR(rt.wait_all());
      STRATA_RETURN_IF_ERROR(choose(rt, next(plan_)));
      s = start(rt, plan_);
    }
    return s;
  }

  absl::Status on_before_forward(rt::PolicyContext& rt, int layer) override {
    return layered_ ? layered_->on_before_forward(rt, layer) : absl::OkStatus();
  }

  absl::Status on_before_backward(rt::PolicyContext& rt, int layer) override {
    return layered_ ? layered_->on_before_backward(rt, layer) : absl::OkStatus();
  }

  absl::Status on_after_backward(rt::PolicyContext& rt, int layer) override {
    return layered_ ? layered_->on_after_backward(rt, layer) : absl::OkStatus();
  }

  absl::Status on_begin_optimizer_step(rt::PolicyContext& rt) override {
    return layered_ ? layered_->on_begin_optimizer_step(rt) : absl::OkStatus();
  }

  absl::Status on_layer_released(rt::PolicyContext& rt, int layer) override {
    return layered_ ? layered_->on_layer_released(rt, layer) : absl::OkStatus();
  }

  absl::Status on_end_optimizer_step(rt::PolicyContext& rt) override {
    return layered_ ? layered_->on_end_optimizer_step(rt) : absl::OkStatus();
  }

  absl::Status on_undo_rolled_back(rt::PolicyContext& rt) override {
    return layered_ ? layered_->on_undo_rolled_back(rt) : absl::OkStatus();
  }

  absl::Status on_end_step(rt::PolicyContext& rt) override {
    if (layered_) STRATA_RETURN_IF_ERROR(layered_->on_end_step(rt));
    if (!config().offload_after_step) return absl::OkStatus();
    // Everything of the roles rests on the host until the next step.
    STRATA_RETURN_IF_ERROR(to_host_all(rt, config().roles));
    return rt.wait_all();
  }

 private:
  enum class Plan { kNone, kEverythingBack, kStreamStates, kStreamEverything };
  static Plan next(Plan p) {
    return p == Plan::kEverythingBack ? Plan::kStreamStates : Plan::kStreamEverything;
  }

  bool rests_on_host(rt::Role role) const {
    return config().offload_after_step && config().roles.contains(role);
  }
  static bool is_state(rt::Role role) {
    return role == rt::Role::kOptimizerState || role == rt::Role::kOther;
  }
  // The roles a plan streams: none, the states, or every role.
  rt::RoleSet streamed(Plan p) const {
    if (p == Plan::kStreamEverything) return config().roles;
    rt::RoleSet out;
    if (p == Plan::kStreamStates) {
      for (rt::Role r : {rt::Role::kOptimizerState, rt::Role::kOther}) {
        if (config().roles.contains(r)) out = out | r;
      }
    }
    return out;
  }

  // Tries the ways from `first` on, and keeps the first that fits (See Note [Bulk over budget]).
  // The data of the way kept stays where it is now (on the GPU), ready for the first step.
  absl::Status choose(rt::PolicyContext& rt, Plan first) {
    plan_ = Plan::kNone;
    layered_ = nullptr;
    STRATA_RETURN_IF_ERROR(rt.release_staging());  // a ring of an earlier way takes no room
    absl::Status last;
    for (Plan p = first;; p = next(p)) {
      last = start(rt, p);
      if (last.ok()) {
        plan_ = p;
        return absl::OkStatus();
      }
      if (last.code() != absl::StatusCode::kResourceExhausted) return last;
      // Did not fit: everything back on the host before the next way is tried.
      STRATA_RETURN_IF_ERROR(to_host_all(rt, config().roles));
      STRATA_RETURN_IF_ERROR(rt.wait_all());
      if (p == Plan::kStreamEverything) break;
    }
    return absl::Status(last.code(),
                        str_cat("bulk: the GPU budget (", format_bytes(rt.gpu_budget()),
                                ") has no room even to stream one layer at a time beside what "
                                "stays on the GPU: ",
                                last.message()));
  }

  // Brings back what plan `p` keeps on the GPU for the step and readies its streamer.
  absl::Status start(rt::PolicyContext& rt, Plan p) {
    layered_ = nullptr;
    const rt::RoleSet stream = streamed(p);
    for (rt::TensorHandle h : rt.tensors()) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, settled_info(rt, h));
      if (!rests_on_host(info.spec.role) || stream.contains(info.spec.role)) continue;
      // Parameters and gradients go back to their home tier, states to the GPU.
      const rt::Tier where = is_state(info.spec.role) ? rt::Tier::kGpu : info.spec.home;
      if (info.tier != where) STRATA_RETURN_IF_ERROR(rt.migrate(h, where));
    }
    // Whatever came back has landed before the step uses it, or the ring is sized.
    STRATA_RETURN_IF_ERROR(rt.wait_all());
    if (stream.empty()) return absl::OkStatus();
    if (!streamer_ || streamer_roles_ != stream) {
      STRATA_ASSIGN_OR_RETURN(streamer_,
                              make_layer_streamer({.prefetch_depth = 0, .roles = stream}));
      streamer_roles_ = stream;
    }
    STRATA_RETURN_IF_ERROR(streamer_->on_prepare(rt));
    STRATA_RETURN_IF_ERROR(streamer_->on_begin_step(rt));
    layered_ = streamer_.get();
    return absl::OkStatus();
  }

  absl::Status to_host_all(rt::PolicyContext& rt, rt::RoleSet roles) {
    for (rt::TensorHandle h : rt.tensors()) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, settled_info(rt, h));
      if (!roles.contains(info.spec.role) || info.tier != rt::Tier::kGpu) continue;
      STRATA_RETURN_IF_ERROR(to_host(rt, h));
    }
    return absl::OkStatus();
  }

  // The tensor's info once a migration under way has landed: the runtime moves no tensor that is
  // in flight, and a check of `tier` alone would take a tensor arriving on the GPU for one that is
  // elsewhere. Waits on the host only when the tensor is in flight.
  static absl::StatusOr<rt::TensorInfo> settled_info(rt::PolicyContext& rt, rt::TensorHandle h) {
    STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, rt.info(h));
    if (!info.in_flight) return info;
    STRATA_RETURN_IF_ERROR(rt.wait_all());
    return rt.info(h);
  }

  static absl::Status to_host(rt::PolicyContext& rt, rt::TensorHandle h) {
    absl::Status s = rt.migrate(h, rt::Tier::kPinnedHost);
    if (s.code() == absl::StatusCode::kResourceExhausted)
      s = rt.migrate(h, rt::Tier::kPageableHost);
    return s;
  }

  Plan plan_ = Plan::kNone;  // See Note [Bulk over budget]
  // The streamer of the way chosen, made when first needed and kept (its ring stays reserved),
  // and whether this step uses it.
  std::unique_ptr<rt::ResidencyPolicy> streamer_;
  rt::RoleSet streamer_roles_;
  rt::ResidencyPolicy* layered_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<rt::ResidencyPolicy>> make_bulk(const rt::PolicyConfig& c) {
  if (c.roles.empty()) {
    return absl::InvalidArgumentError("bulk: roles to move must not be empty");
  }
  return std::unique_ptr<rt::ResidencyPolicy>(new Bulk(c));
}

}  // namespace strata::policy
