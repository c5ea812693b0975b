#include "optim/adam.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>

#include "allocator/cuda_status.h"
#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
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

absl::Status Adam::check_fits_gpu(rt::Runtime& runtime,
                                  const std::map<int, std::size_t>& step_bytes) {
  const std::size_t budget = runtime.gpu_budget();
  for (auto [layer, bytes] : step_bytes) {
    if (bytes > budget) {
      return absl::ResourceExhaustedError(str_cat(
          "Adam: layer ", layer, " needs ", format_bytes(bytes),
          " on the GPU for its step (parameters, gradients and moments; the kernel reads GPU "
          "memory only), more than the GPU budget of ",
          format_bytes(budget)));
    }
  }
  return absl::OkStatus();
}

Adam::Adam(rt::Runtime& runtime, AdamOptions options)
    : runtime_(runtime), options_(std::move(options)) {
  if (options_.rule == nullptr) options_.rule = adam_rule();
}

Adam::~Adam() {
  // Host steps in backward still running (See Note [Host steps in backward] in
  // adam_host_speculation.cpp) write into what is freed below.
  if (host_worker_ != nullptr) host_worker_->drain();
  end_host_speculation();
  if (host_undo_ != nullptr) {
    (void)runtime_.allocator().deallocate(rt::Tier::kPageableHost, host_undo_);
  }
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

std::string Adam::name_in(const Slot& s, rt::TensorHandle h) {
  if (h == s.param) return s.param_name;
  if (h == s.grad) return s.grad_name;
  for (int j = 0; j < kMaxStates; ++j) {
    if (h == s.declared[j]) return str_cat(s.param_name, ".", s.suffixes[j]);
  }
  return str_cat("handle ", h.id);
}

std::string Adam::name_of_state(rt::TensorHandle h) const {
  auto it = slot_of_state_.find(h.id);
  return it == slot_of_state_.end() ? str_cat("handle ", h.id) : name_in(slots_[it->second], h);
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

absl::Status Adam::set_lr(std::size_t group, double lr) {
  if (group >= groups_.size()) {
    return absl::InvalidArgumentError(str_cat("Adam: no parameter group ", group));
  }
  if (!(lr >= 0.0f) || std::isinf(lr)) {
    return absl::InvalidArgumentError(
        str_cat("Adam: group ", group, ": lr ", lr, " is invalid; use a finite lr >= 0"));
  }
  groups_[group].hyper.lr = lr;
  return absl::OkStatus();
}

absl::Status Adam::set_hyper(std::size_t group, const AdamHyper& hyper) {
  if (group >= groups_.size()) {
    return absl::InvalidArgumentError(str_cat("Adam: no parameter group ", group));
  }
  STRATA_RETURN_IF_ERROR(check_hyper(hyper, group));
  if (hyper.amsgrad != groups_[group].hyper.amsgrad) {
    return absl::InvalidArgumentError(
        str_cat("Adam: group ", group, ": amsgrad cannot change after the optimizer is made (",
                groups_[group].hyper.amsgrad ? "on" : "off", " here)"));
  }
  groups_[group].hyper = hyper;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<rt::TensorHandle>> Adam::state(rt::TensorHandle param) const {
  for (const Slot& s : slots_) {
    if (s.param == param) {
      std::vector<rt::TensorHandle> out;
      for (rt::TensorHandle h : s.states()) {
        if (h.valid()) out.push_back(h);
      }
      return out;
    }
  }
  return absl::NotFoundError("Adam: no state for that parameter");
}

absl::Status Adam::check_can_step() {
  // The handles were checked, and nothing was unregistered since: all still there.
  const std::uint64_t unregistrations = runtime_.unregistrations();
  if (unregistrations == checked_unregistrations_) return check_fits_gpu(runtime_, step_bytes_);
  for (const Slot& s : slots_) {
    for (rt::TensorHandle h : s.kernel_tensors()) {
      if (!h.valid()) continue;
      if (!runtime_.is_registered(h)) {
        return absl::FailedPreconditionError(
            str_cat("Adam: tensor '", name_in(s, h), "' (layer ", s.layer,
                    ") was unregistered after the optimizer was made"));
      }
    }
  }
  checked_unregistrations_ = unregistrations;
  return check_fits_gpu(runtime_, step_bytes_);
}

absl::Status Adam::step(const float* grad_scale, const float* found_inf) {
  if (overlap_open_) {
    return absl::FailedPreconditionError(
        "Adam: step() while a step begun by step_layer is open; complete it with finish_step");
  }
  overlapped_.clear();
  const absl::Status stepped = run_step(grad_scale, found_inf, /*new_step=*/true);
  // A step that stepped every layer is taken (only the policy's end of step failed): its lists
  // are forgotten as after any step; one that did not keeps them for its retry.
  if (!stepped.ok() && !stepped_every_layer_) return stepped;
  const absl::Status ended = end_step();  // See Note [Per-parameter steps]
  STRATA_RETURN_IF_ERROR(stepped);
  return ended;
}

absl::Status Adam::run_step(const float* grad_scale, const float* found_inf, bool new_step) {
  rt::Runtime& rt = runtime_;
  // Before any check can fail: a refused step stepped no layer, whatever the last one did (step()
  // and finish_committed keep the step's lists, and the step open, only when this is false).
  stepped_every_layer_ = false;
  STRATA_RETURN_IF_ERROR(check_can_step());
  if (options_.gradients_given) {
    // The layers this call steps (not those stepped in backward) have their gradients.
    std::vector<std::size_t> stepping;
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      if (std::find(overlapped_.begin(), overlapped_.end(), slots_[i].layer) == overlapped_.end()) {
        stepping.push_back(i);
      }
    }
    STRATA_RETURN_IF_ERROR(check_gradients_given(stepping));
  }
  if (new_step) last_step_.clear();
  // Nothing of this step ran yet: the optimizer steps each layer where the policy does (See Note
  // [Measured split] in policies/split_search.h).
  if (new_step && rt.places_steps()) STRATA_RETURN_IF_ERROR(follow_placement());
  const std::size_t stepped_before = last_step_.size();
  if (absl::Status begin = rt.begin_optimizer_step(); !begin.ok()) {
    // The runtime has put back what the policy staged.
    return absl::Status(begin.code(), str_cat("Adam step failed before any kernel ran (nothing "
                                              "changed; it can be retried): ",
                                              begin.message()));
  }
  if (found_inf != nullptr) skips_possible_ = true;
  // Note [A failed step]
  // ~~~~~~~~~~~~~~~~~~~~
  // Parameters are stepped one launch after another, so a step that fails part way has stepped
  // those launched before the failure (last_step_parameters() lists them). What it guarantees: no
  // tensor is left held, the policy's end of step runs (staged states go home), every byte is
  // intact (each tensor is either stepped or as it was), and the runtime takes the next step. If no
  // kernel was queued yet, the step counters go back too, so a retry is exact; otherwise the error
  // says which layers were stepped (restore a checkpoint to redo the step). Each parameter's step
  // count moves when its kernel is queued (See Note [Per-parameter steps]), so the counts always
  // say which parameters took the step. One limit: a kernel call on a GPU may be several launches
  // (a layer of many tensors or chunks), and a launch that fails after an earlier one of the same
  // call was queued leaves that call's tensors partly stepped and uncounted. cudaGetLastError
  // reports such a failure only for an asynchronous fault of earlier work, which leaves the device
  // unusable, so nothing is retried after it; a launch that fails for its own configuration fails
  // the call's first launch too.
  std::vector<rt::TensorHandle> held;
  int failed_layer = -1;
  absl::Status status = step_layers(grad_scale, found_inf, held, failed_layer);
  stepped_every_layer_ = status.ok();
  if (status.ok()) {
    // Every layer is stepped; the policy's end of step is resumable, so one failure is retried.
    absl::Status end = rt.end_optimizer_step();
    if (!end.ok()) end = rt.end_optimizer_step();
    if (!end.ok()) {
      return absl::Status(end.code(), str_cat("Adam step ", step_number(),
                                              " stepped every layer, but the policy's end of "
                                              "step failed twice (the next hook finishes it): ",
                                              end.message()));
    }
    return absl::OkStatus();
  }
  // Two tries: a device that cannot record one event may record the next.
  for (int attempt = 0; attempt < 2 && !held.empty(); ++attempt) {
    if (rt.release(held, rt.compute_stream()).ok()) held.clear();
  }
  (void)rt.end_optimizer_step();  // what it cannot finish, the next hook does
  if (last_step_.size() == stepped_before) {
    return absl::Status(status.code(), str_cat("Adam step failed before any kernel ran (nothing ",
                                               new_step ? "" : "more ",
                                               "changed; it can be retried): ", status.message()));
  }
  std::string layers;
  for (int l : last_step_layers()) str_append(&layers, layers.empty() ? "" : ", ", l);
  return absl::Status(
      status.code(),
      str_cat("Adam step ", step_number(), " failed at layer ", failed_layer, " after stepping ",
              last_step_.size(), " of ", slots_.size(), " parameters (in layers ", layers,
              "); restore a checkpoint to redo the step: ", status.message()));
}

std::vector<int> Adam::last_step_layers() const {
  std::vector<int> out;
  for (rt::TensorHandle p : last_step_) {
    const int layer = slots_[slot_of_param_.at(p.id)].layer;
    if (std::find(out.begin(), out.end(), layer) == out.end()) out.push_back(layer);
  }
  return out;
}

StepTensor Adam::kernel_tensor(std::size_t index,
                               const std::array<void*, 2 + kMaxStates>& ptrs) const {
  const Slot& s = slots_[index];
  StepTensor t;
  t.param = ptrs[0];
  t.grad = ptrs[1];
  for (int j = 0; j < kMaxStates; ++j) t.states[j] = ptrs[2 + j];
  if (s.master_at >= 0) t.master = static_cast<float*>(ptrs[2 + s.master_at]);
  t.param_type = s.param_type;
  t.grad_type = s.grad_type;
  t.state_type = options_.state_dtype;
  t.seed = s.seed;
  t.numel = s.numel;
  t.step = s.steps + 1;
  t.skipped = skips_possible_ ? skipped_ + index : nullptr;
  return t;
}

absl::Status Adam::launch(const std::vector<StepTensor>& list, const std::vector<std::size_t>& of,
                          std::size_t g, const float* grad_scale, const float* found_inf) {
  if (list.empty()) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(queue_kernel(list, groups_[g].hyper, grad_scale, found_inf));
  for (std::size_t index : of) {
    ++slots_[index].steps;
    last_step_.push_back(slots_[index].param);
  }
  return absl::OkStatus();
}

absl::Status Adam::queue_kernel(const std::vector<StepTensor>& list, const AdamHyper& hyper,
                                const float* grad_scale, const float* found_inf) {
  if (list.empty()) return absl::OkStatus();
  rt::Runtime& rt = runtime_;
  const rt::StreamHandle stream = rt.compute_stream();
  if (rt.device().is_simulated()) {
    // The host function holds the pool too: it may run after the optimizer is gone.
    if (cpu_pool_ == nullptr) cpu_pool_ = std::make_shared<ThreadPool>(options_.cpu_threads);
    return rt.device().enqueue_host(
        stream, [list, hyper, rule = options_.rule, pool = cpu_pool_, grad_scale, found_inf] {
          if (found_inf != nullptr && *found_inf != 0.0f) {
            rule->count_skipped_host(list.data(), list.size());  // See Note [Skipped steps]
            return;
          }
          const float inv = grad_scale != nullptr ? 1.0f / *grad_scale : 1.0f;
          rule->step_host(list.data(), list.size(), hyper, inv, pool.get());
        });
  }
#ifdef STRATA_HAS_CUDA
  const cudaError_t err = options_.rule->step_gpu(list.data(), list.size(), hyper, grad_scale,
                                                  found_inf, static_cast<cudaStream_t>(stream));
  return alloc::cuda_status(err, str_cat(options_.rule->name(), " kernel launch"));
#else
  return absl::UnavailableError("Adam on a CUDA device needs strata built with CUDA");
#endif
}

absl::Status Adam::step_layers(const float* grad_scale, const float* found_inf,
                               std::vector<rt::TensorHandle>& held, int& failed_layer) {
  rt::Runtime& rt = runtime_;
  const rt::StreamHandle stream = rt.compute_stream();
  // Layers stepped on the host, in turn with the GPU layers (See Note [Host layers between GPU
  // layers] in adam_host_step.cpp).
  std::vector<int> host;
  for (int layer : host_layers_) {
    if (by_layer_.count(layer) != 0 &&
        std::find(overlapped_.begin(), overlapped_.end(), layer) == overlapped_.end()) {
      host.push_back(layer);
    }
  }
  struct EndHostSteps {
    Adam* adam;
    ~EndHostSteps() { adam->end_host_steps(); }
  } end_host_steps_on_return{this};
  if (!host.empty()) STRATA_RETURN_IF_ERROR(begin_host_steps(host, grad_scale, found_inf));
  auto stepped_before = [&](int layer) {
    return std::find(overlapped_.begin(), overlapped_.end(), layer) != overlapped_.end();
  };
  std::size_t gpu_layers = 0, gpu_queued = 0;
  for (int layer : rt.optimizer_layer_order()) {
    if (!stepped_before(layer) && !steps_on_host(layer)) ++gpu_layers;
  }
  // After the q-th GPU layer, the host layers up to (q / gpu_layers of them) - 1.
  auto step_host_until = [&](std::size_t n) -> absl::Status {
    if (n <= host_stepped_ || host_stepped_ >= host.size()) return absl::OkStatus();
    failed_layer = host[host_stepped_];
    return step_host_layers(n);
  };

  for (int layer : rt.optimizer_layer_order()) {
    // Stepped during backward already (See Note [Overlapped step] in adam.h).
    if (stepped_before(layer)) continue;
    if (steps_on_host(layer)) continue;
    auto it = by_layer_.find(layer);
    // Note [Per-parameter pipelining]
    // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    // A staged layer arrives tensor by tensor, so its parameters are stepped one at a time in the
    // order their moments arrive (See Note [Staging order] in runtime.h), each released right after
    // its kernel: the first kernel starts when the first parameter's moments are in, and each
    // write-back can start while the rest of the layer is still arriving. That shortens the time
    // only one copy direction is busy at the start and end of the step. A resident layer gets one
    // multi-tensor launch per group instead.
    failed_layer = layer;
    const std::vector<std::size_t>& arrived = arrival_order(layer);
    const bool pipelined = !arrived.empty();
    std::vector<std::vector<StepTensor>> per_group(groups_.size());
    std::vector<std::vector<std::size_t>> slots_of_group(groups_.size());
    if (it != by_layer_.end()) {
      for (std::size_t index : pipelined ? arrived : it->second) {
        if (skip_[index]) continue;  // See Note [Per-parameter steps]
        const Slot* s = &slots_[index];
        std::array<void*, 2 + kMaxStates> ptrs = {};
        const std::array<rt::TensorHandle, 2 + kMaxStates> hs = s->kernel_tensors();
        for (int k = 0; k < 2 + kMaxStates; ++k) {
          if (!hs[k].valid()) continue;
          absl::StatusOr<void*> p = rt.acquire(hs[k], rt::Tier::kGpu, stream);
          if (!p.ok()) return p.status();  // step() releases what is held
          held.push_back(hs[k]);
          ptrs[k] = *p;
        }
        if (!hs[1].valid()) ptrs[1] = const_cast<void*>(s->given_grad);  // checked before
        const StepTensor t = kernel_tensor(index, ptrs);
        if (pipelined) {
          STRATA_RETURN_IF_ERROR(launch({t}, {index}, s->group, grad_scale, found_inf));
          STRATA_RETURN_IF_ERROR(rt.release(held, stream));
          held.clear();
        } else {
          per_group[s->group].push_back(t);
          slots_of_group[s->group].push_back(index);
        }
      }
    }
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      STRATA_RETURN_IF_ERROR(launch(per_group[g], slots_of_group[g], g, grad_scale, found_inf));
    }
    STRATA_RETURN_IF_ERROR(rt.release(held, stream));
    held.clear();
    // Tell the policy the layer is done (write-back, next prefetch); its tensors are released.
    STRATA_RETURN_IF_ERROR(rt.release_layer(layer, rt::RoleSet(), stream));
    const std::size_t share = ++gpu_queued * host.size() / gpu_layers;
    STRATA_RETURN_IF_ERROR(step_host_until(share > 0 ? share - 1 : 0));
  }
  if (!host.empty()) {
    STRATA_RETURN_IF_ERROR(step_host_until(host.size()));
    failed_layer = host.back();
    STRATA_RETURN_IF_ERROR(finish_host_steps());
  }
  return absl::OkStatus();
}

const std::vector<std::size_t>& Adam::arrival_order(int layer) {
  arrival_order_.clear();
  runtime_.staged_tensors(layer, arrived_);
  if (arrived_.empty()) return arrival_order_;
  auto listed = [&](std::size_t index) {
    return std::find(arrival_order_.begin(), arrival_order_.end(), index) != arrival_order_.end();
  };
  for (rt::TensorHandle h : arrived_) {
    auto it = slot_of_state_.find(h.id);
    if (it != slot_of_state_.end() && slots_[it->second].layer == layer && !listed(it->second)) {
      arrival_order_.push_back(it->second);
    }
  }
  // Slots with nothing staged (empty tensors take no slot space) follow in registration order.
  if (auto it = by_layer_.find(layer); it != by_layer_.end()) {
    for (std::size_t index : it->second) {
      if (!listed(index)) arrival_order_.push_back(index);
    }
  }
  return arrival_order_;
}

}  // namespace strata::optim
