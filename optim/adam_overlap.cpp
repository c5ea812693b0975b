// optim/adam_overlap.cpp: the overlapped step (See Note [Overlapped step] in adam.h): step_layer,
// finish_step and what they share.
#include <algorithm>
#include <array>
#include <bit>

#include "allocator/cuda_status.h"
#include "base/status.h"
#include "base/strings.h"
#include "optim/adam.h"
#include "optim/adam_kernels.h"

namespace strata::optim {

absl::Status Adam::set_backward_share(double share) {
  if (!(share >= 0.0 && share <= 1.0)) {
    return absl::InvalidArgumentError(
        str_cat("Adam: backward share ", share,
                " is not in [0, 1] (the share of the states stepped in backward)"));
  }
  backward_share_ = share;
  return absl::OkStatus();
}

namespace {

// Whether a tensor rests in the GPU's main pool (not staged, not on its way elsewhere).
bool rests_on_gpu(const rt::TensorInfo& info) {
  return info.in_flight ? info.destination == rt::Tier::kGpu && !info.destination_staged
                        : info.tier == rt::Tier::kGpu && !info.staged;
}

}  // namespace

std::size_t Adam::layer_link_bytes(int layer) const {
  auto it = by_layer_.find(layer);
  if (it == by_layer_.end() || steps_on_host(layer)) return 0;
  std::size_t bytes = 0;
  for (std::size_t index : it->second) {
    for (rt::TensorHandle h : slots_[index].states()) {
      if (!h.valid()) continue;
      absl::StatusOr<rt::TensorInfo> info = runtime_.info(h);
      if (info.ok() && !rests_on_gpu(*info)) bytes += info->bytes;
    }
  }
  return bytes;
}

Adam::BackwardBytes Adam::backward_bytes() const {
  BackwardBytes out;
  for (const auto& [layer, slots] : by_layer_) {
    const std::size_t link = layer_link_bytes(layer);
    if (link == 0) continue;
    out.link_states += link;
    for (std::size_t index : slots) {
      const std::array<rt::TensorHandle, 2 + kMaxStates> hs = slots_[index].kernel_tensors();
      for (int k = 0; k < 2 + kMaxStates; ++k) {
        if (k == 1 || !hs[k].valid()) continue;  // the gradient is only read
        absl::StatusOr<rt::TensorInfo> info = runtime_.info(hs[k]);
        if (info.ok() && rests_on_gpu(*info)) out.resting += info->bytes;
      }
    }
  }
  return out;
}

bool Adam::layer_on_gpu(int layer) const {
  auto it = by_layer_.find(layer);
  if (it == by_layer_.end()) return true;
  for (std::size_t index : it->second) {
    const Slot& s = slots_[index];
    for (rt::TensorHandle h : s.kernel_tensors()) {
      if (!h.valid()) continue;
      absl::StatusOr<rt::TensorInfo> info = runtime_.info(h);
      if (!info.ok()) return false;
      const rt::Tier tier = info->in_flight ? info->destination : info->tier;
      if (info->bytes > 0 && tier != rt::Tier::kGpu) return false;
    }
  }
  return true;
}

absl::Status Adam::step_layer(int layer, const float* grad_scale) {
  rt::Runtime& rt = runtime_;
  STRATA_RETURN_IF_ERROR(finish_release());
  if (overlap_committed_) {
    return absl::FailedPreconditionError(
        str_cat("Adam: step_layer(", layer,
                "): the last step, taken during backward and committed, is not finished; call "
                "finish_step again to finish it (or restore a checkpoint)"));
  }
  if (!overlap_open_) {
    // See Note [Measured split] in policies/split_search.h: each layer steps where the policy
    // steps it.
    if (rt.places_steps()) STRATA_RETURN_IF_ERROR(follow_placement());
    STRATA_RETURN_IF_ERROR(check_can_step());
    overlap_open_ = true;
    speculative_scale_ = grad_scale;
    overlapped_.clear();
    last_step_.clear();
    // See Note [A share of the step in backward].
    rest_after_backward_ = false;
    backward_taken_ = 0;
    backward_allowed_ = kEveryLayer;
    if (backward_share_ < 1.0) {
      backward_allowed_ = static_cast<std::size_t>(
          backward_share_ * static_cast<double>(backward_bytes().link_states));
    }
  } else if (grad_scale != speculative_scale_) {
    return absl::InvalidArgumentError(
        str_cat("Adam: step_layer(", layer,
                ") with another grad_scale than the step's first layer; every layer of a step "
                "divides by the same loss scale"));
  }
  auto it = by_layer_.find(layer);
  if (it == by_layer_.end()) return absl::OkStatus();  // nothing of this optimizer's
  if (std::find(overlapped_.begin(), overlapped_.end(), layer) != overlapped_.end()) {
    return absl::FailedPreconditionError(
        str_cat("Adam: step_layer(", layer, ") twice in one step"));
  }
  // Note [A share of the step in backward]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A layer stepped in backward hides the link time of its states under backward's, but only while
  // backward lasts: past that its copies run after backward as they would in the step after it,
  // and whatever its undo copies off the GPU (its parameters, when the undo is in pinned memory)
  // is link time added for nothing. So a client may step in backward only a share of the states
  // that cross the link (set_backward_share; backward_bytes().link_states is the whole): layers
  // are taken in the order step_layer is called for them while the share reaches at least halfway
  // into the next (the nearest layer boundary), and from the first it does not on, every layer
  // whose states cross the link is left for finish_step, which steps them as step() would after
  // committing the rest. Layers whose states do not cross the link (resident on the GPU, or
  // stepped on the host) are neither counted nor left. The layers staged for backward that were
  // left stay in the ring for the step after it (See Note [Staged for a step not taken in
  // backward] in policies/state_streaming.cpp). strata.optim measures the share backward hides
  // (See Note [When to step in backward] in strata/_when.py).
  if (backward_allowed_ != kEveryLayer) {
    if (const std::size_t bytes = layer_link_bytes(layer); bytes > 0) {
      rest_after_backward_ =
          rest_after_backward_ || backward_taken_ + bytes / 2 > backward_allowed_;
      if (rest_after_backward_) return absl::OkStatus();
      backward_taken_ += bytes;
    }
  }
  // Stepped on the host, on a thread of its own (See Note [Host steps in backward] in
  // adam_host_speculation.cpp).
  if (steps_on_host(layer)) return speculate_host_layer(layer);
  // Acquiring a tensor that rests on the host would move it into the GPU's main pool for good:
  // such a layer is left for finish_step, where the policy streams it.
  if (!layer_on_gpu(layer)) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(check_gradients_given(it->second));
  // See Note [Resting layers], below. Without undo_on_gpu such a layer's undo could only cross the
  // link, so it waits for finish_step without being acquired.
  rt.staged_tensors(layer, arrived_);
  const bool over_link = !arrived_.empty();
  if (!over_link && !rt.undo_on_gpu()) return absl::OkStatus();
  const rt::StreamHandle stream = rt.compute_stream();
  std::vector<rt::TensorHandle> held;
  // What cannot be released now (a device error) is released by the next step_layer or
  // finish_step (finish_release).
  auto give_back = [&](absl::Status s) {
    for (int attempt = 0; attempt < 2 && !held.empty(); ++attempt) {
      if (rt.release(held, stream).ok()) held.clear();
    }
    unreleased_held_.insert(unreleased_held_.end(), held.begin(), held.end());
    held.clear();
    return s;
  };
  // Note [Resting layers]
  // ~~~~~~~~~~~~~~~~~~~~~
  // A layer with nothing staged rests wholly on the GPU, where its step after backward costs a pass
  // over GPU memory and no link time. Stepping it during backward hides that pass, worth it only
  // while its undo stays on the GPU too: copied to the host, the undo would add 14 bytes a bfloat16
  // parameter to the link's D2H direction, which the write-backs of the streamed layers keep busy
  // during backward. Such a layer waits for finish_step.
  std::vector<std::vector<StepTensor>> per_group(groups_.size());
  std::vector<std::vector<std::size_t>> slots_of_group(groups_.size());
  for (std::size_t index : it->second) {
    if (skip_[index]) continue;  // See Note [Per-parameter steps]
    const Slot& s = slots_[index];
    std::array<void*, 2 + kMaxStates> ptrs = {};
    const std::array<rt::TensorHandle, 2 + kMaxStates> hs = s.kernel_tensors();
    for (int k = 0; k < 2 + kMaxStates; ++k) {
      if (!hs[k].valid()) continue;
      absl::StatusOr<void*> p = rt.acquire(hs[k], rt::Tier::kGpu, stream);
      if (!p.ok()) return give_back(p.status());
      held.push_back(hs[k]);
      ptrs[k] = *p;
      if (k == 1) continue;  // the gradient is only read
      absl::Status kept = rt.keep_for_undo(hs[k], stream, over_link);
      // No room for the redo's copy (or none where it may go): the layer waits for the step after
      // backward.
      if (kept.code() == absl::StatusCode::kResourceExhausted) return give_back(absl::OkStatus());
      if (!kept.ok()) return give_back(kept);
    }
    // See Note [Gradients given at each step] in adam.h.
    if (!hs[1].valid()) ptrs[1] = const_cast<void*>(s.given_grad);
    per_group[s.group].push_back(kernel_tensor(index, ptrs));
    slots_of_group[s.group].push_back(index);
  }
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    // Speculation: no inf (found_inf is not known yet); grad_scale is the loss scale alone.
    absl::Status queued = launch(per_group[g], slots_of_group[g], g, speculative_scale_, nullptr);
    if (!queued.ok()) {
      // Groups queued before this one changed their parameters: the layer counts as stepped, and
      // finish_step's validation decides (a redo rolls those back too).
      if (g > 0) overlapped_.push_back(layer);
      return give_back(queued);
    }
  }
  overlapped_.push_back(layer);
  // The policy writes the layer back and fetches the next (See Note [Overlapped backward] in
  // policies/state_streaming.cpp).
  unreleased_layer_ = layer;
  unreleased_held_.insert(unreleased_held_.end(), held.begin(), held.end());
  held.clear();
  return finish_release();
}

absl::Status Adam::finish_release() {
  if (unreleased_layer_ < 0 && unreleased_held_.empty()) return absl::OkStatus();
  rt::Runtime& rt = runtime_;
  const rt::StreamHandle stream = rt.compute_stream();
  // Each part is done once, so that a failure can be finished by calling again.
  if (!unreleased_held_.empty()) {
    absl::Status s = rt.release(unreleased_held_, stream);
    if (!s.ok()) s = rt.release(unreleased_held_, stream);
    STRATA_RETURN_IF_ERROR(s);
    unreleased_held_.clear();
  }
  if (unreleased_layer_ < 0) return absl::OkStatus();
  absl::Status s = rt.release_layer(unreleased_layer_, rt::RoleSet(), stream);
  if (!s.ok()) s = rt.release_layer(unreleased_layer_, rt::RoleSet(), stream);
  STRATA_RETURN_IF_ERROR(s);
  unreleased_layer_ = -1;
  return absl::OkStatus();
}

// Note [Reading the step's scalars]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// finish_step reads three floats on the host. A copy to the host would go to a copy engine, where
// it queues behind the write-backs the overlapped step left running (the last layers' states, going
// home while the next step's forward begins), and waits for all of them. A one-thread kernel
// writing into pinned memory waits only for the compute stream.
absl::StatusOr<std::array<float, 3>> Adam::read_scalars(const std::array<const float*, 3>& p,
                                                        const std::array<float, 3>& absent) {
  rt::Runtime& rt = runtime_;
  std::array<float, 3> out = absent;
  if (std::all_of(p.begin(), p.end(), [](const float* x) { return x == nullptr; })) return out;
  const rt::StreamHandle stream = rt.compute_stream();
  float* dst = read_back_;
  if (rt.device().is_simulated()) {
    STRATA_RETURN_IF_ERROR(rt.device().enqueue_host(stream, [p, dst] {
      for (std::size_t i = 0; i < p.size(); ++i) {
        if (p[i] != nullptr) dst[i] = *p[i];
      }
    }));
  } else {
#ifdef STRATA_HAS_CUDA
    const cudaError_t err = adam_read_floats_cuda(p, dst, static_cast<cudaStream_t>(stream));
    STRATA_RETURN_IF_ERROR(alloc::cuda_status(err, "Adam: reading the step's scalars"));
#else
    return absl::UnavailableError("Adam on a CUDA device needs strata built with CUDA");
#endif
  }
  STRATA_RETURN_IF_ERROR(rt.device().stream_synchronize(stream));
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (p[i] != nullptr) out[i] = dst[i];
  }
  return out;
}

absl::StatusOr<Adam::StepOutcome> Adam::finish_step(const float* grad_scale,
                                                    const float* found_inf) {
  if (!overlap_open_) {
    STRATA_RETURN_IF_ERROR(step(grad_scale, found_inf));
    return StepOutcome::kSequential;
  }
  rt::Runtime& rt = runtime_;
  STRATA_RETURN_IF_ERROR(finish_release());
  // Validated and committed by a call that then failed: what is left is finished, not validated
  // again (its undo is gone).
  if (overlap_committed_) return finish_committed(grad_scale, found_inf);
  // One host wait reads what the speculation assumed and what is true (See Note [Overlapped step]
  // in adam.h).
  STRATA_ASSIGN_OR_RETURN(const auto read,
                          read_scalars({speculative_scale_, grad_scale, found_inf}, {1, 1, 0}));
  const auto [assumed, truth, inf] = read;
  // The host steps taken in backward may still run (See Note [Finishing a held step]).
  const bool held =
      std::bit_cast<std::uint32_t>(assumed) == std::bit_cast<std::uint32_t>(truth) && inf == 0.0f;
  if (held) {
    STRATA_RETURN_IF_ERROR(rt.commit_undo());
    overlap_committed_ = true;
    return finish_committed(grad_scale, found_inf);
  }
  absl::Status back = roll_back();
  if (!back.ok()) {
    return absl::Status(back.code(),
                        str_cat("Adam: the step taken during backward must be redone (clipping "
                                "triggered or inf was found) but rolling it back failed; call "
                                "finish_step again: ",
                                back.message()));
  }
  // Rolled back: as if step_layer had never run, and step() takes the step (a failure there
  // leaves it untaken, to be retried with step()).
  STRATA_RETURN_IF_ERROR(run_step(grad_scale, found_inf, /*new_step=*/true));
  STRATA_RETURN_IF_ERROR(end_step(rt::StepKind::kRedone));  // See Note [Per-parameter steps]
  return StepOutcome::kRedone;
}

// Note [Finishing a held step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Once the step held (and its undo is committed), two things are left: the layers backward did not
// step (GPU layers whose states stream after backward, mostly), and the host steps posted in
// backward (See Note [Host steps in backward] in adam_host_speculation.cpp), which may still run:
// a host layer's kernel takes longer than its share of backward. They use different resources
// (the GPU and its link for the first, the host's cores for the second), so finish_committed
// queues the first while the second runs, and then queues each host layer's parameters to the
// GPU as its job ends, in the order they were posted. Waiting for every host step first would
// put the GPU layers' whole step after the host's.
// A host job fails only before its kernel starts (its gradients' copy failed), so it stepped
// nothing: its layer's step counts are given back and, once every job has run (they read the
// pinned scalars a host step writes), it is stepped on the host as step() would, with the true
// scalars; the step is the same step either way (it held). The layers backward left
// are stepped only once (rest_stepped_): a failure after them leaves the step open, and a call
// again goes on from the host steps. The host steps' pinned scalars are shared with step()'s own
// host steps, so where a host layer is left for after backward (no room for its undo), every host
// job has run before those layers step.
absl::StatusOr<Adam::StepOutcome> Adam::finish_committed(const float* grad_scale,
                                                         const float* found_inf) {
  // Layers backward could not step are stepped now, as step() would. A failure part way says
  // which parameters it stepped and asks for a checkpoint, as step()'s does (See Note [A failed
  // step] in adam.cpp): the step stays open, and a call again would step those again.
  absl::Status rest;
  if (!rest_stepped_) {
    const bool host_left = std::any_of(host_layers_.begin(), host_layers_.end(), [&](int l) {
      return by_layer_.count(l) != 0 &&
             std::find(overlapped_.begin(), overlapped_.end(), l) == overlapped_.end();
    });
    if (host_left) host_speculation_.wait_for_host_steps();
    rest = run_step(grad_scale, found_inf, /*new_step=*/false);
    if (!rest.ok() && !stepped_every_layer_) {
      return absl::Status(rest.code(), str_cat("Adam: finish_step: the layers stepped during "
                                               "backward stand; stepping the others failed: ",
                                               rest.message()));
    }
    // Every layer left is stepped (only the policy's end of step may have failed: the next hook
    // finishes it).
    rest_stepped_ = true;
  }
  // The host-stepped layers' parameters go to the GPU as their steps end; a failure leaves the
  // step open, to be finished by calling again.
  STRATA_RETURN_IF_ERROR(return_speculated_parameters(grad_scale, found_inf));
  // The step is taken, and closed.
  close_committed();
  const absl::Status ended =
      end_step(backward_share_ < 1.0 ? rt::StepKind::kPartlyInBackward : rt::StepKind::kInBackward);
  STRATA_RETURN_IF_ERROR(rest);
  STRATA_RETURN_IF_ERROR(ended);
  return StepOutcome::kSpeculation;
}

void Adam::close_committed() {
  overlap_open_ = false;
  overlap_committed_ = false;
  rest_stepped_ = false;
}

absl::Status Adam::drop_committed_step() {
  if (!overlap_committed_) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(finish_release());
  // Parameters queued back to the GPU before the failure land before whatever restores them.
  STRATA_RETURN_IF_ERROR(sync_host_streams());
  forget_committed_step();
  return absl::OkStatus();
}

void Adam::forget_committed_step() {
  if (!overlap_committed_) return;
  // What finish_step did not finish is the checkpoint's to say now: the host layers' parameters
  // stay where they are (the model's own state dict restores them), the layers left are not
  // stepped.
  host_speculation_.forget();
  close_committed();
  overlapped_.clear();
  last_step_.clear();
  clear_skipped();
}

absl::Status Adam::roll_back() {
  STRATA_RETURN_IF_ERROR(runtime_.rollback_undo());
  // Then the host steps taken in backward (See Note [Host steps in backward]): once their jobs
  // ran, their states go back by host copies that cannot fail (See Note [Taking back host steps]
  // in host_speculation.cpp). After the runtime's undo, so that a failure there leaves them as
  // they are, and a call again finds the step still to be redone.
  host_speculation_.take_back(
      [this](std::size_t index, const char* undo) { put_back_host_states(index, undo); });
  overlap_open_ = false;
  taken_back_ = true;  // the step's time counts the work taken back (See Note [Measured split])
  overlapped_.clear();
  // The parameters stepped in backward take their step back (See Note [Per-parameter steps]).
  for (rt::TensorHandle p : last_step_) --slots_[slot_of_param_.at(p.id)].steps;
  last_step_.clear();
  return absl::OkStatus();
}

absl::Status Adam::cancel_step() {
  if (!overlap_open_) return absl::OkStatus();
  if (overlap_committed_) {
    // Its undo is gone: what backward stepped stands, and taking the step back would leave those
    // layers stepped with their step counts taken back.
    return absl::FailedPreconditionError(
        "Adam: cancel_step: the step taken during backward was validated and committed, and "
        "finishing it failed; call finish_step again to finish it (or restore a checkpoint)");
  }
  STRATA_RETURN_IF_ERROR(finish_release());
  absl::Status back = roll_back();
  if (!back.ok()) {
    return absl::Status(back.code(), str_cat("Adam: cancel_step: rolling the step taken during "
                                             "backward back failed; call cancel_step again: ",
                                             back.message()));
  }
  return absl::OkStatus();
}

}  // namespace strata::optim
