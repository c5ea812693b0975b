#include <memory>
#include <utility>
#include <vector>

#include "base/status.h"
#include "base/strings.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

namespace strata::policy {
namespace {

// Phase switches: everything of the configured roles to host memory and back, all copies queued at
// once so the link stays busy. Pinned memory first (it streams at full link speed); when the
// pinned budget is full, pageable memory, which goes through the runtime's bounce buffers.
//
// Note [Bulk over budget]: with offload_after_step, the tensors of the configured roles rest in
// host memory between steps (from registration on) and begin_step brings them back, in bulk, as far
// as the GPU budget allows:
//   - everything fits: all of it comes back, and one host wait at the end (as reload_all makes)
//     puts the data in place before the step starts;
//   - what forward and backward need (parameters, gradients) fits but the optimizer states (and
//     amsgrad's maximum, role other) do not: the states stay on the host and the optimizer step
//     streams them a layer at a time, synchronously: the optimizer's acquire brings the layer in,
//     and when the optimizer releases it its states go back and the host waits for that before the
//     next layer comes in;
//   - not even that fits: nothing comes back and the whole step streams a layer at a time through
//     a one-slot staging ring, layer_prefetch at depth 0 (forward, backward and the optimizer step;
//     a layer's copies wait for the previous layer's compute, nothing is fetched ahead).
// Slower than layer_prefetch (less or no overlap) but the same kernels on the same values: the same
// numbers, in a GPU budget smaller than the states, or than the whole model.
class Bulk final : public rt::ResidencyPolicy {
 public:
  explicit Bulk(const rt::PolicyConfig& c) : ResidencyPolicy(c) {}
  std::string_view name() const override { return "bulk"; }

  rt::Tier placement(const rt::TensorSpec& spec) const override {
    return rests_on_host(spec.role) ? rt::Tier::kPinnedHost : spec.home;
  }

  absl::Status on_offload_all(rt::PolicyContext& rt) override {
    // A step streaming layers puts what it staged home first: staged tensors cannot move.
    if (layered_) STRATA_RETURN_IF_ERROR(layered_->on_end_optimizer_step(rt));
    for (rt::TensorHandle h : rt.tensors()) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, settled_info(rt, h));
      if (!config().roles.contains(info.spec.role) || info.tier != rt::Tier::kGpu) continue;
      STRATA_RETURN_IF_ERROR(to_host(rt, h));
    }
    return absl::OkStatus();
  }

  absl::Status on_reload_all(rt::PolicyContext& rt) override {
    for (rt::TensorHandle h : rt.tensors()) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, settled_info(rt, h));
      if (!config().roles.contains(info.spec.role) || info.tier == info.spec.home) continue;
      STRATA_RETURN_IF_ERROR(rt.migrate(h, info.spec.home));
    }
    return absl::OkStatus();
  }

  absl::Status on_begin_step(rt::PolicyContext& rt) override {
    streaming_ = false;
    if (layered_) STRATA_RETURN_IF_ERROR(layered_->on_begin_step(rt));
    layered_ = nullptr;
    if (!config().offload_after_step) return absl::OkStatus();
    // Note [Bulk over budget]: what forward and backward need comes back first, then the states.
    // Parameters and gradients go back to their home tier, states to the GPU.
    std::vector<std::pair<rt::TensorHandle, rt::Tier>> working;
    std::vector<rt::TensorHandle> states;
    std::size_t working_bytes = 0, state_bytes = 0;
    for (rt::TensorHandle h : rt.tensors()) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, settled_info(rt, h));
      if (!rests_on_host(info.spec.role)) continue;
      if (is_state(info.spec.role)) {
        if (info.tier == rt::Tier::kGpu) continue;
        states.push_back(h);
        state_bytes += info.bytes;
      } else if (info.tier != info.spec.home) {
        working.emplace_back(h, info.spec.home);
        if (info.spec.home == rt::Tier::kGpu) working_bytes += info.bytes;
      }
    }
    const std::size_t budget = rt.gpu_pool_budget();
    auto room = [&rt, budget] {
      const auto allocated = static_cast<std::size_t>(rt.gpu_pool_stats().allocated_bytes.current);
      return allocated > budget ? 0 : budget - allocated;
    };
    if (working_bytes > room()) return stream_layers(rt);
    for (auto [h, home] : working) {
      absl::Status s = rt.migrate(h, home);
      // Rounding or fragmentation: what did not come back streams with the rest.
      if (s.code() == absl::StatusCode::kResourceExhausted) return stream_layers(rt);
      STRATA_RETURN_IF_ERROR(s);
    }
    if (state_bytes > room()) {
      streaming_ = true;
      states.clear();
    }
    for (rt::TensorHandle h : states) {
      absl::Status s = rt.migrate(h, rt::Tier::kGpu);
      if (s.code() == absl::StatusCode::kResourceExhausted) {
        streaming_ = true;  // the rest stays on the host and streams
        continue;
      }
      STRATA_RETURN_IF_ERROR(s);
    }
    return rt.wait_all();
  }

  absl::Status on_before_forward(rt::PolicyContext& rt, int layer) override {
    return layered_ ? layered_->on_before_forward(rt, layer) : absl::OkStatus();
  }

  absl::Status on_after_backward(rt::PolicyContext& rt, int layer) override {
    return layered_ ? layered_->on_after_backward(rt, layer) : absl::OkStatus();
  }

  absl::Status on_begin_optimizer_step(rt::PolicyContext& rt) override {
    return layered_ ? layered_->on_begin_optimizer_step(rt) : absl::OkStatus();
  }

  absl::Status on_layer_released(rt::PolicyContext& rt, int layer) override {
    if (layered_) return layered_->on_layer_released(rt, layer);
    if (!streaming_) return absl::OkStatus();
    for (rt::TensorHandle h : rt.layer_tensors(layer, config().roles)) {
      // The optimizer's acquire brought the states in; on a GPU their copies are usually still
      // under way here, and a tensor in flight cannot move again until it has landed.
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, settled_info(rt, h));
      if (!is_state(info.spec.role) || info.tier != rt::Tier::kGpu) continue;
      STRATA_RETURN_IF_ERROR(to_host(rt, h));
    }
    // The next layer needs the room these free, which they do once their copies complete.
    return rt.wait_all();
  }

  absl::Status on_end_optimizer_step(rt::PolicyContext& rt) override {
    return layered_ ? layered_->on_end_optimizer_step(rt) : absl::OkStatus();
  }

  absl::Status on_end_step(rt::PolicyContext& rt) override {
    if (!config().offload_after_step) return absl::OkStatus();
    STRATA_RETURN_IF_ERROR(on_offload_all(rt));
    return rt.wait_all();
  }

 private:
  bool rests_on_host(rt::Role role) const {
    return config().offload_after_step && config().roles.contains(role);
  }
  static bool is_state(rt::Role role) {
    return role == rt::Role::kExpAvg || role == rt::Role::kExpAvgSq || role == rt::Role::kOther;
  }

  // The third case of Note [Bulk over budget]: the rest of the step streams through the ring.
  absl::Status stream_layers(rt::PolicyContext& rt) {
    if (!streamer_) {
      STRATA_ASSIGN_OR_RETURN(streamer_,
                              make_layer_streamer({.prefetch_depth = 0, .roles = config().roles}));
    }
    layered_ = streamer_.get();
    // Whatever came back before the budget ran out has landed before the step uses it.
    STRATA_RETURN_IF_ERROR(rt.wait_all());
    return layered_->on_begin_step(rt);
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

  bool streaming_ = false;  // Note [Bulk over budget], second case
  // The third case: the layer streamer, made the first time it is needed and kept (its ring stays
  // configured), and whether this step uses it.
  std::unique_ptr<rt::ResidencyPolicy> streamer_;
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
