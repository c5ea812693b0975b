// policies/parameter_streaming.cpp: LayerPrefetch's hooks that stream parameters (and gradients)
// through forward and backward, layer by layer, and hold each layer for the compute that uses it
// (policies/layer_prefetch.h; See Note [Layer prefetch's phases]).
#include <algorithm>

#include "base/status.h"
#include "policies/layer_prefetch.h"

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
  if (pass_ != Pass::kNone) {
    const std::size_t held_at = position(forward_, last_);
    if (pass_ != Pass::kForward || j <= held_at || held_at == forward_.size())
      STRATA_RETURN_IF_ERROR(reset(rt));
  }
  if (pass_ != Pass::kForward) {
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
  if (!streams_parameters() || pass_ == Pass::kNone) return absl::OkStatus();
  enter_backward();
  const std::size_t b = position(backward_, layer);
  if (b == backward_.size() || backward_state_[b] != BackwardState::kPending) {
    return absl::OkStatus();  // nothing of it streams, or its backward has begun already
  }
  backward_state_[b] = BackwardState::kBegun;
  return hold_for_backward(rt, layer).status();
}

absl::Status LayerPrefetch::on_after_backward(rt::PolicyContext& rt, int layer) {
  if (!streams_parameters() || pass_ == Pass::kNone) return absl::OkStatus();
  enter_backward();
  const std::size_t b = position(backward_, layer);
  if (b == backward_.size()) return absl::OkStatus();  // nothing of this layer streams
  STRATA_RETURN_IF_ERROR(release_hold(rt, layer));
  if (states_ == StateStream::kInBackward && rt.is_staged(layer) &&
      rt.layer_bytes(layer, state_roles()) > 0) {
    // It stays until the optimizer released it (See Note [Overlapped backward] in
    // policies/state_streaming.cpp).
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
  if (pass_ != Pass::kForward) return;
  // The last layer forwarded is held; its backward ends at its after_backward, like any other.
  pass_ = Pass::kBackward;
  backward_.assign(forward_.rbegin(), forward_.rend());
  backward_state_.assign(backward_.size(), BackwardState::kPending);
  next_ = std::min<std::size_t>(staged_.size(), backward_.size());
}

absl::Status LayerPrefetch::start_forward(rt::PolicyContext& rt) {
  STRATA_RETURN_IF_ERROR(configure(rt));
  next_ = 0;
  pass_ = Pass::kForward;
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
}  // namespace strata::policy
