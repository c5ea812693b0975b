// optim/adam_host_speculation.cpp: host-stepped layers stepped during backward, speculatively
// (See Note [Host steps in backward]): posting their steps, and putting their states back or their
// parameters forward once finish_step knows whether the speculation held. What is in flight (the
// thread, the jobs, the undo buffer, waiting for them) is HostSpeculation's (host_speculation.h).
//
// Note [Host steps in backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// In an overlapped step (See Note [Overlapped step] in adam.h) a layer stepped on the host (See
// Note [Host-stepped layers] in adam_host_step.cpp) is stepped as soon as its gradients are final,
// like the GPU's layers, instead of after backward. step_layer queues its gradients' copy to the
// pinned buffers behind the compute stream (the first such layer of a step also queues the reads
// of the speculative loss scale and of every host slot's bias corrections) and posts the rest to
// one host thread (SerialWorker), so that backward goes on: that thread waits for the gradients
// and runs the host kernel on the pool, which keeps the states it writes (moments, masters) in a
// pageable undo buffer as it goes (See Note [Undo in the host kernel] in kept_states.h), dividing
// by the loss scale alone, as the GPU's speculative kernels do
// (a low-precision parameter's pinned copy needs no undo: a redo writes it again, and a step that
// inf skips sends nothing back). The thread makes the runtime's GPU its current device first.
// Backward's link and host memory are mostly idle in that time. The layer's parameters stay as
// they are on the GPU: finish_step copies them over only once the speculation held, so nothing a
// loop reads on the GPU changes before step(), and a step taken back has nothing to undo there.
//
// Held: the undo is dropped, and each layer's parameters are queued to the GPU as its host step
// ends, which the compute stream waits for (See Note [Finishing a held step] in adam_overlap.cpp,
// also for a host step that failed). Otherwise (clipping fired, inf found), finish_step waits for
// the host thread, every layer whose states were kept gets them back, and the step is taken again
// after backward, as for the GPU's layers; cancel_step puts them back the same way. The result is
// bitwise the sequential step's: the host kernel reads the same bias corrections from the device
// and the same scale as it would after backward.
//
// The undo buffer holds a copy of every host slot's states (as many bytes as they take),
// allocated at the first such step; where the pageable tier has no room for it, host layers are
// left for finish_step, as before. On the simulated device the host thread's work runs in
// step_layer itself: its device runs queued work on whichever thread waits, under its own lock,
// and the simulated device is for logic, not overlap.
#include <algorithm>
#include <cstring>
#include <memory>

#include "base/status.h"
#include "base/strings.h"
#include "base/thread_pool.h"
#include "optim/adam.h"
#include "optim/adam_kernels.h"

namespace strata::optim {
namespace {

// A copy of `bytes` split over the pool, in ranges of at least 4 MiB.
void parallel_copy(ThreadPool& pool, void* dst, const void* src, std::size_t bytes) {
  parallel_ranges(&pool, static_cast<std::int64_t>(bytes), std::int64_t{4} << 20, 64,
                  [&](std::int64_t begin, std::int64_t end) {
                    std::memcpy(static_cast<char*>(dst) + begin,
                                static_cast<const char*>(src) + begin,
                                static_cast<std::size_t>(end - begin));
                  });
}

}  // namespace

absl::StatusOr<std::vector<Adam::Written>> Adam::host_written(std::size_t index) const {
  std::vector<Written> out;
  for (rt::TensorHandle h : slots_[index].states()) {
    if (!h.valid()) continue;
    STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, runtime_.info(h));
    STRATA_ASSIGN_OR_RETURN(void* data, resting_address(h, rt::Tier::kPinnedHost));
    StateLayout layout = StateLayout::kF32;
    if (info.spec.dtype == rt::DType::kBFloat16) {
      layout = StateLayout::kBF16;
    } else if (info.spec.dtype == rt::DType::kUInt8 &&
               static_cast<std::int64_t>(info.bytes) == int8_state_bytes(slots_[index].numel)) {
      layout = StateLayout::kInt8Blocks;
    } else if (info.spec.dtype != rt::DType::kFloat32) {
      return absl::InternalError(str_cat("Adam: the host step cannot keep state '", info.spec.name,
                                         "' (", rt::dtype_name(info.spec.dtype), ", ", info.bytes,
                                         " bytes) for a redo"));
    }
    out.push_back({data, info.bytes, layout});
  }
  return out;
}

absl::Status Adam::speculate_host_layer(int layer) {
  if (host_speculation_.undo_refused()) return absl::OkStatus();  // left for finish_step
  rt::Runtime& rt = runtime_;
  rt::Device& dev = rt.device();
  const std::vector<std::size_t>& slots = by_layer_.at(layer);
  STRATA_RETURN_IF_ERROR(check_gradients_given(slots));
  if (!host_speculation_.has_undo()) {
    std::vector<std::size_t> slot_bytes(slots_.size(), 0);
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      if (!steps_on_host(slots_[i].layer)) continue;
      STRATA_ASSIGN_OR_RETURN(const std::vector<Written> written, host_written(i));
      for (const Written& w : written) slot_bytes[i] += w.bytes;
    }
    STRATA_RETURN_IF_ERROR(host_speculation_.make_undo(slot_bytes));
    if (host_speculation_.undo_refused()) return absl::OkStatus();
  }
  if (host_speculation_.speculated().empty()) {
    // Every host slot's bias corrections at once, and the scale the speculation divides by.
    std::vector<int> host;
    for (int l : host_layers_) {
      if (by_layer_.count(l) != 0) host.push_back(l);
    }
    STRATA_RETURN_IF_ERROR(queue_host_scalars(host, speculative_scale_, nullptr));
  }
  HostSpeculation::Speculated& spec = host_speculation_.add(layer);
  // Until it is posted, a failure leaves the layer for finish_step: nothing was stepped.
  auto unposted = [&](absl::Status s) {
    host_speculation_.drop_unposted();
    return s;
  };
  absl::StatusOr<rt::EventHandle> arrived = queue_gradients_out(layer);
  if (!arrived.ok()) return unposted(arrived.status());
  spec.arrived = *arrived;
  std::vector<std::vector<StepTensor>> per_group;
  if (absl::Status s = host_kernel_tensors(layer, per_group, spec.stepped); !s.ok()) {
    return unposted(s);
  }
  // What each stepped slot's kernel keeps, and where (See Note [Undo in the host kernel] in
  // kept_states.h). The tensors point into `kept`, which the job shares: its elements stay where
  // they are however the job is moved or copied.
  auto kept = std::make_shared<std::vector<KeptStates>>(spec.stepped.size());
  std::vector<std::size_t> in_group(groups_.size(), 0);
  for (std::size_t i = 0; i < spec.stepped.size(); ++i) {
    const std::size_t index = spec.stepped[i];
    absl::StatusOr<std::vector<Written>> written = host_written(index);
    if (!written.ok()) return unposted(written.status());
    char* at = host_speculation_.undo_at(index);
    for (const Written& w : *written) {
      KeptStates& k = (*kept)[i];
      k.states[k.count++] = {w.data, at, w.layout};
      at += w.bytes;
    }
    // host_kernel_tensors lists a group's tensors in the order of `stepped`.
    const std::size_t g = slots_[index].group;
    per_group[g][in_group[g]++].keep = &(*kept)[i];
  }
  // The groups' hyperparameters as they are now (set_hyper may change them before the job runs).
  std::vector<AdamHyper> hypers;
  for (const ParamGroup& g : groups_) hypers.push_back(g.hyper);
  // Posted: the layer counts as stepped (finish_step or cancel_step takes it back if need be).
  for (std::size_t index : spec.stepped) {
    ++slots_[index].steps;
    last_step_.push_back(slots_[index].param);
  }
  overlapped_.push_back(layer);
  // The loss scale as the speculation takes it: the simulated device's is a host pointer, read
  // once the gradients are in (the compute stream is past it); a GPU's was read into the pinned
  // scalars in stream order (queue_host_scalars).
  const float* scale = dev.is_simulated() ? speculative_scale_ : host_scalars_;
  ThreadPool* threads = &pool();
  // The kernels keep every state before they overwrite it (where `kept` says).
  host_speculation_.post(spec, [threads, per_group = std::move(per_group), kept = std::move(kept),
                                hypers = std::move(hypers), rule = options_.rule, scale] {
    (void)kept;
    const float inv = 1.0f / (scale != nullptr ? *scale : 1.0f);  // as the CUDA kernel takes it
    for (std::size_t g = 0; g < per_group.size(); ++g) {
      if (per_group[g].empty()) continue;
      rule->step_host(per_group[g].data(), per_group[g].size(), hypers[g], inv, threads);
    }
  });
  return absl::OkStatus();
}

void Adam::put_back_host_states(std::size_t index, const char* undo) {
  // Where the host step found them: nothing moves a host layer's states during a step.
  absl::StatusOr<std::vector<Written>> written = host_written(index);
  STRATA_CHECK(written.ok(),
               "a host-stepped state moved during its step: ", written.status().message());
  for (const Written& w : *written) {
    parallel_copy(pool(), w.data, undo, w.bytes);
    undo += w.bytes;
  }
}

absl::Status Adam::return_speculated_parameters(const float* grad_scale, const float* found_inf) {
  if (host_speculation_.speculated().empty()) return absl::OkStatus();
  // See Note [Finishing a held step] in adam_overlap.cpp. Queued again by a call again after a
  // failure: the same bytes.
  for (HostSpeculation::Speculated& spec : host_speculation_.speculated()) {
    host_speculation_.wait_for_host_step(spec);
    if (!spec.status.ok()) {
      // Stepped now, parameters queued back with it.
      STRATA_RETURN_IF_ERROR(step_failed_host_layer(spec, grad_scale, found_inf));
      continue;
    }
    STRATA_RETURN_IF_ERROR(queue_parameters_back(spec.stepped));
  }
  STRATA_RETURN_IF_ERROR(wait_for_parameters_back());
  host_speculation_.forget();
  return absl::OkStatus();
}

absl::Status Adam::step_failed_host_layer(HostSpeculation::Speculated& spec,
                                          const float* grad_scale, const float* found_inf) {
  if (!spec.counted_back) {
    for (std::size_t index : spec.stepped) {
      --slots_[index].steps;
      auto it = std::find(last_step_.begin(), last_step_.end(), slots_[index].param);
      if (it != last_step_.end()) last_step_.erase(it);
    }
    spec.counted_back = true;
  }
  // The pinned scalars it writes are those the jobs posted after it read.
  host_speculation_.wait_for_host_steps();
  const std::size_t counted = last_step_.size();
  absl::Status s = begin_host_steps({spec.layer}, grad_scale, found_inf);
  if (s.ok()) s = finish_host_steps();
  end_host_steps();
  // Its kernel ran (a failure after it queues the parameters again, as for any host step).
  if (last_step_.size() != counted || spec.stepped.empty()) spec.status = absl::OkStatus();
  if (!s.ok()) {
    return absl::Status(
        s.code(), str_cat("Adam: finish_step: the host step of layer ", spec.layer,
                          " in backward failed, and stepping it again failed: ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace strata::optim
