// optim/adam_parameters.cpp: each parameter's part in a step: its own step count
// (See Note [Per-parameter steps] in adam.h) and the steps found_inf skipped
// (See Note [Skipped steps] in adam_kernels.h), the parameters that sit a step out, and the
// gradients given at each step (See Note [Gradients given at each step] in adam.h).
#include <algorithm>

#include "base/status.h"
#include "base/strings.h"
#include "optim/adam.h"

namespace strata::optim {

std::int64_t Adam::step_count(std::size_t group) const {
  if (group >= groups_.size()) return 0;
  // The kernels may still be counting this step's skip.
  if (skips_possible_) (void)runtime_.device().stream_synchronize(runtime_.compute_stream());
  std::int64_t most = 0;
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].group != group) continue;
    most = std::max(most, slots_[i].steps - (skips_possible_ ? skipped_[i] : 0));
  }
  return most;
}

absl::StatusOr<std::size_t> Adam::slot_of(rt::TensorHandle param) const {
  auto it = slot_of_param_.find(param.id);
  if (it == slot_of_param_.end() || slots_[it->second].param != param) {
    return absl::NotFoundError(
        str_cat("Adam: handle ", param.id, " is not a parameter of this optimizer"));
  }
  return it->second;
}

absl::StatusOr<std::int64_t> Adam::step_count_of(rt::TensorHandle param) const {
  STRATA_ASSIGN_OR_RETURN(const std::size_t i, slot_of(param));
  if (!skips_possible_) return slots_[i].steps;
  STRATA_RETURN_IF_ERROR(runtime_.device().stream_synchronize(runtime_.compute_stream()));
  return slots_[i].steps - skipped_[i];
}

std::int64_t Adam::step_number() const {
  std::int64_t most = 0;
  for (const Slot& s : slots_) most = std::max(most, s.steps);
  return most;
}

absl::Status Adam::skip_parameters(const std::vector<rt::TensorHandle>& params) {
  std::vector<std::size_t> slots;
  for (rt::TensorHandle p : params) {
    STRATA_ASSIGN_OR_RETURN(const std::size_t i, slot_of(p));
    slots.push_back(i);
  }
  for (std::size_t i : slots) skip_[i] = true;
  return absl::OkStatus();
}

bool Adam::skipped_this_step(rt::TensorHandle param) const {
  absl::StatusOr<std::size_t> i = slot_of(param);
  return i.ok() && skip_[*i];
}

absl::Status Adam::reset_skipped() {
  if (skips_possible_) {
    STRATA_RETURN_IF_ERROR(runtime_.device().stream_synchronize(runtime_.compute_stream()));
  }
  std::fill(skipped_, skipped_ + std::max<std::size_t>(slots_.size(), 1), 0);
  skips_possible_ = false;
  return absl::OkStatus();
}

absl::Status Adam::fold_skipped() {
  if (skips_possible_) {
    STRATA_RETURN_IF_ERROR(runtime_.device().stream_synchronize(runtime_.compute_stream()));
    for (std::size_t i = 0; i < slots_.size(); ++i) slots_[i].steps -= skipped_[i];
  }
  return reset_skipped();
}

absl::Status Adam::set_step_count(std::size_t group, std::int64_t steps) {
  if (group >= groups_.size()) {
    return absl::InvalidArgumentError(str_cat("Adam: no parameter group ", group));
  }
  if (steps < 0) {
    return absl::InvalidArgumentError(
        str_cat("Adam: group ", group, ": step count ", steps, " is negative"));
  }
  // The other parameters keep their counts: fold the skipped steps in before the flags are reset.
  STRATA_RETURN_IF_ERROR(fold_skipped());
  for (Slot& s : slots_) {
    if (s.group == group) s.steps = steps;
  }
  return absl::OkStatus();
}

absl::Status Adam::set_step_count_of(rt::TensorHandle param, std::int64_t steps) {
  STRATA_ASSIGN_OR_RETURN(const std::size_t i, slot_of(param));
  if (steps < 0) {
    return absl::InvalidArgumentError(str_cat("Adam: parameter '", slots_[i].param_name,
                                              "': step count ", steps, " is negative"));
  }
  STRATA_RETURN_IF_ERROR(fold_skipped());
  slots_[i].steps = steps;
  return absl::OkStatus();
}

absl::Status Adam::set_gradient(rt::TensorHandle param, const void* data, ElemType type) {
  STRATA_ASSIGN_OR_RETURN(const std::size_t i, slot_of(param));
  Slot& s = slots_[i];
  if (s.grad.valid()) {
    return absl::FailedPreconditionError(
        str_cat("Adam: parameter '", s.param_name,
                "' has a registered gradient; set_gradient is for "
                "parameters listed without one (Note [Gradients given at each step])"));
  }
  if (data == nullptr) {
    return absl::InvalidArgumentError(
        str_cat("Adam: set_gradient of parameter '", s.param_name, "' with no data"));
  }
  if (type != s.param_type && type != ElemType::kF32) {
    return absl::InvalidArgumentError(
        str_cat("Adam: the gradient of parameter '", s.param_name,
                "' is in another low-precision dtype than the parameter; a gradient is in its "
                "parameter's dtype or float32"));
  }
  s.given_grad = data;
  s.grad_type = type;
  return absl::OkStatus();
}

absl::Status Adam::check_gradients_given(const std::vector<std::size_t>& slots) const {
  for (std::size_t i : slots) {
    const Slot& s = slots_[i];
    if (!s.grad.valid() && s.given_grad == nullptr && !skip_[i]) {
      return absl::FailedPreconditionError(
          str_cat("Adam: parameter '", s.param_name, "' (layer ", s.layer,
                  ") has no gradient for this step: give it with set_gradient, or name it to "
                  "skip_parameters (Note [Gradients given at each step])"));
    }
  }
  return absl::OkStatus();
}

}  // namespace strata::optim
