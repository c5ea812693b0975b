#include "base/status.h"
#include "base/strings.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

namespace strata::policy {
namespace {

// Phase switches: everything of the configured roles to host memory and back, all copies queued at
// once so the link stays busy. Pinned memory first (it streams at full link speed); when the
// pinned budget is full, pageable memory, which goes through the runtime's bounce buffers.
class Bulk final : public rt::ResidencyPolicy {
 public:
  explicit Bulk(const rt::PolicyConfig& c) : ResidencyPolicy(c) {}
  std::string_view name() const override { return "bulk"; }

  absl::Status on_offload_all(rt::Runtime& rt) override {
    for (rt::TensorHandle h : rt.tensors()) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, rt.info(h));
      if (!config().roles.contains(info.spec.role) || info.tier != rt::Tier::kGpu) continue;
      absl::Status s = rt.migrate(h, rt::Tier::kPinnedHost);
      if (s.code() == absl::StatusCode::kResourceExhausted) {
        s = rt.migrate(h, rt::Tier::kPageableHost);
      }
      STRATA_RETURN_IF_ERROR(s);
    }
    return absl::OkStatus();
  }

  absl::Status on_reload_all(rt::Runtime& rt) override {
    for (rt::TensorHandle h : rt.tensors()) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, rt.info(h));
      const rt::Tier home = placement(info.spec);
      if (!config().roles.contains(info.spec.role) || info.tier == home) continue;
      STRATA_RETURN_IF_ERROR(rt.migrate(h, home));
    }
    return absl::OkStatus();
  }

  absl::Status on_begin_step(rt::Runtime& rt) override {
    return config().offload_after_step ? rt.reload_all() : absl::OkStatus();
  }
  absl::Status on_end_step(rt::Runtime& rt) override {
    return config().offload_after_step ? rt.offload_all() : absl::OkStatus();
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<rt::ResidencyPolicy>> make_bulk(const rt::PolicyConfig& c) {
  if (c.roles.empty()) {
    return absl::InvalidArgumentError("bulk: roles to move must not be empty");
  }
  return std::unique_ptr<rt::ResidencyPolicy>(new Bulk(c));
}

}  // namespace strata::policy
