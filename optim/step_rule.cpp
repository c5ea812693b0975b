// The parts of the optimizer interface every rule shares (see optim/step_rule.h).
#include "optim/step_rule.h"

#include <cmath>
#include <string>

#include "base/strings.h"

namespace strata::optim {

void StepRule::count_skipped_host(const StepTensor* tensors, std::size_t count) const {
  for (std::size_t t = 0; t < count; ++t) {
    if (tensors[t].skipped != nullptr) ++*tensors[t].skipped;
  }
}

void StepRule::host_scalars_cpu(const AdamHyper&, std::int64_t, float*) const {}

#ifdef STRATA_HAS_CUDA
cudaError_t StepRule::queue_host_scalars(const std::vector<const AdamHyper*>&,
                                         const std::vector<std::int64_t>&, float*,
                                         cudaStream_t) const {
  return cudaSuccess;
}
#endif

absl::Status check_lr_betas_decay(std::string_view optimizer, const AdamHyper& h,
                                  std::size_t group) {
  auto bad = [&](std::string_view what, double value, std::string_view want) {
    return absl::InvalidArgumentError(
        str_cat(optimizer, ": group ", group, ": ", what, " ", value, " is invalid; ", want));
  };
  if (!(h.lr >= 0.0f) || std::isinf(h.lr)) return bad("lr", h.lr, "use a finite lr >= 0");
  if (!(h.beta1 >= 0.0f && h.beta1 < 1.0f)) return bad("beta1", h.beta1, "use 0 <= beta1 < 1");
  if (!(h.beta2 >= 0.0f && h.beta2 < 1.0f)) return bad("beta2", h.beta2, "use 0 <= beta2 < 1");
  if (!(h.weight_decay >= 0.0f) || std::isinf(h.weight_decay)) {
    return bad("weight_decay", h.weight_decay, "use a finite weight_decay >= 0");
  }
  return absl::OkStatus();
}

void declare_master(rt::DType param_dtype, rt::StepPlace place, std::vector<StateDecl>& out) {
  if (param_dtype != rt::DType::kFloat32 || place == rt::StepPlace::kHost) {
    out.push_back({.name = "master_param", .suffix = "master", .from_parameter = true});
  }
}

absl::StatusOr<std::shared_ptr<const StepRule>> make_step_rule(std::string_view name) {
  if (name == "adam" || name == "adamw") return adam_rule();
  if (name == "lion") return lion_rule();
  return absl::InvalidArgumentError(
      str_cat("unknown optimizer '", name, "'; the choices are adam (also adamw) and lion"));
}

}  // namespace strata::optim
