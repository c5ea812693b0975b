// optim/adam_host_step.cpp: stepping Adam's layers whose step the policy put on the host (See Note
// [Step placement] in runtime/policy.h): their pinned buffers, and their step around the GPU
// layers' step. Where each layer steps is adam_placement.cpp's.
//
// Note [Host-stepped layers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A layer stepped on the host keeps its states where they rest, in pinned memory, and moves only
// its gradients out and its parameters back: its gradients are copied to pinned buffers on a
// stream of their own, once the compute stream has produced them; the host kernel steps the
// layer's states on the pool's threads as they arrive; and its parameters are queued back to the
// GPU on another stream, which the compute stream waits for before anything that follows the step.
// The GPU layers' step (their states stream as under layer_prefetch) is queued in between (See
// Note [Host layers between GPU layers]). So the host kernel runs while the GPU layers stream, and
// the step returns once the host is done.
//
// A float32 parameter stepped on the host keeps a float32 master copy there (master_param, as a
// bfloat16 or float16 parameter does everywhere), which the host kernel steps and the GPU's
// parameter is copied from: otherwise the parameter would have to come to the host at every step
// too. As with every master copy (and as torchao's and DeepSpeed's offloaded optimizers do), the
// master is the parameter's value: a write to the parameter on the GPU between steps is overwritten
// by the next step, unless the optimizer's state is loaded after it (load and load_state_dict take
// a float32 parameter's master from the parameter: See Note [Float32 masters follow the split] in
// adam_placement.cpp).
//
// The host kernel reads the step's grad_scale and found_inf and its bias corrections from the
// device, copied to pinned memory in stream order before the gradients (See Note [Bias
// corrections from the device] in adam_kernels.h), so a host-stepped layer's result is bitwise
// the result of the same layer stepped on the GPU. A step found_inf skips is counted on the host
// for these layers (See Note [Skipped steps] in adam_kernels.h). In an overlapped step (See Note
// [Overlapped step] in adam.h) they are stepped during backward instead, speculatively (See Note
// [Host steps in backward] in adam_host_speculation.cpp).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iterator>
#include <map>
#include <set>
#include <thread>
#include <tuple>
#include <utility>

#include "allocator/cuda_status.h"
#include "base/status.h"
#include "base/strings.h"
#include "optim/adam.h"
#include "optim/adam_kernels.h"
#include "optim/step_rates.h"

namespace strata::optim {
namespace {

// Where a host slot's pinned buffers start: a cache line apart.
constexpr std::size_t kAlign = 64;

std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

}  // namespace

// Note [Host steps hold nothing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A host step reads and writes its tensors where they rest, by address, without acquiring them:
// under hybrid nothing moves a parameter, a gradient or a host-stepped layer's states during a step
// (its policy streams only the GPU layers' states), and every copy the step queues is done or
// ordered before the compute stream's next work when the step returns (the host waited for the
// gradients; the compute stream waits for the parameters); for a host step taken in backward, when
// finish_step or cancel_step returns (See Note [Host steps in backward] in
// adam_host_speculation.cpp). Holding them would add a release per
// tensor that can fail, and a failed release leaves a tensor held, so a device error in a host
// step would fail every later hook.
absl::StatusOr<void*> Adam::resting_address(rt::TensorHandle h, rt::Tier tier) const {
  STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, runtime_.info(h));
  if (info.in_flight || info.staged || info.tier != tier) {
    return absl::FailedPreconditionError(
        str_cat("Adam: a host step needs '", info.spec.name, "' resting on ",
                alloc::tier_name(tier), ", and it is ", info.in_flight ? "moving" : "staged or on ",
                info.in_flight || info.staged ? "" : alloc::tier_name(info.tier)));
  }
  return info.data;
}

absl::Status Adam::sync_host_streams() {
  for (rt::StreamHandle s : {host_d2h_, host_h2d_}) {
    if (s != nullptr) STRATA_RETURN_IF_ERROR(runtime_.device().stream_synchronize(s));
  }
  return absl::OkStatus();
}

namespace {

std::int64_t ns_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t)
      .count();
}

}  // namespace

Adam::HostStepSeconds Adam::host_step_seconds() const {
  return {host_queued_ns_.load() * 1e-9, host_waited_ns_.load() * 1e-9,
          host_kernel_ns_.load() * 1e-9};
}

int Adam::host_threads() const {
  return options_.cpu_threads > 0
             ? options_.cpu_threads
             : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

ThreadPool& Adam::pool() {
  if (cpu_pool_ == nullptr) cpu_pool_ = std::make_shared<ThreadPool>(host_threads());
  return *cpu_pool_;
}

absl::Status Adam::make_host_buffers() {
  if (!runtime_.places_steps()) return absl::OkStatus();
  host_slots_.assign(slots_.size(), HostSlot{});
  // grad_scale and found_inf, then the rule's scalars from the device for each slot at most (See
  // Note [Scalars from the device] in step_rule.h): for every slot, so that it never changes when
  // layers move (See Note [Measured split] in policies/split_search.h).
  const std::size_t head =
      (4 + static_cast<std::size_t>(options_.rule->host_scalars()) * slots_.size()) * sizeof(float);
  STRATA_ASSIGN_OR_RETURN(
      void* scalars,
      runtime_.allocator().allocate(rt::Tier::kPinnedHost, head,
                                    {.owner = "Adam: the scalars host-stepped layers read"}));
  host_scalars_ = static_cast<float*>(scalars);
  for (int layer : host_layers_) STRATA_RETURN_IF_ERROR(make_layer_buffer(layer));
  return absl::OkStatus();
}

absl::Status Adam::make_layer_buffer(int layer) {
  auto it = by_layer_.find(layer);
  if (it == by_layer_.end() || host_buffers_.count(layer) != 0) return absl::OkStatus();
  std::size_t bytes = 0;
  for (std::size_t i : it->second) {
    const Slot& s = slots_[i];
    bytes += aligned(static_cast<std::size_t>(s.numel) * grad_buffer_elem(s));
    if (s.param_type != ElemType::kF32) {
      bytes += aligned(static_cast<std::size_t>(s.numel) * elem_size(s.param_type));
    }
  }
  if (bytes == 0) return absl::OkStatus();
  STRATA_ASSIGN_OR_RETURN(void* buffer,
                          runtime_.allocator().allocate(
                              rt::Tier::kPinnedHost, bytes,
                              {.owner = "Adam: a host-stepped layer's gradients and parameters"}));
  host_buffers_[layer] = buffer;
  char* next = static_cast<char*>(buffer);
  for (std::size_t i : it->second) {
    const Slot& s = slots_[i];
    host_slots_[i].grad = next;
    next += aligned(static_cast<std::size_t>(s.numel) * grad_buffer_elem(s));
    if (s.param_type != ElemType::kF32) {
      host_slots_[i].param = next;
      next += aligned(static_cast<std::size_t>(s.numel) * elem_size(s.param_type));
    }
  }
  return absl::OkStatus();
}

absl::Status Adam::free_layer_buffer(int layer) {
  auto it = host_buffers_.find(layer);
  if (it == host_buffers_.end()) return absl::OkStatus();
  void* const buffer = it->second;
  host_buffers_.erase(it);
  for (std::size_t i : by_layer_.at(layer)) host_slots_[i] = HostSlot{};
  return runtime_.allocator().deallocate(rt::Tier::kPinnedHost, buffer);
}

absl::Status Adam::queue_host_scalars(const std::vector<int>& layers, const float* grad_scale,
                                      const float* found_inf) {
  rt::Device& dev = runtime_.device();
  if (host_d2h_ == nullptr) {
    STRATA_ASSIGN_OR_RETURN(host_d2h_, dev.create_stream());
    STRATA_ASSIGN_OR_RETURN(host_h2d_, dev.create_stream());
  }
  // One request per group and settled step t (See Note [Skipped steps] in adam_kernels.h): the
  // host alone counts these slots' skipped steps, so t is known here.
  const StepRule& rule = *options_.rule;
  const int per = rule.host_scalars();  // See Note [Scalars from the device] in step_rule.h
  std::vector<const AdamHyper*> hypers;
  std::vector<std::int64_t> steps;
  std::map<std::pair<std::size_t, std::int64_t>, int> request_of;
  for (int layer : layers) {
    for (std::size_t index : by_layer_.at(layer)) {
      if (skip_[index] || per == 0) continue;
      const Slot& s = slots_[index];
      const std::int64_t t = s.steps + 1 - (skips_possible_ ? skipped_[index] : 0);
      auto [it, added] = request_of.try_emplace({s.group, t}, static_cast<int>(hypers.size()));
      if (added) {
        hypers.push_back(&groups_[s.group].hyper);
        steps.push_back(t);
      }
      host_slots_[index].request = it->second;
    }
  }
  float* device_scalars = host_scalars_ + 4;
  host_scalars_[0] = 1.0f;  // no grad_scale: 1; no found_inf: 0 (the reads below skip a null)
  host_scalars_[1] = 0.0f;
  if (dev.is_simulated()) {
    // The simulated device's kernel is the host kernel: its scalars are the host's.
    for (std::size_t r = 0; r < hypers.size(); ++r) {
      rule.host_scalars_cpu(*hypers[r], steps[r], device_scalars + per * r);
    }
    return absl::OkStatus();
  }
#ifdef STRATA_HAS_CUDA
  const auto stream = static_cast<cudaStream_t>(runtime_.compute_stream());
  cudaError_t err = adam_read_floats_cuda({grad_scale, found_inf, nullptr}, host_scalars_, stream);
  if (err == cudaSuccess && !hypers.empty()) {
    err = rule.queue_host_scalars(hypers, steps, device_scalars, stream);
  }
  return alloc::cuda_status(err, "Adam: reading the step's scalars for the host");
#else
  return absl::UnavailableError("Adam on a CUDA device needs strata built with CUDA");
#endif
}

// Note [Host layers between GPU layers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// One host thread queues the GPU layers' step and runs the host kernel, and each copy engine
// serves its direction's copies in the order they were queued, whatever their stream. So the
// order of the host's work is the step's schedule:
// - Queueing every GPU layer first kept the host kernel waiting for it (a few ms a step, on the
//   critical path when the host is the slower side), so step_layers queues the GPU layers and
//   steps the host layers in turn, in proportion to their counts, the GPU a layer or two ahead: a
//   GPU layer takes the link about as long as a host layer takes the host, and its prefetches are
//   queued as the layers before it are released.
// - Queueing every host layer's gradients first put them all ahead of the first GPU layers'
//   write-backs on the device-to-host engine, and the refills those write-backs free waited too.
//   The gradients go kGradientsAhead host layers ahead of the host kernel instead, each behind
//   the compute stream's point where the step began (where every gradient is final), not where
//   it is when queued (behind the GPU layers' kernels).
// A host layer's parameters are queued back as its kernel ends; what follows the step on the
// compute stream waits for them, also when the step fails part way (end_host_steps).
constexpr std::size_t kGradientsAhead = 2;

absl::Status Adam::begin_host_steps(const std::vector<int>& layers, const float* grad_scale,
                                    const float* found_inf) {
  rt::Device& dev = runtime_.device();
  host_began_ = std::chrono::steady_clock::now();
  host_pending_ = layers;
  host_stepped_ = 0;
  host_params_queued_ = false;
  STRATA_RETURN_IF_ERROR(queue_host_scalars(layers, grad_scale, found_inf));
  // The gradients are final once the compute stream reaches here.
  STRATA_ASSIGN_OR_RETURN(host_grads_ready_, dev.record(runtime_.compute_stream()));
  if (dev.is_simulated()) {
    // Read in stream order on the simulated device too: after the gradients, the compute stream's
    // scalars are final.
    STRATA_RETURN_IF_ERROR(dev.stream_wait(host_d2h_, host_grads_ready_));
    float* scalars = host_scalars_;
    STRATA_RETURN_IF_ERROR(dev.enqueue_host(host_d2h_, [scalars, grad_scale, found_inf] {
      scalars[0] = grad_scale != nullptr ? *grad_scale : 1.0f;
      scalars[1] = found_inf != nullptr ? *found_inf : 0.0f;
    }));
    STRATA_ASSIGN_OR_RETURN(host_scalars_read_, dev.record(host_d2h_));
  }
  for (std::size_t k = 0; k < std::min(kGradientsAhead, layers.size()); ++k) {
    STRATA_ASSIGN_OR_RETURN(rt::EventHandle arrived,
                            queue_gradients_out(layers[k], host_grads_ready_));
    host_arrived_.push_back(arrived);
  }
  return absl::OkStatus();
}

absl::StatusOr<rt::EventHandle> Adam::queue_gradients_out(int layer, rt::EventHandle ready) {
  rt::Device& dev = runtime_.device();
  if (ready != nullptr) {
    STRATA_RETURN_IF_ERROR(dev.stream_wait(host_d2h_, ready));
  } else {
    // The gradients are final once the compute stream reaches here.
    STRATA_ASSIGN_OR_RETURN(rt::EventHandle now, dev.record(runtime_.compute_stream()));
    absl::Status waited = dev.stream_wait(host_d2h_, now);
    dev.release(now);
    STRATA_RETURN_IF_ERROR(waited);
  }
  for (std::size_t index : by_layer_.at(layer)) {
    if (skip_[index]) continue;
    const Slot& slot = slots_[index];
    const void* src = slot.given_grad;
    if (slot.grad.valid()) {  // See Note [Host steps hold nothing]
      STRATA_ASSIGN_OR_RETURN(src, resting_address(slot.grad, rt::Tier::kGpu));
    }
    const std::size_t bytes = static_cast<std::size_t>(slot.numel) * elem_size(slot.grad_type);
    STRATA_RETURN_IF_ERROR(dev.copy_async(host_slots_[index].grad, src, bytes, host_d2h_));
    host_step_bytes_.d2h += static_cast<std::int64_t>(bytes);
  }
  return dev.record(host_d2h_);
}

absl::Status Adam::host_kernel_tensors(int layer, std::vector<std::vector<StepTensor>>& per_group,
                                       std::vector<std::size_t>& stepped) const {
  per_group.assign(groups_.size(), {});
  stepped.clear();
  const float* device_scalars = host_scalars_ + 4;
  const int per = options_.rule->host_scalars();
  for (std::size_t index : by_layer_.at(layer)) {
    if (skip_[index]) continue;
    const Slot& s = slots_[index];
    // In kernel_tensors()' order: the parameter and gradient in their pinned buffers, the states
    // where they rest. A float32 parameter is its master here (every rule declares one for a
    // host-stepped layer): one buffer, stepped in place (See Note [A float32 parameter as its own
    // master] in adam_cpu.cpp).
    std::array<void*, 2 + kMaxStates> ptrs = {};
    ptrs[1] = host_slots_[index].grad;
    const std::array<rt::TensorHandle, 2 + kMaxStates> hs = s.kernel_tensors();
    for (int j = 2; j < 2 + kMaxStates; ++j) {
      if (!hs[j].valid()) continue;
      STRATA_ASSIGN_OR_RETURN(ptrs[j], resting_address(hs[j], rt::Tier::kPinnedHost));
    }
    if (s.master_at < 0) {
      return absl::InternalError(str_cat(options_.rule->name(), " declares no master copy for '",
                                         s.param_name, "', stepped on the host"));
    }
    ptrs[0] =
        host_slots_[index].param != nullptr ? host_slots_[index].param : ptrs[2 + s.master_at];
    StepTensor t = kernel_tensor(index, ptrs);
    if (per > 0) t.device_scalars = device_scalars + per * host_slots_[index].request;
    per_group[s.group].push_back(t);
    stepped.push_back(index);
  }
  return absl::OkStatus();
}

absl::Status Adam::queue_parameters_back(const std::vector<std::size_t>& stepped) {
  rt::Device& dev = runtime_.device();
  for (std::size_t index : stepped) {
    const Slot& s = slots_[index];
    STRATA_ASSIGN_OR_RETURN(void* dst, resting_address(s.param, rt::Tier::kGpu));
    const void* src = host_slots_[index].param;
    if (src == nullptr) {
      STRATA_ASSIGN_OR_RETURN(src, resting_address(s.master, rt::Tier::kPinnedHost));
    }
    const std::size_t bytes = static_cast<std::size_t>(s.numel) * elem_size(s.param_type);
    // A copy that cannot be queued is tried once more (See Note [A failed step] in adam.cpp for
    // what a failure says).
    absl::Status copied = dev.copy_async(dst, src, bytes, host_h2d_);
    if (!copied.ok()) copied = dev.copy_async(dst, src, bytes, host_h2d_);
    STRATA_RETURN_IF_ERROR(copied);
    host_step_bytes_.h2d += static_cast<std::int64_t>(bytes);
  }
  return absl::OkStatus();
}

absl::Status Adam::wait_for_parameters_back() {
  // What follows the step on the compute stream waits for the parameters.
  rt::Device& dev = runtime_.device();
  STRATA_ASSIGN_OR_RETURN(rt::EventHandle back, dev.record(host_h2d_));
  absl::Status waited = dev.stream_wait(runtime_.compute_stream(), back);
  dev.release(back);
  return waited;
}

absl::Status Adam::step_host_layers(std::size_t upto) {
  using Clock = std::chrono::steady_clock;
  rt::Device& dev = runtime_.device();
  upto = std::min(upto, host_pending_.size());
  if (host_stepped_ >= upto) return absl::OkStatus();
  if (host_stepped_ == 0) {
    host_queued_ns_ += ns_since(host_began_);
    // The scalars arrive before the first layer's gradients (on the simulated device, with a host
    // function of their own).
    const Clock::time_point t = Clock::now();
    STRATA_RETURN_IF_ERROR(
        dev.synchronize(dev.is_simulated() ? host_scalars_read_ : host_arrived_.front()));
    host_waited_ns_ += ns_since(t);
    host_inv_ = 1.0f / host_scalars_[0];  // as the CUDA kernel takes it
    host_inf_ = host_scalars_[1] != 0.0f;
  }
  std::vector<std::vector<StepTensor>> per_group;
  std::vector<std::size_t> stepped;
  for (; host_stepped_ < upto; ++host_stepped_) {
    const std::size_t k = host_stepped_;
    while (host_arrived_.size() < std::min(host_pending_.size(), k + 1 + kGradientsAhead)) {
      STRATA_ASSIGN_OR_RETURN(
          rt::EventHandle arrived,
          queue_gradients_out(host_pending_[host_arrived_.size()], host_grads_ready_));
      host_arrived_.push_back(arrived);
    }
    Clock::time_point t = Clock::now();
    STRATA_RETURN_IF_ERROR(dev.synchronize(host_arrived_[k]));
    host_waited_ns_ += ns_since(t);
    t = Clock::now();
    STRATA_RETURN_IF_ERROR(host_kernel_tensors(host_pending_[k], per_group, stepped));
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      if (per_group[g].empty()) continue;
      if (host_inf_) {
        options_.rule->count_skipped_host(per_group[g].data(), per_group[g].size());
      } else {
        options_.rule->step_host(per_group[g].data(), per_group[g].size(), groups_[g].hyper,
                                 host_inv_, &pool());
      }
    }
    // The layer is stepped: its states are. Its parameters go back to the GPU, unless inf skipped
    // the step, which changed nothing (a low-precision parameter's pinned copy may then hold
    // nothing yet).
    for (std::size_t index : stepped) {
      ++slots_[index].steps;
      last_step_.push_back(slots_[index].param);
    }
    host_kernel_ns_ += ns_since(t);
    if (!host_inf_ && !stepped.empty()) {
      host_params_queued_ = true;
      STRATA_RETURN_IF_ERROR(queue_parameters_back(stepped));
    }
  }
  return absl::OkStatus();
}

absl::Status Adam::finish_host_steps() {
  STRATA_RETURN_IF_ERROR(step_host_layers(host_pending_.size()));
  host_params_queued_ = false;
  return wait_for_parameters_back();
}

void Adam::end_host_steps() {
  rt::Device& dev = runtime_.device();
  // A step that failed part way: what follows on the compute stream still waits for the
  // parameters queued back (See Note [Host layers between GPU layers]).
  if (std::exchange(host_params_queued_, false)) (void)wait_for_parameters_back();
  for (rt::EventHandle e : host_arrived_) dev.release(e);
  host_arrived_.clear();
  for (rt::EventHandle* e : {&host_grads_ready_, &host_scalars_read_}) {
    if (*e != nullptr) dev.release(*e);
    *e = nullptr;
  }
  host_pending_.clear();
  host_stepped_ = 0;
}

}  // namespace strata::optim
