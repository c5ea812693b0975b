#include <algorithm>
#include <optional>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "policies/builtin.h"
#include "policies/step_cost_model.h"
#include "runtime/runtime.h"

namespace strata::policy {
namespace {

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
// Note [Resident layers]
// ~~~~~~~~~~~~~~~~~~~~~~
// A GPU budget says how much of the GPU strata may use. The ring takes K + 1 layers of it; with
// what the main pool has left, whole layers move there at the start of a step, in ascending order,
// as many as fit, and stay: they never stream, which saves their bytes on the link at every step
// (forward, backward and the optimizer step alike). Without a budget every layer streams: nothing
// says how much of the GPU strata may take. A layer only partly on the GPU streams the rest
// (stage_layer copies only what is not there). Tensors registered later compete with the resident
// layers for the main pool.
//
// Note [Backward out of order]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A staged layer's tensors report their slot as soon as the fetch is queued, and only a hold makes
// the compute stream wait for the fetch, so torch must never touch a layer that is staged and not
// held. after_backward(i) holds the layer forwarded before i, which is right while backward runs in
// the reverse order of forward. It is not for parallel branches: two embeddings summed into the
// first block both run their backward right after the block's, and the second one's fetch
// (prefetched, not held) raced autograd's accumulation into its gradients. So a client that knows
// when a layer's backward begins calls before_backward, which holds the layer (staging it first
// when a slot is free); a layer begun with no slot free is held where it is, at home, and torch
// uses it there. A layer whose backward began or ended is not staged again in the same backward, so
// nothing moves under autograd.
//
// Note [Overlapped backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// With PolicyConfig::overlap kBackward the optimizer steps each layer right after its backward
// (See Note [Overlapped step] in optim/adam.h), so the layer's optimizer states must be on the GPU
// by then and go home while backward goes on:
//   - with parameters streamed, a layer is staged for backward with every role the policy moves
//     (parameters, gradients and states in one slot), and a layer that has states stays staged
//     after its backward until the optimizer released it; that release writes back what the
//     optimizer wrote and the gradients (a redo reads them), and refills the ring with the next
//     backward layer;
//   - with only optimizer states streamed, begin_step stages the states of the last layers (the
//     first of backward) while forward runs, and each release during backward writes a layer back
//     and stages the next in backward order.
// The layers released during backward are left out of the optimizer step that follows it (it
// steps only what backward could not), until rollback_undo says they are to be stepped again.
class LayerPrefetch final : public rt::ResidencyPolicy {
 public:
  LayerPrefetch(const rt::PolicyConfig& c, bool keep_resident_layers, bool hybrid)
      : ResidencyPolicy(c),
        keep_resident_layers_(keep_resident_layers),
        hybrid_(hybrid),
        slots_cap_(static_cast<std::size_t>(c.prefetch_depth) + 1) {}
  std::string_view name() const override { return hybrid_ ? "hybrid" : "layer_prefetch"; }

  // Note [Hybrid placement]
  // ~~~~~~~~~~~~~~~~~~~~~~~
  // hybrid is layer_prefetch with some layers' steps on the host (See Note [Step placement] in
  // runtime/policy.h): the cost model picks them from the optimizer's costs and the measured rates
  // (See Note [Hybrid cost model] in step_cost_model.h), or hybrid_fraction forces the share. A
  // host-stepped layer's states rest in pinned memory and never stream or settle on the GPU: it
  // takes no ring slot and no turn, so the ring and the resident layers are laid out over the
  // layers stepped on the GPU only. The split is chosen over every layer as if each streamed;
  // resident layers, taken in ascending order from what is left, cost the link nothing, so with a
  // budget the split is a bound, not the best. Only optimizer states move: parameters and
  // gradients stay on the GPU, where the host step's copies read and write them.
  bool places_steps() const override { return hybrid_; }
  absl::StatusOr<std::string> on_place_steps(rt::PolicyContext& rt,
                                             const rt::StepCosts& costs) override {
    if (!hybrid_) return std::string();
    STRATA_ASSIGN_OR_RETURN(HybridSplit split,
                            choose_split(costs.rates, costs.layers, config().hybrid_fraction));
    host_layers_.clear();
    for (std::size_t i = 0; i < costs.layers.size(); ++i) {
      if (split.on_host[i]) host_layers_.push_back(costs.layers[i].layer);
    }
    std::sort(host_layers_.begin(), host_layers_.end());
    settled_ = false;
    std::string line = describe(split);
    if (config().hybrid_fraction) {
      str_append(&line, " (hybrid_fraction ", *config().hybrid_fraction, " forced)");
    }
    return line;
  }
  rt::StepPlace step_place(int layer) const override {
    return on_host(layer) ? rt::StepPlace::kHost : rt::StepPlace::kGpu;
  }

  rt::Tier placement(const rt::TensorSpec& spec) const override {
    return config().roles.contains(spec.role) ? rt::Tier::kPinnedHost : spec.home;
  }

  absl::Status on_register(rt::PolicyContext& rt, rt::TensorHandle h) override {
    parameter_layers_.reset();  // recomputed at the next forward
    settled_ = false;           // the new tensor's layer may fit the main pool
    STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, rt.info(h));
    if (!config().roles.contains(info.spec.role)) return absl::OkStatus();
    const std::size_t layer = rt.layer_bytes(info.spec.layer, config().roles);
    const std::size_t budget = rt.gpu_budget();
    if (budget != alloc::kNoBudget && layer > budget) {
      return absl::InvalidArgumentError(
          str_cat("layer_prefetch: the GPU budget (", format_bytes(budget),
                  ") is smaller than one layer: layer ", info.spec.layer, " has ",
                  format_bytes(layer), " of ", config().roles.to_string()));
    }
    return absl::OkStatus();
  }

  absl::Status on_prepare(rt::PolicyContext& rt) override { return settle(rt); }

  absl::Status on_begin_step(rt::PolicyContext& rt) override {
    STRATA_RETURN_IF_ERROR(reset(rt));
    STRATA_RETURN_IF_ERROR(settle(rt));
    stepped_.clear();
    overlapping_ = overlap();
    if (!overlapping_ || streams_parameters()) return absl::OkStatus();
    // States come in backward order, the first while forward runs (See Note [Overlapped backward]).
    order_ = streamed_layers(rt, config().roles);
    std::reverse(order_.begin(), order_.end());
    STRATA_RETURN_IF_ERROR(configure(rt));
    next_ = 0;
    return refill_optimizer(rt);
  }

  absl::Status on_before_forward(rt::PolicyContext& rt, int layer) override {
    if (!streams_parameters()) return absl::OkStatus();
    // The layers whose parameters stream change only when tensors are registered: scanning them
    // at every hook would cost O(layers^2) per forward.
    if (!parameter_layers_) parameter_layers_ = streamed_layers(rt, RoleSet{Role::kParameter});
    const std::vector<int>& streamed = *parameter_layers_;
    const std::size_t j = position(streamed, layer);
    if (j == streamed.size()) return absl::OkStatus();  // nothing of this layer streams
    // A forward that starts over (evaluation before training, a module run twice, recompute in
    // backward) finds the ring as the last pass left it: put everything home and start again.
    if (in_forward_ || in_backward_) {
      const std::size_t held_at = position(forward_, last_);
      if (!in_forward_ || j <= held_at || held_at == forward_.size())
        STRATA_RETURN_IF_ERROR(reset(rt));
    }
    if (!in_forward_) {
      forward_ = streamed;
      STRATA_RETURN_IF_ERROR(start_forward(rt));
    }
    if (!held_.empty()) {
      STRATA_RETURN_IF_ERROR(release_held(rt));
      const std::size_t prev = position(forward_, last_);
      if (!kept_for_backward(prev)) {
        STRATA_RETURN_IF_ERROR(unstage(rt, last_, RoleSet()));  // read only: drop
        STRATA_RETURN_IF_ERROR(refill(
            rt, forward_, [&](std::size_t k) { return forward_roles(k); }, as_registered));
      }
    }
    return hold(rt, layer, forward_roles(j));
  }

  // See Note [Backward out of order].
  absl::Status on_before_backward(rt::PolicyContext& rt, int layer) override {
    if (!streams_parameters() || (!in_forward_ && !in_backward_)) return absl::OkStatus();
    enter_backward();
    const std::size_t b = position(backward_, layer);
    if (b == backward_.size() || backward_state_[b] != BackwardState::kPending) {
      return absl::OkStatus();  // nothing of it streams, or its backward has begun already
    }
    backward_state_[b] = BackwardState::kBegun;
    return hold_for_backward(rt, layer).status();
  }

  absl::Status on_after_backward(rt::PolicyContext& rt, int layer) override {
    if (!streams_parameters() || (!in_forward_ && !in_backward_)) return absl::OkStatus();
    enter_backward();
    const std::size_t b = position(backward_, layer);
    if (b == backward_.size()) return absl::OkStatus();  // nothing of this layer streams
    STRATA_RETURN_IF_ERROR(release_hold(rt, layer));
    if (overlapping_ && rt.is_staged(layer) && rt.layer_bytes(layer, state_roles()) > 0) {
      // It stays until the optimizer released it (See Note [Overlapped backward]).
      if (std::find(awaiting_.begin(), awaiting_.end(), layer) == awaiting_.end()) {
        awaiting_.push_back(layer);
      }
    } else {
      STRATA_RETURN_IF_ERROR(unstage(rt, layer, RoleSet{Role::kGradient}));
    }
    backward_state_[b] = BackwardState::kDone;
    STRATA_RETURN_IF_ERROR(refill(
        rt, backward_, [&](std::size_t) { return backward_roles(); }, as_registered));
    if (b + 1 < backward_.size()) {
      // Backward in the reverse order of forward comes to this layer next; begun ones are held
      // already (before_backward).
      if (backward_state_[b + 1] != BackwardState::kPending) return absl::OkStatus();
      STRATA_ASSIGN_OR_RETURN(const bool at_home, hold_for_backward(rt, backward_[b + 1]));
      // Not staged now, so this backward will not stage it: its backward is as good as begun.
      if (at_home) backward_state_[b + 1] = BackwardState::kBegun;
    }
    return absl::OkStatus();
  }

  // Note [Staged for a step not taken in backward]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // Under overlap, begin_step stages the states of the layers backward reaches first, while forward
  // runs, for the optimizer to step them in backward. When it does not (the client steps after
  // backward this time: strata.optim's Note [When to step in backward]), those layers are staged
  // as the optimizer step would stage them, with its roles, and nothing wrote them. Sending them
  // home and fetching the first layers of the ascending order instead would move their bytes over
  // the link twice more for nothing; so the optimizer step takes them first, as they are, and
  // then the other layers in ascending order (optimizer_layer_order says so). Each layer's update
  // depends on its own values only, so the order changes no result. A step that ends with no
  // optimizer step (a micro-batch before the last) drops them without a copy back; their fetch
  // during forward is still spent.
  absl::Status on_begin_optimizer_step(rt::PolicyContext& rt) override {
    const bool untouched =
        overlapping_ && !streams_parameters() && stepped_.empty() && awaiting_.empty() && settled_;
    overlapping_ = false;
    first_.clear();
    if (untouched) {
      STRATA_RETURN_IF_ERROR(release_held(rt));
      first_ = staged_;
    } else {
      STRATA_RETURN_IF_ERROR(reset(rt));
      STRATA_RETURN_IF_ERROR(settle(rt));
    }
    order_.clear();
    const std::vector<int> streamed = streamed_layers(rt, config().roles);
    for (int layer : optimizer_layer_order(rt)) {
      // What backward stepped is not fetched again (See Note [Overlapped backward]).
      if (std::find(stepped_.begin(), stepped_.end(), layer) != stepped_.end()) continue;
      if (std::binary_search(streamed.begin(), streamed.end(), layer)) order_.push_back(layer);
    }
    if (first_.empty()) STRATA_RETURN_IF_ERROR(configure(rt));
    next_ = first_.size();  // See Note [Staged for a step not taken in backward]
    return refill_optimizer(rt);
  }

  // The layers staged before the optimizer step began first, then the others in ascending order
  // (See Note [Staged for a step not taken in backward]).
  std::vector<int> optimizer_layer_order(const rt::PolicyContext& rt) const override {
    std::vector<int> out = first_;
    for (int layer : rt.layers()) {
      if (std::find(first_.begin(), first_.end(), layer) == first_.end()) out.push_back(layer);
    }
    return out;
  }

  absl::Status on_layer_released(rt::PolicyContext& rt, int layer) override {
    if (!overlapping_) {
      STRATA_RETURN_IF_ERROR(unstage(rt, layer, write_back()));
      return refill_optimizer(rt);
    }
    // Stepped during backward; the gradients go home too, for a redo
    // (See Note [Overlapped backward]).
    RoleSet home = write_back();
    if (config().roles.contains(Role::kGradient)) home = home | Role::kGradient;
    STRATA_RETURN_IF_ERROR(unstage(rt, layer, home));
    std::erase(awaiting_, layer);
    if (std::find(stepped_.begin(), stepped_.end(), layer) == stepped_.end()) {
      stepped_.push_back(layer);
    }
    if (!streams_parameters()) return refill_optimizer(rt);
    if (!in_backward_) return absl::OkStatus();
    return refill(
        rt, backward_, [&](std::size_t) { return backward_roles(); }, as_registered);
  }

  absl::Status on_undo_rolled_back(rt::PolicyContext&) override {
    stepped_.clear();
    return absl::OkStatus();
  }

  // A step that ends without an optimizer step (evaluation) leaves nothing held or staged.
  absl::Status on_end_step(rt::PolicyContext& rt) override {
    if (overlapping_ && !streams_parameters() && stepped_.empty() && awaiting_.empty()) {
      // A micro-batch before the last: what forward staged for backward was not written, so it
      // goes home without a copy (See Note [Staged for a step not taken in backward]).
      STRATA_RETURN_IF_ERROR(release_held(rt));
      while (!staged_.empty()) STRATA_RETURN_IF_ERROR(unstage(rt, staged_.front(), RoleSet{}));
    }
    overlapping_ = false;
    return reset(rt);
  }

  // Runtime::set_gpu_budget: the ring and the resident layers laid out again under the new budget.
  absl::Status on_budget_changed(rt::PolicyContext& rt) override {
    settled_ = false;
    return settle(rt);
  }

  // Phase switches (See Note [Phase switches] in runtime/phase.cpp): nothing staged or held while
  // the runtime moves tensors; then the ring comes back as it was (the resident layers are back in
  // the main pool by then), or as settle finds room for it.
  absl::Status on_offload_all(rt::PolicyContext& rt) override { return reset(rt); }
  absl::Status on_reload_all(rt::PolicyContext& rt) override {
    absl::Status s = configure(rt);
    if (s.code() != absl::StatusCode::kResourceExhausted) return s;
    settled_ = false;
    return settle(rt);
  }

  absl::Status on_end_optimizer_step(rt::PolicyContext& rt) override {
    // Layers the optimizer did not release (it stopped early) go home too.
    STRATA_RETURN_IF_ERROR(reset(rt));
    first_.clear();
    order_.clear();
    next_ = 0;
    stepped_.clear();
    return absl::OkStatus();
  }

 private:
  bool streams_parameters() const { return config().roles.contains(Role::kParameter); }
  bool on_host(int layer) const {
    return std::binary_search(host_layers_.begin(), host_layers_.end(), layer);
  }
  bool overlap() const { return config().overlap == rt::Overlap::kBackward; }
  // The optimizer's states among the roles this policy moves.
  RoleSet state_roles() const {
    RoleSet out;
    for (Role r : {Role::kOptimizerState, Role::kOther}) {
      if (config().roles.contains(r)) out = out | r;
    }
    return out;
  }
  // The optimizer writes parameters and moments; it only reads gradients.
  RoleSet write_back() const {
    RoleSet out;
    for (Role r : {Role::kParameter, Role::kOptimizerState, Role::kOther}) {
      if (config().roles.contains(r)) out = out | r;
    }
    return out;
  }
  RoleSet backward_roles() const {
    if (overlap()) return config().roles;  // See Note [Overlapped backward]
    return config().roles.contains(Role::kGradient) ? RoleSet{Role::kParameter, Role::kGradient}
                                                    : RoleSet{Role::kParameter};
  }
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
  static bool resident(const rt::TensorInfo& info) {
    return info.in_flight ? info.destination == rt::Tier::kGpu && !info.destination_staged
                          : info.tier == rt::Tier::kGpu && !info.staged;
  }

  // Layers with bytes of `roles` that are not resident, in ascending order: the others take no
  // slot and no turn, and nor do layers stepped on the host (See Note [Hybrid placement]).
  std::vector<int> streamed_layers(const rt::PolicyContext& rt, RoleSet roles) const {
    std::vector<int> out;
    for (int layer : rt.layers()) {
      if (on_host(layer)) continue;
      for (rt::TensorHandle h : rt.layer_tensors(layer, roles)) {
        absl::StatusOr<rt::TensorInfo> info = rt.info(h);
        if (info.ok() && info->bytes > 0 && !resident(*info)) {
          out.push_back(layer);
          break;
        }
      }
    }
    return out;
  }

  // Note [Ring under a budget]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~
  // Once per change in the registry, the ring takes as many slots as fit the GPU budget beside what
  // the main pool holds, K + 1 at most and one at least (fewer slots prefetch less but stream the
  // same bytes); a budget in which not even one slot fits is an error here, at setup. Then whole
  // layers move into what is left (See Note [Resident layers]), in ascending order, as many as fit
  // (the allocator refuses what would pass the budget). Nothing may be staged meanwhile. The ring
  // comes first: when layers made resident by an earlier settle leave it fewer than K + 1 slots,
  // they go home and the slots are counted again. Otherwise a role registered after a first step
  // (gradients, in a loop that registers them once backward made them) would find the main pool
  // full of the layers that settled without it, and the ring cut down to what is left: fewer layers
  // prefetched, and in an overlapped step each fetch waiting for a write-back to free its slot.
  absl::Status settle(rt::PolicyContext& rt) {
    if (settled_) return absl::OkStatus();
    STRATA_RETURN_IF_ERROR(reset(rt));
    absl::Status fit = fit_ring(rt);
    if (!fit.ok() || slots_cap_ < wanted_slots(rt)) {
      STRATA_ASSIGN_OR_RETURN(const bool moved, unsettle_residents(rt));
      if (moved) fit = fit_ring(rt);
    }
    if (!fit.ok()) {
      return absl::Status(fit.code(),
                          str_cat("layer_prefetch: the GPU budget (", format_bytes(rt.gpu_budget()),
                                  ") has no room for even one staging slot beside "
                                  "what stays on the GPU: ",
                                  fit.message()));
    }
    if (keep_resident_layers_ && rt.gpu_budget() != alloc::kNoBudget) {
      STRATA_RETURN_IF_ERROR(settle_residents(rt));
    }
    settled_ = true;
    return absl::OkStatus();
  }

  // The second part of settle (See Note [Resident layers]).
  absl::Status settle_residents(rt::PolicyContext& rt) {
    bool moved = false;
    for (int layer : rt.layers()) {
      if (on_host(layer)) continue;  // See Note [Hybrid placement]
      for (rt::TensorHandle h : rt.layer_tensors(layer, config().roles)) {
        STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, rt.info(h));
        if (info.bytes == 0 || resident(info)) continue;
        absl::Status s = rt.migrate(h, rt::Tier::kGpu);
        // No room left (a segment would pass the budget): the rest of this layer streams.
        if (s.code() == absl::StatusCode::kResourceExhausted) break;
        STRATA_RETURN_IF_ERROR(s);
        moved = true;
      }
    }
    if (!moved) return absl::OkStatus();
    // One host wait, at setup: the ring's slot count and the forward order are computed from where
    // the tensors are.
    STRATA_RETURN_IF_ERROR(rt.wait_all());
    parameter_layers_.reset();
    return configure(rt);
  }

  // K + 1 slots, or one for each layer that streams when fewer do.
  std::size_t wanted_slots(const rt::PolicyContext& rt) const {
    return std::min<std::size_t>(
        config().prefetch_depth + 1,
        std::max<std::size_t>(streamed_layers(rt, config().roles).size(), 1));
  }

  // Configures the most slots that fit, wanted_slots() at most; configure's error when not even
  // one does.
  absl::Status fit_ring(rt::PolicyContext& rt) {
    absl::Status fit;
    for (std::size_t slots = wanted_slots(rt); slots >= 1; --slots) {
      slots_cap_ = slots;
      fit = configure(rt);
      if (fit.code() != absl::StatusCode::kResourceExhausted) break;
    }
    return fit;
  }

  // Sends the layers settle_residents moved to the main pool home (the roles this policy moves
  // rest in pinned memory) and waits for the copies, so that their memory is free for the ring.
  // Whether anything moved.
  absl::StatusOr<bool> unsettle_residents(rt::PolicyContext& rt) {
    bool moved = false;
    for (int layer : rt.layers()) {
      for (rt::TensorHandle h : rt.layer_tensors(layer, config().roles)) {
        STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, rt.info(h));
        if (info.bytes == 0 || !resident(info)) continue;
        STRATA_RETURN_IF_ERROR(rt.migrate(h, placement(info.spec)));
        moved = true;
      }
    }
    if (!moved) return false;
    parameter_layers_.reset();
    STRATA_RETURN_IF_ERROR(rt.wait_all());  // one host wait, at setup, as settle_residents'
    return true;
  }

  // As many slots as settle found room for (K + 1 at most), or fewer when fewer layers stream.
  absl::Status configure(rt::PolicyContext& rt) {
    const std::size_t layers = streamed_layers(rt, config().roles).size();
    slots_ = std::max<std::size_t>(1, std::min(slots_cap_, std::max<std::size_t>(layers, 1)));
    return rt.configure_staging(static_cast<int>(slots_), config().roles);
  }

  // Stages layers of `order` from next_ on while the ring has room: layer k with roles_of(k), its
  // copies in stage_order(k). In backward, a layer whose backward began is skipped
  // (See Note [Backward out of order]).
  template <typename RolesOf, typename StageOrderOf>
  absl::Status refill(rt::PolicyContext& rt, const std::vector<int>& order, RolesOf roles_of,
                      StageOrderOf stage_order) {
    while (staged_.size() < slots_ && next_ < order.size()) {
      if (in_backward_ && &order == &backward_ &&
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
  absl::Status stage_whole(rt::PolicyContext& rt, int layer, RoleSet roles, rt::StageOrder order) {
    const bool had_slot = rt.is_staged(layer);
    absl::Status s = rt.stage_layer(layer, roles, order);
    if (!s.ok()) {
      // A layer staged part way keeps its slot (the runtime leaves what was queued in place).
      // Take it back out, so this layer is either staged whole or not at all and the next call
      // starts it again; its home copy was never touched.
      // If even that fails (a device error), the layer is listed as staged, so that the next
      // reset puts it home.
      if (!had_slot && rt.is_staged(layer) && !rt.unstage_layer(layer, RoleSet()).ok() &&
          std::find(staged_.begin(), staged_.end(), layer) == staged_.end()) {
        staged_.push_back(layer);
      }
      return s;
    }
    if (std::find(staged_.begin(), staged_.end(), layer) == staged_.end()) {
      staged_.push_back(layer);
    }
    return absl::OkStatus();
  }

  // Holds `layer` for its backward (See Note [Backward out of order]): in its slot, staged first
  // when a slot is free, else where it is, at home, waiting for any copy still arriving there.
  // Returns whether it is held at home.
  absl::StatusOr<bool> hold_for_backward(rt::PolicyContext& rt, int layer) {
    if (is_held(layer)) return false;
    if (rt.is_staged(layer)) {
      // Staged in forward with its parameters only, when the ring held fewer layers.
      STRATA_RETURN_IF_ERROR(rt.stage_layer(layer, backward_roles()));
    } else if (staged_.size() < slots_) {
      STRATA_RETURN_IF_ERROR(stage_whole(rt, layer, backward_roles(), rt::StageOrder::kRegistered));
    } else {
      STRATA_RETURN_IF_ERROR(rt.hold_layer_in_place(layer, backward_roles(), rt.compute_stream()));
      held_.push_back({layer, backward_roles()});
      return true;
    }
    STRATA_RETURN_IF_ERROR(hold(rt, layer, backward_roles()));
    return false;
  }

  // Forward is over at the first backward hook: its last layers are staged, so backward starts
  // that far in.
  void enter_backward() {
    if (!in_forward_) return;
    // The last layer forwarded is held; its backward ends at its after_backward, like any other.
    in_forward_ = false;
    in_backward_ = true;
    backward_.assign(forward_.rbegin(), forward_.rend());
    backward_state_.assign(backward_.size(), BackwardState::kPending);
    next_ = std::min<std::size_t>(staged_.size(), backward_.size());
  }

  static rt::StageOrder as_registered(std::size_t) { return rt::StageOrder::kRegistered; }

  // The optimizer step streams order_ with the configured roles. The first layer comes smallest
  // tensor first, so the first kernel starts soonest; the last comes smallest tensor last, so the
  // last write-back, which nothing overlaps, is the shortest (See Note [Staging order] in
  // runtime/runtime.h).
  absl::Status refill_optimizer(rt::PolicyContext& rt) {
    const std::size_t last = order_.empty() ? 0 : order_.size() - 1;
    return refill(
        rt, order_, [&](std::size_t) { return config().roles; },
        [last](std::size_t k) {
          if (k == 0) return rt::StageOrder::kSmallestFirst;
          return k == last ? rt::StageOrder::kLargestFirst : rt::StageOrder::kRegistered;
        });
  }

  absl::Status unstage(rt::PolicyContext& rt, int layer, RoleSet write) {
    auto it = std::find(staged_.begin(), staged_.end(), layer);
    if (it == staged_.end()) return absl::OkStatus();
    STRATA_RETURN_IF_ERROR(rt.unstage_layer(layer, write));
    staged_.erase(it);
    return absl::OkStatus();
  }

  // Releases what is held and sends every staged layer home (gradients and whatever the optimizer
  // writes are copied back, parameters read in forward are dropped).
  absl::Status reset(rt::PolicyContext& rt) {
    STRATA_RETURN_IF_ERROR(release_held(rt));
    RoleSet keep = write_back();
    if (config().roles.contains(Role::kGradient)) keep = keep | Role::kGradient;
    while (!staged_.empty()) STRATA_RETURN_IF_ERROR(unstage(rt, staged_.front(), keep));
    awaiting_.clear();
    in_forward_ = false;
    in_backward_ = false;
    return absl::OkStatus();
  }

  absl::Status start_forward(rt::PolicyContext& rt) {
    STRATA_RETURN_IF_ERROR(configure(rt));
    next_ = 0;
    in_forward_ = true;
    return refill(
        rt, forward_, [&](std::size_t k) { return forward_roles(k); }, as_registered);
  }

  // The compute stream waits for the layer's data; the runtime keeps it in place until released.
  absl::Status hold(rt::PolicyContext& rt, int layer, RoleSet roles) {
    STRATA_RETURN_IF_ERROR(rt.hold_layer(layer, roles, rt::Tier::kGpu, rt.compute_stream()));
    held_.push_back({layer, roles});
    last_ = layer;
    return absl::OkStatus();
  }

  bool is_held(int layer) const {
    return std::any_of(held_.begin(), held_.end(), [&](const Held& h) { return h.layer == layer; });
  }

  // Everything queued on the compute stream until this hook (the held layer's forward or backward)
  // may use the data; later moves wait for it. All or nothing per layer, so a failure leaves the
  // layer held and this can run again.
  absl::Status release_hold(rt::PolicyContext& rt, int layer) {
    auto it =
        std::find_if(held_.begin(), held_.end(), [&](const Held& h) { return h.layer == layer; });
    if (it == held_.end()) return absl::OkStatus();
    STRATA_RETURN_IF_ERROR(rt.release(rt.layer_tensors(it->layer, it->roles), rt.compute_stream()));
    held_.erase(it);
    return absl::OkStatus();
  }

  absl::Status release_held(rt::PolicyContext& rt) {
    while (!held_.empty()) STRATA_RETURN_IF_ERROR(release_hold(rt, held_.back().layer));
    return absl::OkStatus();
  }

  // Layers with parameters (a layer whose tensors were all unregistered since stays listed;
  // staging and holding it do nothing).
  std::optional<std::vector<int>> parameter_layers_;
  const bool keep_resident_layers_;  // See Note [Resident layers]
  bool settled_ = false;             // See Note [Resident layers]; done for what is registered now
  std::vector<int> order_;           // optimizer order, layers that stream only
  std::vector<int> forward_;         // forward order, layers whose parameters stream
  std::vector<int> backward_;        // backward order
  std::vector<int> staged_;          // layers this policy staged, oldest first
  std::size_t next_ = 0;             // next layer to stage in the current phase
  std::size_t slots_ = 1;            // slots of the ring
  // The most slots the budget leaves room for (See Note [Ring under a budget]).
  std::size_t slots_cap_;
  bool in_forward_ = false;
  bool in_backward_ = false;
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
  // Between begin_step and the optimizer step under kBackward; layers staged after their backward
  // until their release; layers released so far (See Note [Overlapped backward]).
  bool overlapping_ = false;
  std::vector<int> awaiting_;
  std::vector<int> stepped_;
  // Staged before the optimizer step began, stepped first
  // (See Note [Staged for a step not taken in backward]).
  std::vector<int> first_;
  // hybrid: the layers stepped on the host, ascending (See Note [Hybrid placement]).
  const bool hybrid_;
  std::vector<int> host_layers_;
};

absl::StatusOr<std::unique_ptr<rt::ResidencyPolicy>> make(const rt::PolicyConfig& c,
                                                          bool keep_resident_layers, bool hybrid) {
  if (c.prefetch_depth < 0) {
    return absl::InvalidArgumentError(str_cat("layer_prefetch: prefetch depth ", c.prefetch_depth,
                                              " is negative; use 0 (no prefetch) or more"));
  }
  if (c.roles.empty()) {
    return absl::InvalidArgumentError("layer_prefetch: roles to stream must not be empty");
  }
  if (c.hybrid_fraction && !hybrid) {
    return absl::InvalidArgumentError(
        "hybrid_fraction places optimizer steps on the GPU or the host; only the hybrid policy "
        "does that (policy=\"hybrid\")");
  }
  if (hybrid) {
    const std::optional<double> f = c.hybrid_fraction;
    if (f && !(*f >= 0.0 && *f <= 1.0)) {
      return absl::InvalidArgumentError(
          str_cat("hybrid: hybrid_fraction ", *f,
                  " is not in [0, 1] (the share of parameters stepped on the GPU)"));
    }
    if (c.roles.contains(Role::kParameter) || c.roles.contains(Role::kGradient)) {
      return absl::InvalidArgumentError(
          str_cat("hybrid streams optimizer states only (its host steps copy parameters and "
                  "gradients where they rest on the GPU); roles ",
                  c.roles.to_string(), " move more: use roles=optimizer_states"));
    }
  }
  return std::unique_ptr<rt::ResidencyPolicy>(new LayerPrefetch(c, keep_resident_layers, hybrid));
}
}  // namespace

absl::StatusOr<std::unique_ptr<rt::ResidencyPolicy>> make_layer_prefetch(
    const rt::PolicyConfig& c) {
  return make(c, /*keep_resident_layers=*/true, /*hybrid=*/false);
}

absl::StatusOr<std::unique_ptr<rt::ResidencyPolicy>> make_hybrid(const rt::PolicyConfig& c) {
  return make(c, /*keep_resident_layers=*/true, /*hybrid=*/true);
}

absl::StatusOr<std::unique_ptr<rt::ResidencyPolicy>> make_layer_streamer(
    const rt::PolicyConfig& c) {
  return make(c, /*keep_resident_layers=*/false, /*hybrid=*/false);
}

}  // namespace strata::policy
