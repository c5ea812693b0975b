#include "bridge/model_hooks.h"

#include <algorithm>

#include "base/strings.h"
#include "bridge/status.h"
#include "c10/core/impl/VirtualGuardImpl.h"

namespace strata::bridge {

// Note [Zeroing streamed gradients]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Backward accumulates into the bound gradients, so they must be zero before a layer's backward
// starts. Zeroing them after the step would write them where they rest, which for streamed
// gradients is pinned host memory, through unified addressing, at the link's speed and on the
// compute stream. Instead each layer's gradients are zeroed just before its backward:
// the policy has brought them to the GPU for it by then (held from forward for the last layer, or
// fetched at the next layer's after_backward).

// Note [The step stream]
// ~~~~~~~~~~~~~~~~~~~~~~
// An optimizer stepping each layer in backward (set_after_layer) waits on the GPU for the link to
// bring the layer's states. Queued on the stream backward computes on, that wait holds up every
// later layer's backward, so the link's time is added to backward's instead of hidden under it.
// FSDP2 is worse: its hooks run on the reduce-scatter stream, which the next units' compute waits
// for. So, with kOwnStream, the function runs on a stream of its own: it waits for the work queued
// so far on the compute stream and on torch's current stream (the layer's gradients are final
// there), and the runtime computes on it for the call, so the copies it starts (states in,
// write-backs out, undo copies) are fenced behind the step, not behind backward. What backward
// needs next stays on the compute stream: the runtime's own after_backward runs there before, and
// its holds make backward's kernels wait for their layers. finish_backward joins the two streams
// before anything reads what the step wrote.

ModelHooks::ModelHooks(rt::Runtime& runtime, bool zero_before_backward)
    : runtime_(runtime), zero_before_backward_(zero_before_backward) {}

void ModelHooks::set_layer_gradients(std::vector<std::vector<at::Tensor>> grads) {
  if (in_step_) {
    check(absl::FailedPreconditionError("ModelHooks: layers cannot change during a step"));
  }
  grads_ = std::move(grads);
}

void ModelHooks::set_layer_parameters(std::vector<std::vector<at::Tensor>> params,
                                      const TorchBinding& binding) {
  if (in_step_) {
    check(absl::FailedPreconditionError("ModelHooks: layers cannot change during a step"));
  }
  params_ = std::move(params);
  binding_ = &binding;
}

void ModelHooks::begin_step(MicroBatch micro_batch) {
  check(runtime_.begin_step());
  in_step_ = true;
  micro_batch_ = micro_batch;
  forwarded_.clear();
  backward_done_.assign(grads_.size(), false);
  backward_begun_.assign(grads_.size(), false);
  // A later micro-batch adds to the gradients: as if zeroed already.
  zeroed_.assign(grads_.size(), !micro_batch.first);
  stats_.reset();
}

void ModelHooks::before_forward(int layer) {
  if (!in_step_) begin_step();
  check(runtime_.before_forward(layer));
  if (binding_ != nullptr && layer >= 0 && layer < static_cast<int>(params_.size())) {
    for (const at::Tensor& p : params_[static_cast<std::size_t>(layer)]) {
      binding_->check_accessible(p);
    }
  }
  if (std::find(forwarded_.begin(), forwarded_.end(), layer) == forwarded_.end()) {
    forwarded_.push_back(layer);
  }
}

// Once per layer per step: a second zeroing would erase a backward already under way.
void ModelHooks::zero(int layer) {
  if (layer < 0 || layer >= num_layers() || zeroed_[static_cast<std::size_t>(layer)]) return;
  zeroed_[static_cast<std::size_t>(layer)] = true;
  for (at::Tensor& g : grads_[static_cast<std::size_t>(layer)]) g.zero_();
}

void ModelHooks::begin_backward() {
  if (zero_before_backward_ && !forwarded_.empty()) zero(forwarded_.back());
}

void ModelHooks::check_backward_hook(const char* hook, int layer) const {
  if (!in_step_) {
    check(absl::FailedPreconditionError(
        str_cat("ModelHooks: ", hook, "(", layer,
                ") outside a step: a backward whose forward ran before the last step ended")));
  }
  if (layer < 0 || layer >= num_layers()) {
    check(absl::InvalidArgumentError(
        str_cat("ModelHooks: layer ", layer, " is not one of the ", num_layers(), " layers")));
  }
}

void ModelHooks::before_backward(int layer) {
  check_backward_hook("before_backward", layer);
  const auto l = static_cast<std::size_t>(layer);
  // After its after_backward (a module run twice in one forward) the layer is gone home already.
  if (backward_done_[l] || backward_begun_[l]) return;
  check(runtime_.before_backward(layer));
  backward_begun_[l] = true;
  if (zero_before_backward_) zero(layer);
}

void ModelHooks::after_backward(int layer) {
  check_backward_hook("after_backward", layer);
  if (backward_done_[static_cast<std::size_t>(layer)]) {
    check(absl::FailedPreconditionError(
        str_cat("ModelHooks: after_backward(", layer, ") twice in one step")));
  }
  backward_done_[static_cast<std::size_t>(layer)] = true;
  if (micro_batch_.last) stats_.add_layer(layer, grads_[static_cast<std::size_t>(layer)]);
  check(runtime_.after_backward(layer));
  if (after_layer_ && micro_batch_.last) run_after_layer(layer);
  if (zero_before_backward_) {
    // Without before_backward, the layer forwarded before this one is the next to run backward.
    const auto it = std::find(forwarded_.begin(), forwarded_.end(), layer);
    if (it != forwarded_.begin() && it != forwarded_.end() &&
        !backward_begun_[static_cast<std::size_t>(*(it - 1))]) {
      zero(*(it - 1));
    }
  }
}

void ModelHooks::set_after_layer(std::function<void(int)> fn, AfterLayerStream where) {
  join_after_layer_stream();
  after_layer_ = std::move(fn);
  after_layer_stream_ = where;
}

namespace {

// Torch's current stream on its current CUDA device (the bridge includes no CUDA header).
c10::Stream torch_current_stream() {
  const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return impl.getStream(impl.getDevice());
}

// `waiter` waits on the GPU for the work queued on `on` so far.
void wait_for(rt::Device& device, rt::StreamHandle waiter, rt::StreamHandle on) {
  if (waiter == on) return;
  absl::StatusOr<rt::EventHandle> ev = device.record(on);
  check(ev.status());
  const absl::Status s = device.stream_wait(waiter, *ev);
  device.release(*ev);
  check(s);
}

}  // namespace

void ModelHooks::run_after_layer(int layer) {
  if (after_layer_stream_ != AfterLayerStream::kOwnStream || runtime_.device().is_simulated()) {
    after_layer_(layer);
    return;
  }
  const c10::Stream torch_stream = torch_current_stream();
  if (!step_stream_) {
    const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    step_stream_ = impl.getStreamFromGlobalPool(torch_stream.device());
  }
  const auto step = static_cast<rt::StreamHandle>(step_stream_->native_handle());
  const rt::StreamHandle compute = runtime_.compute_stream();
  wait_for(runtime_.device(), step, compute);
  wait_for(runtime_.device(), step, static_cast<rt::StreamHandle>(torch_stream.native_handle()));
  step_stream_used_ = true;
  const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  impl.exchangeStream(*step_stream_);
  runtime_.set_compute_stream(step);
  auto restore = [&] {
    runtime_.set_compute_stream(compute);
    impl.exchangeStream(torch_stream);
  };
  try {
    after_layer_(layer);
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

void ModelHooks::join_after_layer_stream() {
  if (!step_stream_used_) return;
  step_stream_used_ = false;
  const auto step = static_cast<rt::StreamHandle>(step_stream_->native_handle());
  wait_for(runtime_.device(), runtime_.compute_stream(), step);
  wait_for(runtime_.device(), static_cast<rt::StreamHandle>(torch_current_stream().native_handle()),
           step);
}

void ModelHooks::finish_backward() {
  if (!in_step_) begin_step();
  if (forwarded_.empty()) {
    for (int l = 0; l < num_layers(); ++l) before_forward(l);
  }
  for (auto it = forwarded_.rbegin(); it != forwarded_.rend(); ++it) {
    if (!backward_done_[static_cast<std::size_t>(*it)]) after_backward(*it);
  }
  join_after_layer_stream();
}

void ModelHooks::end_step() {
  check(runtime_.end_step());
  in_step_ = false;
}

}  // namespace strata::bridge
