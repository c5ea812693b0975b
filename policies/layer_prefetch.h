// policies/layer_prefetch.h (internal): the LayerPrefetch class behind the layer_prefetch and
// hybrid policies, whose members are defined by concept: parameters streamed through forward and
// backward (parameter_streaming.cpp), the optimizer's states streamed for its step
// (state_streaming.cpp), the ring's layout under the budget with the resident layers
// (ring_plan.cpp), the hybrid's step placement (hybrid.cpp), and what they share
// (layer_prefetch.cpp). Only policies/ includes it; make_layer_prefetch and make_hybrid
// (builtin.h) make one.
//
// Example:
//   std::unique_ptr<rt::ResidencyPolicy> p(new internal::LayerPrefetch(config,
//       /*keep_resident_layers=*/true, /*hybrid=*/false));
#pragma once

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status.h"
#include "policies/split_search.h"
#include "runtime/policy.h"
#include "runtime/runtime.h"

namespace strata::policy::internal {

using rt::Role;
using rt::RoleSet;

// Tensors of the configured roles (optimizer states by default) rest in pinned host memory and go
// through the staging ring (See Note [Staging ring] in runtime.h):
//   - optimizer step: the first K + 1 layers are staged; each time the optimizer releases a layer
//     it is written back (gradients, which Adam only reads, are dropped) and the next layer in
//     order is staged into the slot it frees;
//   - with parameters among the roles, forward and backward stream too: before forward of layer i
//     its parameters are held on the GPU and layer i + K + 1's are fetched; parameters are only
//     read there, so they are dropped, not written back. The last K + 1 layers stay for backward,
//     together with their gradients; after backward of layer i its gradients are written back and
//     the next backward layer is fetched. A model whose parameters do not fit the GPU thus trains
//     with K + 1 layers of it on the GPU at a time.
//
// Note [Layer prefetch's phases]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A step goes begin_step, forward, backward, the optimizer step, end_step, and the policy keeps
// where it is in two enums, one for each stream:
//   - pass_, while parameters stream: kNone until the first forward hook, kForward until the first
//     backward hook (enter_backward), kBackward until everything goes home (reset). A forward hook
//     in kBackward, or one for a layer at or before the layer held in kForward, starts a new
//     forward: everything goes home first.
//   - states_, from begin_step to the optimizer step: kInBackward under overlap (the states come in
//     backward order, for steps taken there: See Note [Overlapped backward]); kAhead without
//     overlap when only states stream (the first layers of the optimizer step's order are staged
//     while forward and backward run: See Note [States staged ahead]); kInStep otherwise, and
//     again from begin_optimizer_step or end_step on.
// The ring's own state (slots_, staged_, next_) is laid out by ring_plan.cpp with the resident
// layers (See Note [Resident layers]).
class LayerPrefetch final : public rt::ResidencyPolicy {
 public:
  LayerPrefetch(const rt::PolicyConfig& c, bool keep_resident_layers, bool hybrid)
      : ResidencyPolicy(c),
        keep_resident_layers_(keep_resident_layers),
        slots_cap_(static_cast<std::size_t>(c.prefetch_depth) + 1),
        hybrid_(hybrid) {}
  std::string_view name() const override { return hybrid_ ? "hybrid" : "layer_prefetch"; }

  bool places_steps() const override { return hybrid_; }
  absl::StatusOr<std::string> on_place_steps(rt::PolicyContext& rt,
                                             const rt::StepCosts& costs) override;
  rt::StepPlace step_place(int layer) const override {
    return on_host(layer) ? rt::StepPlace::kHost : rt::StepPlace::kGpu;
  }
  bool wants_step_times() const override {
    return split_.search.has_value() && !split_.search->done();
  }
  absl::StatusOr<std::string> on_step_measured(rt::PolicyContext& rt,
                                               const rt::StepTimes& times) override;
  absl::Status on_move_refused(rt::PolicyContext& rt) override;

  rt::Tier placement(const rt::TensorSpec& spec) const override {
    return config().roles.contains(spec.role) ? rt::Tier::kPinnedHost : spec.home;
  }

  absl::Status on_register(rt::PolicyContext& rt, rt::TensorHandle h) override;

  absl::Status on_prepare(rt::PolicyContext& rt) override { return settle(rt); }

  absl::Status on_begin_step(rt::PolicyContext& rt) override;

  absl::Status on_before_forward(rt::PolicyContext& rt, int layer) override;

  // See Note [Backward out of order].
  absl::Status on_before_backward(rt::PolicyContext& rt, int layer) override;

  absl::Status on_after_backward(rt::PolicyContext& rt, int layer) override;

  absl::Status on_begin_optimizer_step(rt::PolicyContext& rt) override;

  // The layers staged before the optimizer step began first, then the others in ascending order
  // (See Note [Staged for a step not taken in backward]).
  std::vector<int> optimizer_layer_order(const rt::PolicyContext& rt) const override;

  absl::Status on_layer_released(rt::PolicyContext& rt, int layer) override;

  absl::Status on_undo_rolled_back(rt::PolicyContext&) override;

  // A step that ends without an optimizer step (evaluation) leaves nothing held or staged.
  absl::Status on_end_step(rt::PolicyContext& rt) override;

  // Runtime::set_gpu_budget: the ring and the resident layers laid out again under the new budget.
  absl::Status on_budget_changed(rt::PolicyContext& rt) override;

  // Phase switches (See Note [Phase switches] in runtime/phase.cpp): nothing staged or held while
  // the runtime moves tensors; then the ring comes back as it was (the resident layers are back in
  // the main pool by then), or as settle finds room for it.
  absl::Status on_offload_all(rt::PolicyContext& rt) override { return reset(rt); }
  absl::Status on_reload_all(rt::PolicyContext& rt) override;

  absl::Status on_end_optimizer_step(rt::PolicyContext& rt) override;

 private:
  bool streams_parameters() const { return config().roles.contains(Role::kParameter); }
  bool on_host(int layer) const {
    return std::binary_search(host_layers_.begin(), host_layers_.end(), layer);
  }
  bool overlap() const { return config().overlap == rt::Overlap::kBackward; }
  // The optimizer's states among the roles this policy moves.
  RoleSet state_roles() const;
  // The optimizer writes parameters and moments; it only reads gradients.
  RoleSet write_back() const;
  RoleSet backward_roles() const;
  // The last layers of forward (as many as the ring holds) are the first of backward: they stay,
  // with their gradients.
  bool kept_for_backward(std::size_t j) const { return j + slots_ >= forward_.size(); }
  RoleSet forward_roles(std::size_t j) const {
    return kept_for_backward(j) ? backward_roles() : RoleSet{Role::kParameter};
  }
  static std::size_t position(const std::vector<int>& order, int layer) {
    return static_cast<std::size_t>(std::find(order.begin(), order.end(), layer) - order.begin());
  }
  // Whether a tensor rests in the GPU's main pool (where it is going, if it is moving).
  static bool resident(const rt::TensorInfo& info);

  // Layers with bytes of `roles` that are not resident, in ascending order: the others take no
  // slot and no turn, and nor do layers stepped on the host (See Note [Hybrid placement]).
  std::vector<int> streamed_layers(const rt::PolicyContext& rt, RoleSet roles) const;

  absl::Status settle(rt::PolicyContext& rt);

  // The second part of settle (See Note [Resident layers]).
  absl::Status settle_residents(rt::PolicyContext& rt);

  // K + 1 slots, or one for each layer that streams when fewer do.
  std::size_t wanted_slots(const rt::PolicyContext& rt) const;

  // Configures the most slots that fit, wanted_slots() at most; configure's error when not even
  // one does.
  absl::Status fit_ring(rt::PolicyContext& rt);

  // Sends the layers settle_residents moved to the main pool home (the roles this policy moves
  // rest in pinned memory) and waits for the copies, so that their memory is free for the ring.
  // Whether anything moved.
  absl::StatusOr<bool> unsettle_residents(rt::PolicyContext& rt);

  // As many slots as settle found room for (K + 1 at most), or fewer when fewer layers stream,
  // and under overlap one more to drain (See Note [Draining slot]).
  absl::Status configure(rt::PolicyContext& rt);

  // Stages layers of `order` from next_ on while the ring has room: layer k with roles_of(k), its
  // copies in stage_order(k). In backward, a layer whose backward began is skipped
  // (See Note [Backward out of order]).
  template <typename RolesOf, typename StageOrderOf>
  absl::Status refill(rt::PolicyContext& rt, const std::vector<int>& order, RolesOf roles_of,
                      StageOrderOf stage_order) {
    while (staged_.size() < slots_ && next_ < order.size()) {
      if (pass_ == Pass::kBackward && &order == &backward_ &&
          backward_state_[next_] != BackwardState::kPending) {
        ++next_;
        continue;
      }
      STRATA_RETURN_IF_ERROR(stage_whole(rt, order[next_], roles_of(next_), stage_order(next_)));
      ++next_;
    }
    return absl::OkStatus();
  }

  // Stages `layer` and lists it as staged.
  absl::Status stage_whole(rt::PolicyContext& rt, int layer, RoleSet roles, rt::StageOrder order);

  // Holds `layer` for its backward (See Note [Backward out of order]): in its slot, staged first
  // when a slot is free, else where it is, at home, waiting for any copy still arriving there.
  // Returns whether it is held at home.
  absl::StatusOr<bool> hold_for_backward(rt::PolicyContext& rt, int layer);

  // Forward is over at the first backward hook: its last layers are staged, so backward starts
  // that far in.
  void enter_backward();

  static rt::StageOrder as_registered(std::size_t) { return rt::StageOrder::kRegistered; }

  // The optimizer step streams order_ with the configured roles. The first layer comes smallest
  // tensor first, so the first kernel starts soonest; the last comes smallest tensor last, so the
  // last write-back, which nothing overlaps, is the shortest (See Note [Staging order] in
  // runtime/runtime.h).
  absl::Status refill_optimizer(rt::PolicyContext& rt);

  absl::Status unstage(rt::PolicyContext& rt, int layer, RoleSet write);

  // Releases what is held and sends every staged layer home (gradients and whatever the optimizer
  // writes are copied back, parameters read in forward are dropped).
  absl::Status reset(rt::PolicyContext& rt);

  absl::Status start_forward(rt::PolicyContext& rt);

  // The compute stream waits for the layer's data; the runtime keeps it in place until released.
  absl::Status hold(rt::PolicyContext& rt, int layer, RoleSet roles);

  bool is_held(int layer) const {
    return std::any_of(held_.begin(), held_.end(), [&](const Held& h) { return h.layer == layer; });
  }

  // Everything queued on the compute stream until this hook (the held layer's forward or backward)
  // may use the data; later moves wait for it. All or nothing per layer, so a failure leaves the
  // layer held and this can run again.
  absl::Status release_hold(rt::PolicyContext& rt, int layer);

  absl::Status release_held(rt::PolicyContext& rt);

  // Layers with parameters (a layer whose tensors were all unregistered since stays listed;
  // staging and holding it do nothing).
  std::optional<std::vector<int>> parameter_layers_;
  const bool keep_resident_layers_;  // See Note [Resident layers]
  bool settled_ = false;             // See Note [Resident layers]; done for what is registered now
  std::uint64_t settled_unregistrations_ = 0;  // rt.unregistrations() when settled
  std::vector<int> order_;                     // optimizer order, layers that stream only
  std::vector<int> forward_;                   // forward order, layers whose parameters stream
  std::vector<int> backward_;                  // backward order
  std::vector<int> staged_;                    // layers this policy staged, oldest first
  std::size_t next_ = 0;                       // next layer to stage in the current phase
  std::size_t slots_ = 1;                      // layers the ring holds at once
  bool draining_slot_ = false;                 // See Note [Draining slot]
  bool no_room_to_drain_ = false;              // fit_ring found no room for a draining slot
  // The most slots the budget leaves room for (See Note [Ring under a budget]).
  std::size_t slots_cap_;
  // Where the parameters stream (See Note [Layer prefetch's phases]).
  enum class Pass { kNone, kForward, kBackward };
  Pass pass_ = Pass::kNone;
  enum class BackwardState { kPending, kBegun, kDone };
  // Per backward_ position (See Note [Backward out of order]).
  std::vector<BackwardState> backward_state_;
  struct Held {
    int layer;
    RoleSet roles;
  };
  // Layers held for forward (one) or backward (those whose backward may be under way).
  std::vector<Held> held_;
  int last_ = -1;  // the layer held last
  // When the states stream, from begin_step to the optimizer step (See Note [Layer prefetch's
  // phases]).
  enum class StateStream { kInStep, kInBackward, kAhead };
  StateStream states_ = StateStream::kInStep;
  // Under kInBackward: layers staged after their backward until their release; layers released so
  // far (See Note [Overlapped backward]).
  std::vector<int> awaiting_;
  std::vector<int> stepped_;
  // Staged before the optimizer step began, stepped first
  // (See Note [Staged for a step not taken in backward]).
  std::vector<int> first_;
  // hybrid: the layers stepped on the host, ascending (See Note [Hybrid placement]).
  const bool hybrid_;
  std::vector<int> host_layers_;
  // hybrid: what the measured split works from (See Note [Measured split] in split_search.h): the
  // costs the split was chosen from, the layers that may move in the cost model's order, those
  // on the host that may not, the search while it runs, and the steps measured.
  struct Split {
    rt::StepCosts costs;
    std::vector<int> movable;
    std::vector<int> fixed_host;
    std::optional<SplitSearch> search;
    int steps = 0;
    // See Note [Host rate in the step] in hybrid.cpp: the host rate measured at setup once a
    // measured step refit it (costs.rates then holds the step's), else 0.
    double setup_host_params_per_s = 0;
    std::vector<int> before_move;  // host_layers_ before the last move
    bool moved_last = false;       // the last on_step_measured moved steps
  };
  Split split_;
  // The layers stepped on the host with the first k movable ones there, ascending.
  std::vector<int> host_layers_for(int k) const;
  // The cost model's optimizer step with the first k movable layers on the host, from split_'s
  // costs.
  double predicted_seconds(int k) const;
  // See Note [Host rate in the step] in hybrid.cpp: from a measured step's host kernel, the split
  // the cost model then predicts fastest; none where the step gives no host kernel time.
  std::optional<int> refit_host_rate(const rt::StepTimes& times);
  // Steps `host` (ascending) on the host from the next step on: their resident states go home,
  // and the ring and the resident layers are laid out again. A failure leaves the layers stepping
  // where they did.
  absl::Status move_steps(rt::PolicyContext& rt, const std::vector<int>& host);
  std::string describe_search() const;
};

}  // namespace strata::policy::internal
