#include <algorithm>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

namespace strata::policy {
namespace {

using rt::Role;
using rt::RoleSet;

// Tensors of the configured roles (optimizer states by default) rest in pinned host memory and go
// through the staging ring (Note [Staging ring] in runtime.h):
//   - optimizer step: the first K + 1 layers are staged; each time the optimizer releases a layer
//     it is written back (gradients, which Adam only reads, are dropped) and the next layer in
//     order is staged into the slot it frees;
//   - with parameters among the roles, forward and backward stream too: before forward of layer i
//     its parameters are held on the GPU and layer i + K + 1's are fetched; parameters are only
//     read there, so they are dropped, not written back. The last K + 1 layers stay for backward,
//     together with their gradients; after backward of layer i its gradients are written back and
//     the next backward layer is fetched. A model whose parameters do not fit the GPU thus trains
//     with K + 1 layers of it on the GPU at a time.
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
      return absl::InvalidArgumentError(
          str_cat("layer_prefetch: the GPU budget (", format_bytes(budget),
                  ") is smaller than one layer: layer ", info.spec.layer, " has ",
                  format_bytes(layer), " of ", config().roles.to_string()));
    }
    return absl::OkStatus();
  }

  absl::Status on_before_forward(rt::Runtime& rt, int layer) override {
    if (!streams_parameters()) return absl::OkStatus();
    if (!in_forward_) STRATA_RETURN_IF_ERROR(start_forward(rt));
    const std::size_t j = position(forward_, layer);
    if (held_ >= 0) {
      STRATA_RETURN_IF_ERROR(release_held(rt));
      const std::size_t prev = position(forward_, last_);
      if (!kept_for_backward(prev)) {
        STRATA_RETURN_IF_ERROR(rt.unstage_layer(last_, RoleSet()));  // read only: drop
        if (next_ < forward_.size()) {
          STRATA_RETURN_IF_ERROR(rt.stage_layer(forward_[next_], forward_roles(next_)));
          ++next_;
        }
      }
    }
    return hold(rt, layer, forward_roles(j));
  }

  absl::Status on_after_backward(rt::Runtime& rt, int layer) override {
    if (!streams_parameters()) return absl::OkStatus();
    if (in_forward_) {
      // Forward is over: the last K + 1 layers are staged, so backward starts K + 1 layers in.
      in_forward_ = false;
      backward_.assign(forward_.rbegin(), forward_.rend());
      next_ = std::min<std::size_t>(config().prefetch_depth + 1, backward_.size());
    }
    if (held_ >= 0) STRATA_RETURN_IF_ERROR(release_held(rt));
    STRATA_RETURN_IF_ERROR(rt.unstage_layer(layer, RoleSet{Role::kGradient}));
    if (next_ < backward_.size()) {
      STRATA_RETURN_IF_ERROR(rt.stage_layer(backward_[next_], backward_roles()));
      ++next_;
    }
    const std::size_t b = position(backward_, layer);
    if (b + 1 < backward_.size()) {
      const int following = backward_[b + 1];
      STRATA_RETURN_IF_ERROR(rt.stage_layer(following, backward_roles()));
      return hold(rt, following, backward_roles());
    }
    return absl::OkStatus();
  }

  absl::Status on_begin_optimizer_step(rt::Runtime& rt) override {
    // A forward without backward (evaluation) leaves layers staged: put them back first.
    if (held_ >= 0) STRATA_RETURN_IF_ERROR(release_held(rt));
    in_forward_ = false;
    for (int layer : rt.layers()) {
      if (rt.is_staged(layer)) STRATA_RETURN_IF_ERROR(rt.unstage_layer(layer, write_back()));
    }
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
    STRATA_RETURN_IF_ERROR(rt.unstage_layer(layer, write_back()));
    if (next_ < order_.size()) STRATA_RETURN_IF_ERROR(rt.stage_layer(order_[next_++]));
    return absl::OkStatus();
  }

  absl::Status on_end_optimizer_step(rt::Runtime& rt) override {
    // Layers the optimizer did not release (it stopped early) go home too.
    for (int layer : order_) {
      if (rt.is_staged(layer)) STRATA_RETURN_IF_ERROR(rt.unstage_layer(layer, write_back()));
    }
    order_.clear();
    next_ = 0;
    return absl::OkStatus();
  }

 private:
  bool streams_parameters() const { return config().roles.contains(Role::kParameter); }
  // The optimizer writes parameters and moments; it only reads gradients.
  RoleSet write_back() const {
    RoleSet out;
    for (Role r : {Role::kParameter, Role::kExpAvg, Role::kExpAvgSq, Role::kOther}) {
      if (config().roles.contains(r)) out = out | r;
    }
    return out;
  }
  RoleSet backward_roles() const {
    return config().roles.contains(Role::kGradient) ? RoleSet{Role::kParameter, Role::kGradient}
                                                    : RoleSet{Role::kParameter};
  }
  // The last K + 1 forward layers are the first of backward: they stay, with their gradients.
  bool kept_for_backward(std::size_t j) const {
    return j + config().prefetch_depth + 1 >= forward_.size();
  }
  RoleSet forward_roles(std::size_t j) const {
    return kept_for_backward(j) ? backward_roles() : RoleSet{Role::kParameter};
  }
  static std::size_t position(const std::vector<int>& order, int layer) {
    return static_cast<std::size_t>(std::find(order.begin(), order.end(), layer) - order.begin());
  }

  absl::Status start_forward(rt::Runtime& rt) {
    STRATA_RETURN_IF_ERROR(rt.configure_staging(config().prefetch_depth + 1, config().roles));
    forward_ = rt.layers();
    next_ = 0;
    in_forward_ = true;
    for (int i = 0; i <= config().prefetch_depth && next_ < forward_.size(); ++i, ++next_) {
      STRATA_RETURN_IF_ERROR(rt.stage_layer(forward_[next_], forward_roles(next_)));
    }
    return absl::OkStatus();
  }

  // The compute stream waits for the layer's data; the runtime keeps it in place until released.
  absl::Status hold(rt::Runtime& rt, int layer, RoleSet roles) {
    for (rt::TensorHandle h : rt.layer_tensors(layer, roles)) {
      STRATA_RETURN_IF_ERROR(rt.acquire(h, rt::Tier::kGpu, rt.compute_stream()).status());
    }
    held_ = layer;
    last_ = layer;
    held_roles_ = roles;
    return absl::OkStatus();
  }

  // Everything queued on the compute stream until this hook (the held layer's forward or backward)
  // may use the data; later moves wait for it.
  absl::Status release_held(rt::Runtime& rt) {
    for (rt::TensorHandle h : rt.layer_tensors(held_, held_roles_)) {
      STRATA_RETURN_IF_ERROR(rt.release(h, rt.compute_stream()));
    }
    held_ = -1;
    return absl::OkStatus();
  }

  std::vector<int> order_;     // optimizer order
  std::vector<int> forward_;   // forward order
  std::vector<int> backward_;  // backward order
  std::size_t next_ = 0;       // next layer to stage in the current phase
  bool in_forward_ = false;
  int held_ = -1;  // layer held for forward or backward, -1 for none
  int last_ = -1;  // the layer held last
  RoleSet held_roles_;
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
