// policies/state_streaming.cpp: LayerPrefetch's hooks that stream the optimizer's states: staged
// for steps taken in backward, staged ahead of the step after it, and through the ring during the
// optimizer step (policies/layer_prefetch.h; See Note [Layer prefetch's phases]).
#include <algorithm>

#include "base/status.h"
#include "policies/layer_prefetch.h"

namespace strata::policy {
namespace internal {

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

absl::Status LayerPrefetch::on_begin_step(rt::PolicyContext& rt) {
  STRATA_RETURN_IF_ERROR(reset(rt));
  STRATA_RETURN_IF_ERROR(settle(rt));
  stepped_.clear();
  states_ = overlap()                         ? StateStream::kInBackward
            : config().roles == state_roles() ? StateStream::kAhead
                                              : StateStream::kInStep;
  if (states_ == StateStream::kInStep || streams_parameters()) return absl::OkStatus();
  // Under overlap the states come in backward order, the first while forward runs (See Note
  // [Overlapped backward]); else in the optimizer step's (See Note [States staged ahead]).
  order_ = streamed_layers(rt, config().roles);
  if (states_ == StateStream::kInBackward) std::reverse(order_.begin(), order_.end());
  STRATA_RETURN_IF_ERROR(configure(rt));
  next_ = 0;
  return refill_optimizer(rt);
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
// backward this time: See Note [When to step in backward] in strata/_when.py), or steps only
// the first of them there (See Note [A share of the step in backward] in optim/adam_overlap.cpp),
// the layers still staged are staged as the optimizer step would stage them, with its roles, and
// nothing wrote them: each layer the optimizer stepped in backward went home at its release.
// Sending them home and fetching the first layers of the ascending order instead would move their
// bytes over the link twice more for nothing; so the optimizer step takes them first, as they are,
// and then the other layers in ascending order (optimizer_layer_order says so). Each layer's update
// depends on its own values only, so the order changes no result. A step that ends with no
// optimizer step (a micro-batch before the last) drops them without a copy back; their fetch
// during forward is still spent.
absl::Status LayerPrefetch::on_begin_optimizer_step(rt::PolicyContext& rt) {
  const bool untouched =
      states_ != StateStream::kInStep && !streams_parameters() && awaiting_.empty() && settled_;
  states_ = StateStream::kInStep;
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
  if (states_ != StateStream::kInBackward) {
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
  if (pass_ != Pass::kBackward) return absl::OkStatus();
  return refill(
      rt, backward_, [&](std::size_t) { return backward_roles(); }, as_registered);
}

absl::Status LayerPrefetch::on_undo_rolled_back(rt::PolicyContext&) {
  stepped_.clear();
  return absl::OkStatus();
}

absl::Status LayerPrefetch::on_end_step(rt::PolicyContext& rt) {
  if (states_ != StateStream::kInStep && !streams_parameters() && stepped_.empty() &&
      awaiting_.empty()) {
    // A micro-batch before the last, or a step with no optimizer step: what begin_step staged was
    // not written, so it goes home without a copy (See Note [Staged for a step not taken in
    // backward] and See Note [States staged ahead]).
    STRATA_RETURN_IF_ERROR(release_held(rt));
    while (!staged_.empty()) STRATA_RETURN_IF_ERROR(unstage(rt, staged_.front(), RoleSet{}));
  }
  states_ = StateStream::kInStep;
  return reset(rt);
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

absl::Status LayerPrefetch::refill_optimizer(rt::PolicyContext& rt) {
  const std::size_t last = order_.empty() ? 0 : order_.size() - 1;
  return refill(
      rt, order_, [&](std::size_t) { return config().roles; },
      [last](std::size_t k) {
        if (k == 0) return rt::StageOrder::kSmallestFirst;
        return k == last ? rt::StageOrder::kLargestFirst : rt::StageOrder::kRegistered;
      });
}

}  // namespace internal
}  // namespace strata::policy
