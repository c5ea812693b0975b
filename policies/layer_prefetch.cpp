// policies/layer_prefetch.cpp: what LayerPrefetch's streams share (registration, the ring's
// bookkeeping, putting everything home, the roles each pass moves), and the factories of
// layer_prefetch and hybrid. The parameters' streaming through forward and backward is in
// parameter_streaming.cpp, the optimizer states' in state_streaming.cpp, the ring's layout with
// the resident layers in ring_plan.cpp (policies/layer_prefetch.h).
#include <algorithm>
#include <optional>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "policies/builtin.h"
#include "policies/layer_prefetch.h"

namespace strata::policy {
namespace internal {

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
  // See Note [Overlapped backward] in policies/state_streaming.cpp.
  if (overlap()) return config().roles;
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
  pass_ = Pass::kNone;
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
