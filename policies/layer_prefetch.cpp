#include <algorithm>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

namespace strata::policy {
namespace {

// Optimizer states (or the configured roles) rest in pinned host memory. At the optimizer step the
// first K + 1 layers are staged; each time the optimizer releases a layer, that layer is written
// back and the next one in order is staged into the slot it frees (Note [Staging ring] in
// runtime.h), so the copies in both directions run while the optimizer computes and the GPU holds
// at most K + 1 layers of states.
class LayerPrefetch final : public rt::ResidencyPolicy {
 public:
  explicit LayerPrefetch(const rt::PolicyConfig& c) : ResidencyPolicy(c) {}
  std::string_view name() const override { return "layer_prefetch"; }

  rt::Tier placement(const rt::TensorSpec& spec) const override {
    return config().roles.contains(spec.role) ? rt::Tier::kPinnedHost : spec.home;
  }

  absl::Status on_register(rt::Runtime& rt, rt::TensorHandle h) override {
    STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, rt.info(h));
    if (!config().roles.contains(info.spec.role)) return absl::OkStatus();
    const std::size_t layer = rt.layer_bytes(info.spec.layer, config().roles);
    const std::size_t budget = rt.allocator().pool(rt::Tier::kGpu).budget();
    if (budget != alloc::kNoBudget && layer > budget) {
      return absl::InvalidArgumentError(str_cat(
          "layer_prefetch: the GPU budget (", format_bytes(budget),
          ") is smaller than one layer: "
          "layer ",
          info.spec.layer, " has ", format_bytes(layer), " of ", config().roles.to_string()));
    }
    return absl::OkStatus();
  }

  absl::Status on_begin_optimizer_step(rt::Runtime& rt) override {
    STRATA_RETURN_IF_ERROR(rt.configure_staging(config().prefetch_depth + 1, config().roles));
    order_ = rt.optimizer_layer_order();
    next_ = 0;
    for (int i = 0; i <= config().prefetch_depth && next_ < order_.size(); ++i) {
      STRATA_RETURN_IF_ERROR(rt.stage_layer(order_[next_++]));
    }
    return absl::OkStatus();
  }

  absl::Status on_layer_released(rt::Runtime& rt, int layer) override {
    if (!rt.is_staged(layer)) return absl::OkStatus();
    STRATA_RETURN_IF_ERROR(rt.unstage_layer(layer));
    if (next_ < order_.size()) STRATA_RETURN_IF_ERROR(rt.stage_layer(order_[next_++]));
    return absl::OkStatus();
  }

  absl::Status on_end_optimizer_step(rt::Runtime& rt) override {
    // Layers the optimizer did not release (it stopped early) go home too.
    for (int layer : order_) {
      if (rt.is_staged(layer)) STRATA_RETURN_IF_ERROR(rt.unstage_layer(layer));
    }
    order_.clear();
    next_ = 0;
    return absl::OkStatus();
  }

 private:
  std::vector<int> order_;
  std::size_t next_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<rt::ResidencyPolicy>> make_layer_prefetch(
    const rt::PolicyConfig& c) {
  if (c.prefetch_depth < 0) {
    return absl::InvalidArgumentError(str_cat("layer_prefetch: prefetch depth ", c.prefetch_depth,
                                              " is negative; use 0 (no prefetch) or more"));
  }
  if (c.roles.empty()) {
    return absl::InvalidArgumentError("layer_prefetch: roles to stream must not be empty");
  }
  return std::unique_ptr<rt::ResidencyPolicy>(new LayerPrefetch(c));
}

}  // namespace strata::policy
