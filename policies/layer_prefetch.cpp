// policies/layer_prefetch.cpp: LayerPrefetch's hooks, which stream layers through forward, backward
// and the optimizer step (policies/layer_prefetch.h), and the factories of layer_prefetch and
// hybrid.
#include <algorithm>
#include <optional>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "policies/builtin.h"
#include "policies/layer_prefetch.h"
#include "policies/step_cost_model.h"

namespace strata::policy {
namespace internal {

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

absl::Status LayerPrefetch::on_register(rt::PolicyContext& rt, rt::TensorHandle h) {
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

absl::Status LayerPrefetch::on_begin_step(rt::PolicyContext& rt) {
  STRATA_RETURN_IF_ERROR(reset(rt));
  STRATA_RETURN_IF_ERROR(settle(rt));
  stepped_.clear();
  overlapping_ = overlap();
  ahead_ = !overlapping_ && config().roles == state_roles();
  if (!(overlapping_ || ahead_) || streams_parameters()) return absl::OkStatus();
  // Under overlap the states come in backward order, the first while forward runs (See Note
  // [Overlapped backward]); else in the optimizer step's (See Note [States staged ahead]).
  order_ = streamed_layers(rt, config().roles);
  if (overlapping_) std::reverse(order_.begin(), order_.end());
  STRATA_RETURN_IF_ERROR(configure(rt));
  next_ = 0;
  return refill_optimizer(rt);
}

absl::Status LayerPrefetch::on_before_forward(rt::PolicyContext& rt, int layer) {
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

absl::Status LayerPrefetch::on_before_backward(rt::PolicyContext& rt, int layer) {
  if (!streams_parameters() || (!in_forward_ && !in_backward_)) return absl::OkStatus();
  enter_backward();
  const std::size_t b = position(backward_, layer);
  if (b == backward_.size() || backward_state_[b] != BackwardState::kPending) {
    return absl::OkStatus();  // nothing of it streams, or its backward has begun already
  }
  backward_state_[b] = BackwardState::kBegun;
  return hold_for_backward(rt, layer).status();
}

absl::Status LayerPrefetch::on_after_backward(rt::PolicyContext& rt, int layer) {
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

// Note [States staged ahead]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Without overlap the optimizer step needs every layer's states, and nothing else needs the ring
// while forward and backward run when only the states stream. So begin_step, which a client calls
// before forward (strata-train) or as the first gradient arrives (strata.optim), stages the first
// layers of the optimizer step's order then, as far as the ring holds: their copies run beside
// forward and backward instead of in front of the step. The step then takes them first, as they
// are (See Note [Staged for a step not taken in backward]). A step that ends with no optimizer step
// drops them without a copy back.

// Note [Staged for a step not taken in backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under overlap, begin_step stages the states of the layers backward reaches first, while forward
// runs, for the optimizer to step them in backward. When it does not (the client steps after
// backward this time: See Note [When to step in backward] in strata/_overlap.py), those layers are
// staged as the optimizer step would stage them, with its roles, and nothing wrote them. Sending
// them home and fetching the first layers of the ascending order instead would move their bytes
// over the link twice more for nothing; so the optimizer step takes them first, as they are, and
// then the other layers in ascending order (optimizer_layer_order says so). Each layer's update
// depends on its own values only, so the order changes no result. A step that ends with no
// optimizer step (a micro-batch before the last) drops them without a copy back; their fetch
// during forward is still spent.
absl::Status LayerPrefetch::on_begin_optimizer_step(rt::PolicyContext& rt) {
  const bool untouched = (overlapping_ || ahead_) && !streams_parameters() && stepped_.empty() &&
                         awaiting_.empty() && settled_;
  overlapping_ = false;
  ahead_ = false;
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

std::vector<int> LayerPrefetch::optimizer_layer_order(const rt::PolicyContext& rt) const {
  std::vector<int> out = first_;
  for (int layer : rt.layers()) {
    if (std::find(first_.begin(), first_.end(), layer) == first_.end()) out.push_back(layer);
  }
  return out;
}

absl::Status LayerPrefetch::on_layer_released(rt::PolicyContext& rt, int layer) {
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

absl::Status LayerPrefetch::on_undo_rolled_back(rt::PolicyContext&) {
  stepped_.clear();
  return absl::OkStatus();
}

absl::Status LayerPrefetch::on_end_step(rt::PolicyContext& rt) {
  if ((overlapping_ || ahead_) && !streams_parameters() && stepped_.empty() && awaiting_.empty()) {
    // A micro-batch before the last, or a step with no optimizer step: what begin_step staged was
    // not written, so it goes home without a copy (See Note [Staged for a step not taken in
    // backward] and See Note [States staged ahead]).
    STRATA_RETURN_IF_ERROR(release_held(rt));
    while (!staged_.empty()) STRATA_RETURN_IF_ERROR(unstage(rt, staged_.front(), RoleSet{}));
  }
  overlapping_ = false;
  ahead_ = false;
  return reset(rt);
}

absl::Status LayerPrefetch::on_budget_changed(rt::PolicyContext& rt) {
  settled_ = false;
  return settle(rt);
}

absl::Status LayerPrefetch::on_reload_all(rt::PolicyContext& rt) {
  absl::Status s = configure(rt);
  if (s.code() != absl::StatusCode::kResourceExhausted) return s;
  settled_ = false;
  return settle(rt);
}

absl::Status LayerPrefetch::on_end_optimizer_step(rt::PolicyContext& rt) {
  // Layers the optimizer did not release (it stopped early) go home too.
  STRATA_RETURN_IF_ERROR(reset(rt));
  first_.clear();
  order_.clear();
  next_ = 0;
  stepped_.clear();
  return absl::OkStatus();
}

RoleSet LayerPrefetch::state_roles() const {
  RoleSet out;
  for (Role r : {Role::kOptimizerState, Role::kOther}) {
    if (config().roles.contains(r)) out = out | r;
  }
  return out;
}

RoleSet LayerPrefetch::write_back() const {
  RoleSet out;
  for (Role r : {Role::kParameter, Role::kOptimizerState, Role::kOther}) {
    if (config().roles.contains(r)) out = out | r;
  }
  return out;
}

RoleSet LayerPrefetch::backward_roles() const {
  if (overlap()) return config().roles;  // See Note [Overlapped backward]
  return config().roles.contains(Role::kGradient) ? RoleSet{Role::kParameter, Role::kGradient}
                                                  : RoleSet{Role::kParameter};
}

bool LayerPrefetch::resident(const rt::TensorInfo& info) {
  return info.in_flight ? info.destination == rt::Tier::kGpu && !info.destination_staged
                        : info.tier == rt::Tier::kGpu && !info.staged;
}

absl::Status LayerPrefetch::stage_whole(rt::PolicyContext& rt, int layer, RoleSet roles,
                                        rt::StageOrder order) {
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

absl::StatusOr<bool> LayerPrefetch::hold_for_backward(rt::PolicyContext& rt, int layer) {
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

void LayerPrefetch::enter_backward() {
  if (!in_forward_) return;
  // The last layer forwarded is held; its backward ends at its after_backward, like any other.
  in_forward_ = false;
  in_backward_ = true;
  backward_.assign(forward_.rbegin(), forward_.rend());
  backward_state_.assign(backward_.size(), BackwardState::kPending);
  next_ = std::min<std::size_t>(staged_.size(), backward_.size());
}

absl::Status LayerPrefetch::refill_optimizer(rt::PolicyContext& rt) {
  const std::size_t last = order_.empty() ? 0 : order_.size() - 1;
  return refill(
      rt, order_, [&](std::size_t) { return config().roles; },
      [last](std::size_t k) {
        if (k == 0) return rt::StageOrder::kSmallestFirst;
        return k == last ? rt::StageOrder::kLargestFirst : rt::StageOrder::kRegistered;
      });
}

absl::Status LayerPrefetch::unstage(rt::PolicyContext& rt, int layer, RoleSet write) {
  auto it = std::find(staged_.begin(), staged_.end(), layer);
  if (it == staged_.end()) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(rt.unstage_layer(layer, write));
  staged_.erase(it);
  return absl::OkStatus();
}

absl::Status LayerPrefetch::reset(rt::PolicyContext& rt) {
  STRATA_RETURN_IF_ERROR(release_held(rt));
  RoleSet keep = write_back();
  if (config().roles.contains(Role::kGradient)) keep = keep | Role::kGradient;
  while (!staged_.empty()) STRATA_RETURN_IF_ERROR(unstage(rt, staged_.front(), keep));
  awaiting_.clear();
  in_forward_ = false;
  in_backward_ = false;
  return absl::OkStatus();
}

absl::Status LayerPrefetch::start_forward(rt::PolicyContext& rt) {
  STRATA_RETURN_IF_ERROR(configure(rt));
  next_ = 0;
  in_forward_ = true;
  return refill(
      rt, forward_, [&](std::size_t k) { return forward_roles(k); }, as_registered);
}

absl::Status LayerPrefetch::hold(rt::PolicyContext& rt, int layer, RoleSet roles) {
  STRATA_RETURN_IF_ERROR(rt.hold_layer(layer, roles, rt::Tier::kGpu, rt.compute_stream()));
  held_.push_back({layer, roles});
  last_ = layer;
  return absl::OkStatus();
}

absl::Status LayerPrefetch::release_hold(rt::PolicyContext& rt, int layer) {
  auto it =
      std::find_if(held_.begin(), held_.end(), [&](const Held& h) { return h.layer == layer; });
  if (it == held_.end()) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(rt.release(rt.layer_tensors(it->layer, it->roles), rt.compute_stream()));
  held_.erase(it);
  return absl::OkStatus();
}

absl::Status LayerPrefetch::release_held(rt::PolicyContext& rt) {
  while (!held_.empty()) STRATA_RETURN_IF_ERROR(release_hold(rt, held_.back().layer));
  return absl::OkStatus();
}

}  // namespace internal

namespace {

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
    if (c.roles.contains(rt::Role::kParameter) || c.roles.contains(rt::Role::kGradient)) {
      return absl::InvalidArgumentError(
          str_cat("hybrid streams optimizer states only (its host steps copy parameters and "
                  "gradients where they rest on the GPU); roles ",
                  c.roles.to_string(), " move more: use roles=optimizer_states"));
    }
  }
  return std::unique_ptr<rt::ResidencyPolicy>(
      new internal::LayerPrefetch(c, keep_resident_layers, hybrid));
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
