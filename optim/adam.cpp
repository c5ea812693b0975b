// optim/adam.cpp: Adam's step (step(), the layer loop and the kernels it queues), its budget
// checks, hyperparameters and names. Making one is adam_create.cpp's; host-stepped layers are
// adam_host_step.cpp's, the overlapped step adam_overlap.cpp's.
#include "optim/adam.h"

#include <algorithm>
#include <map>
#include <string>

#include "allocator/cuda_status.h"
#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "optim/adam_kernels.h"

namespace strata::optim {

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
  const absl::Status ended =
      end_step(rt::StepKind::kAfterBackward);  // See Note [Per-parameter steps]
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
