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
// Note [Bulk over budget]: with offload_after_step, the optimizer states (and amsgrad's maximum,
// role other) live in host memory between steps and are needed by the optimizer step only. At
// begin_step they come back in bulk when they fit the GPU budget. When they do not, they stay on
// the host and the step streams them a layer at a time, synchronously: the optimizer's acquire
// brings the layer in, and when the optimizer releases the layer its states go back to the host
// and the host waits for that before the next layer comes in. Slower than layer_prefetch (no
// overlap, a host wait per layer) but the same kernel on the same values: the same numbers, in a
// GPU budget smaller than the states.
class Bulk final : public rt::ResidencyPolicy {
 public:
  explicit Bulk(const rt::PolicyConfig& c) : ResidencyPolicy(c) {}
  std::string_view name() const override { return "bulk"; }

  rt::Tier placement(const rt::TensorSpec& spec) const override {
    return lives_on_host(spec.role) ? rt::Tier::kPinnedHost : spec.home;
  }

  absl::Status on_offload_all(rt::Runtime& rt) override {
    for (rt::TensorHandle h : rt.tensors()) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, settled_info(rt, h));
      if (!config().roles.contains(info.spec.role) || info.tier != rt::Tier::kGpu) continue;
      STRATA_RETURN_IF_ERROR(to_host(rt, h));
    }
    return absl::OkStatus();
  }

  absl::Status on_reload_all(rt::Runtime& rt) override {
    for (rt::TensorHandle h : rt.tensors()) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, settled_info(rt, h));
      if (!config().roles.contains(info.spec.role) || info.tier == info.spec.home) continue;
      STRATA_RETURN_IF_ERROR(rt.migrate(h, info.spec.home));
    }
    return absl::OkStatus();
  }

  absl::Status on_begin_step(rt::Runtime& rt) override {
    streaming_ = false;
    if (!config().offload_after_step) return absl::OkStatus();
    // What forward and backward need comes back first; then the states, if they fit. One host
    // wait at the end, as reload_all makes, so the data is in place when the step starts.
    std::size_t state_bytes = 0;
    for (rt::TensorHandle h : rt.tensors()) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, settled_info(rt, h));
      if (!config().roles.contains(info.spec.role) || info.tier == info.spec.home) continue;
      if (lives_on_host(info.spec.role)) {
        if (info.tier != rt::Tier::kGpu) state_bytes += info.bytes;
      } else {
        STRATA_RETURN_IF_ERROR(rt.migrate(h, info.spec.home));
      }
    }
    const std::size_t budget = rt.allocator().pool(rt::Tier::kGpu).budget();
    const auto allocated =
        static_cast<std::size_t>(rt.allocator().stats(rt::Tier::kGpu).allocated_bytes.current);
    if (state_bytes > 0 && (allocated > budget || state_bytes > budget - allocated)) {
      streaming_ = true;
      state_bytes = 0;
    }
    for (rt::TensorHandle h : rt.tensors()) {
      if (state_bytes == 0) break;
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, rt.info(h));
      if (!lives_on_host(info.spec.role) || info.tier == rt::Tier::kGpu || info.in_flight) continue;
      absl::Status s = rt.migrate(h, rt::Tier::kGpu);
      if (s.code() == absl::StatusCode::kResourceExhausted) {
        // Rounding or fragmentation: the rest stays on the host and streams.
        streaming_ = true;
        continue;
      }
      STRATA_RETURN_IF_ERROR(s);
    }
    return rt.wait_all();
  }

  absl::Status on_layer_released(rt::Runtime& rt, int layer) override {
    if (!streaming_) return absl::OkStatus();
    for (rt::TensorHandle h : rt.layer_tensors(layer, config().roles)) {
      // The optimizer's acquire brought the states in; on a GPU their copies are usually still
      // under way here, and a tensor in flight cannot move again until it has landed.
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, settled_info(rt, h));
      if (!lives_on_host(info.spec.role) || info.tier != rt::Tier::kGpu) continue;
      STRATA_RETURN_IF_ERROR(to_host(rt, h));
    }
    // The next layer needs the room these free, which they do once their copies complete.
    return rt.wait_all();
  }

  absl::Status on_end_step(rt::Runtime& rt) override {
    return config().offload_after_step ? rt.offload_all() : absl::OkStatus();
  }

 private:
  bool lives_on_host(rt::Role role) const {
    return config().offload_after_step && config().roles.contains(role) &&
           (role == rt::Role::kExpAvg || role == rt::Role::kExpAvgSq || role == rt::Role::kOther);
  }

  // The tensor's info once a migration under way has landed: the runtime moves no tensor that is
  // in flight, and a check of `tier` alone would take a tensor arriving on the GPU for one that is
  // elsewhere. Waits on the host only when the tensor is in flight.
  static absl::StatusOr<rt::TensorInfo> settled_info(rt::Runtime& rt, rt::TensorHandle h) {
    STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, rt.info(h));
    if (!info.in_flight) return info;
    STRATA_RETURN_IF_ERROR(rt.wait_all());
    return rt.info(h);
  }

  static absl::Status to_host(rt::Runtime& rt, rt::TensorHandle h) {
    absl::Status s = rt.migrate(h, rt::Tier::kPinnedHost);
    if (s.code() == absl::StatusCode::kResourceExhausted)
      s = rt.migrate(h, rt::Tier::kPageableHost);
    return s;
  }

  bool streaming_ = false;  // Note [Bulk over budget]
};

}  // namespace

absl::StatusOr<std::unique_ptr<rt::ResidencyPolicy>> make_bulk(const rt::PolicyConfig& c) {
  if (c.roles.empty()) {
    return absl::InvalidArgumentError("bulk: roles to move must not be empty");
  }
  return std::unique_ptr<rt::ResidencyPolicy>(new Bulk(c));
}

}  // namespace strata::policy
