// optim/adam_create.cpp: making an Adam (Adam::create): every parameter and gradient checked
// before anything is registered, the step placed, the declared states registered all or nothing,
// and the buffers the steps use made; and taking it down again (the destructor). Stepping is
// adam.cpp's.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <set>
#include <string>
#include <string_view>

#include "base/status.h"
#include "base/strings.h"
#include "optim/adam.h"
#include "optim/adam_kernels.h"

namespace strata::optim {
namespace {

// The kernel's element type of a runtime dtype; nullopt for one Adam does not step.
std::optional<ElemType> elem_type(rt::DType dtype) {
  switch (dtype) {
    case rt::DType::kFloat32:
      return ElemType::kF32;
    case rt::DType::kBFloat16:
      return ElemType::kBF16;
    case rt::DType::kFloat16:
      return ElemType::kF16;
    default:
      return std::nullopt;
  }
}

absl::Status check_tensor(const rt::TensorInfo& info, rt::Role role, std::string_view what) {
  if (!elem_type(info.spec.dtype)) {
    return absl::InvalidArgumentError(
        str_cat("Adam: ", what, " '", info.spec.name, "' is ", rt::dtype_name(info.spec.dtype),
                "; Adam steps float32, bfloat16 and float16 tensors"));
  }
  if (info.spec.role != role) {
    return absl::InvalidArgumentError(str_cat("Adam: ", what, " '", info.spec.name, "' has role ",
                                              rt::role_name(info.spec.role), ", not ",
                                              rt::role_name(role)));
  }
  return absl::OkStatus();
}

}  // namespace

Adam::Adam(rt::Runtime& runtime, AdamOptions options)
    : runtime_(runtime), options_(std::move(options)) {
  if (options_.rule == nullptr) options_.rule = adam_rule();
}

Adam::~Adam() {
  // Host steps in backward still running (See Note [Host steps in backward] in
  // adam_host_speculation.cpp) write into what is freed below.
  host_speculation_.close();
  if (host_d2h_ != nullptr) {
    // Host steps' copies may still be running.
    (void)runtime_.device().stream_synchronize(host_d2h_);
    (void)runtime_.device().stream_synchronize(host_h2d_);
    runtime_.device().destroy_stream(host_d2h_);
    runtime_.device().destroy_stream(host_h2d_);
  }
  for (const auto& [layer, buffer] : host_buffers_) {
    (void)runtime_.allocator().deallocate(rt::Tier::kPinnedHost, buffer);
  }
  if (host_scalars_ != nullptr) {
    (void)runtime_.allocator().deallocate(rt::Tier::kPinnedHost, host_scalars_);
  }
  if (step_end_ != nullptr) runtime_.device().release_timed(step_end_);
  if (skipped_ != nullptr) {
    if (skips_possible_) {
      (void)runtime_.device().stream_synchronize(runtime_.compute_stream());
    }
    (void)runtime_.allocator().deallocate(rt::Tier::kPinnedHost, skipped_);
  }
  // Note [Adam owns its states]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // What create registered goes with the optimizer, so a new one over the same parameters can
  // register them again; a state the user unregistered already is fine.
  for (rt::TensorHandle h : owned_) {
    absl::Status s = runtime_.unregister(h);
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound) {
      std::fprintf(stderr, "strata: Adam: keeping state '%s' registered: %s\n",
                   name_of_state(h).c_str(), std::string(s.message()).c_str());
    }
  }
}

// Checks every group, parameter and gradient before anything is registered, so that a bad input
// registers nothing; adds up each layer's step bytes on the GPU.
absl::Status Adam::check_groups() {
  std::set<std::uint64_t> seen;
  const StateType moments = options_.state_dtype;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    STRATA_RETURN_IF_ERROR(check_hyper(groups_[g].hyper, g));
    for (auto [param, grad] : groups_[g].params) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo p, runtime_.info(param));
      if (!grad.valid() && !options_.gradients_given) {
        return absl::InvalidArgumentError(
            str_cat("Adam: parameter '", p.spec.name, "' has no gradient"));
      }
      STRATA_RETURN_IF_ERROR(check_tensor(p, rt::Role::kParameter, "parameter"));
      // The gradient is memory the caller owns (See Note [Gradients given at each step] in adam.h).
      rt::TensorInfo d = p;
      d.bytes = 0;
      d.spec.role = rt::Role::kGradient;
      if (grad.valid()) {
        STRATA_ASSIGN_OR_RETURN(d, runtime_.info(grad));
      }
      STRATA_RETURN_IF_ERROR(check_tensor(d, rt::Role::kGradient, "gradient"));
      if (d.spec.dtype != p.spec.dtype && d.spec.dtype != rt::DType::kFloat32) {
        return absl::InvalidArgumentError(
            str_cat("Adam: gradient '", d.spec.name, "' is ", rt::dtype_name(d.spec.dtype),
                    " and its parameter '", p.spec.name, "' ", rt::dtype_name(p.spec.dtype),
                    "; a gradient is in its parameter's dtype or float32"));
      }
      if (p.spec.shape != d.spec.shape || p.spec.layer != d.spec.layer) {
        return absl::InvalidArgumentError(str_cat("Adam: gradient '", d.spec.name,
                                                  "' does not match parameter '", p.spec.name,
                                                  "' in shape or layer"));
      }
      if (!seen.insert(param.id).second) {
        return absl::InvalidArgumentError(
            str_cat("Adam: parameter '", p.spec.name, "' is listed twice"));
      }
      const auto numel = static_cast<std::int64_t>(p.bytes / rt::dtype_size(p.spec.dtype));
      const std::int64_t states = state_bytes(
          options_.rule->states(groups_[g].hyper, p.spec.dtype, rt::StepPlace::kGpu, moments),
          numel);
      step_bytes_[p.spec.layer] += p.bytes + d.bytes + static_cast<std::size_t>(states);
    }
  }
  return absl::OkStatus();
}

// Registers each parameter's declared states (See Note [Declared states] in state_decl.h).
absl::Status Adam::register_states() {
  const StateType moments = options_.state_dtype;
  // All or nothing: a registration that fails (a name taken, no room) returns with `adam`, whose
  // destructor unregisters the states registered before it (See Note [Adam owns its states]).
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    for (auto [param, grad] : groups_[g].params) {
      rt::TensorInfo p = *runtime_.info(param);
      rt::TensorInfo d = p;
      d.spec.name = str_cat(p.spec.name, ".grad");
      if (grad.valid()) d = *runtime_.info(grad);
      Slot slot;
      slot.param = param;
      slot.grad = grad;
      slot.group = g;
      slot.layer = p.spec.layer;
      slot.numel = static_cast<std::int64_t>(p.bytes / rt::dtype_size(p.spec.dtype));
      slot.param_type = *elem_type(p.spec.dtype);
      slot.grad_type = *elem_type(d.spec.dtype);
      slot.param_name = p.spec.name;
      slot.grad_name = d.spec.name;
      slot.seed = state_seed(p.spec.name.data(), p.spec.name.size());
      // See Note [Declared states] in state_decl.h.
      const rt::StepPlace place =
          steps_on_host(slot.layer) ? rt::StepPlace::kHost : rt::StepPlace::kGpu;
      const std::vector<StateDecl> decls =
          options_.rule->states(groups_[g].hyper, p.spec.dtype, place, moments);
      if (decls.size() > static_cast<std::size_t>(kMaxStates)) {
        return absl::InternalError(str_cat("optimizer ", options_.rule->name(), " declares ",
                                           decls.size(), " states, more than ", kMaxStates));
      }
      const std::size_t index = slots_.size();
      slot_of_param_[param.id] = index;
      by_layer_[slot.layer].push_back(index);
      slots_.push_back(std::move(slot));
      for (std::size_t j = 0; j < decls.size(); ++j) {
        STRATA_RETURN_IF_ERROR(register_state(index, static_cast<int>(j), decls[j]));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Adam::register_state(std::size_t index, int j, const StateDecl& decl) {
  Slot& slot = slots_[index];
  STRATA_ASSIGN_OR_RETURN(rt::TensorInfo p, runtime_.info(slot.param));
  std::vector<float> initial;
  if (decl.from_parameter) {
    // The master copy starts as the parameter's values, exactly (every bfloat16 and float16 value
    // is a float32 value).
    initial.resize(static_cast<std::size_t>(slot.numel));
    if (slot.param_type == ElemType::kF32) {
      STRATA_RETURN_IF_ERROR(runtime_.read(slot.param, initial.data()));
    } else {
      std::vector<std::uint16_t> low(initial.size());
      STRATA_RETURN_IF_ERROR(runtime_.read(slot.param, low.data()));
      for (std::size_t i = 0; i < low.size(); ++i)
        initial[i] = load_elem(low.data(), slot.param_type, static_cast<std::int64_t>(i));
    }
  }
  rt::TensorSpec spec = p.spec;
  spec.name = str_cat(p.spec.name, ".", decl.suffix);
  spec.role = rt::Role::kOptimizerState;
  spec.state = decl.name;
  spec.dtype = decl.dtype;
  if (decl.int8_blocks) spec.shape = {state_bytes(decl, slot.numel)};
  STRATA_ASSIGN_OR_RETURN(
      rt::TensorHandle h,
      runtime_.register_tensor(spec, decl.from_parameter ? initial.data() : nullptr));
  owned_.push_back(h);
  slot.declared[j] = h;
  slot.suffixes[j] = decl.suffix;
  slot_of_state_[h.id] = index;
  if (decl.from_parameter) {
    slot.master = h;
    slot.master_at = j;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Adam>> Adam::create(rt::Runtime& runtime, AdamOptions options) {
  std::unique_ptr<Adam> adam(new Adam(runtime, std::move(options)));
  STRATA_RETURN_IF_ERROR(adam->check_groups());
  // The policy places each layer's step before any state is registered (See Note [Step placement]
  // in runtime/policy.h); a layer stepped on the host needs only what rests on the GPU already.
  adam->all_step_bytes_ = adam->step_bytes_;
  if (runtime.places_steps()) {
    STRATA_RETURN_IF_ERROR(adam->place_steps());
    for (int layer : adam->host_layers_) adam->step_bytes_.erase(layer);
  }
  STRATA_RETURN_IF_ERROR(check_fits_gpu(runtime, adam->step_bytes_));
  STRATA_RETURN_IF_ERROR(adam->register_states());
  adam->skip_.assign(adam->slots_.size(), false);
  const std::size_t counters = std::max<std::size_t>(adam->slots_.size(), 1);
  STRATA_ASSIGN_OR_RETURN(
      void* skipped, runtime.allocator().allocate(
                         rt::Tier::kPinnedHost, counters * sizeof(std::int64_t) + 4 * sizeof(float),
                         {.owner = "Adam: skipped steps and scalars read back"}));
  adam->skipped_ = static_cast<std::int64_t*>(skipped);
  adam->read_back_ = reinterpret_cast<float*>(adam->skipped_ + counters);
  STRATA_RETURN_IF_ERROR(adam->reset_skipped());
  STRATA_RETURN_IF_ERROR(adam->make_host_buffers());
  // The policy lays out the states under the GPU budget now, so a budget too small is an error
  // here, at setup, rather than at the first step; `adam` takes its states back if it fails.
  STRATA_RETURN_IF_ERROR(runtime.prepare());
  return adam;
}

}  // namespace strata::optim
