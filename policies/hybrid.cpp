// policies/hybrid.cpp: the hybrid policy's step placement: LayerPrefetch with some layers' steps
// on the host, chosen by the cost model (policies/layer_prefetch.h, policies/step_cost_model.h).
#include <algorithm>

#include "base/status.h"
#include "base/strings.h"
#include "policies/layer_prefetch.h"
#include "policies/step_cost_model.h"

namespace strata::policy {
namespace internal {

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
absl::StatusOr<std::string> LayerPrefetch::on_place_steps(rt::PolicyContext& rt,
                                                          const rt::StepCosts& costs) {
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

}  // namespace internal

}  // namespace strata::policy
