// runtime/hooks.cpp: the hooks a training loop calls around forward, backward and the optimizer
// step, and the phase switches; the state of the step they move through; and the PolicyContext
// through which the policy acts from inside them.
//
// Note [Hooks hold the runtime's mutex]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A hook takes the runtime's mutex and holds it while the policy runs, and the policy acts only
// through the PolicyContext, whose calls assume the mutex is held. So every public call of the
// runtime, hooks included, is one critical section: two threads calling hooks (or a hook and any
// other call) never interleave inside the policy or the runtime. The on_moved callbacks run under
// the same mutex and must not call the runtime.
//
// Note [Step states]
// ~~~~~~~~~~~~~~~~~~
// begin_step opens a step and end_step closes it; before_forward, before_backward and
// after_backward belong inside one; an optimizer step (begin_optimizer_step .. end_optimizer_step)
// may run inside a step or on its own (Adam::step makes both calls), but not inside another. A hook
// called out of that order is kFailedPrecondition saying what was expected, and changes nothing. A
// hook that fails leaves the state as it was, so it can be called again: a failed begin_* has not
// begun (the policy's work so far is put back), a failed end_step has not ended. end_step also
// fails, naming them, while tensors are still held once the policy's end of step is done: an
// acquire with no release would otherwise surface only later, as a tensor that cannot move. One
// exception keeps a failed optimizer step from blocking every later hook: end_optimizer_step ends
// the optimizer step even when the policy cannot finish its end of it (writing staged states home,
// under a device error); that work is then finished first by the next hook, or by calling
// end_optimizer_step again, and that hook fails while it cannot be.
#include <algorithm>

#include "base/status.h"
#include "base/strings.h"
#include "runtime/runtime_impl.h"

namespace strata::rt {
namespace {

absl::Status misuse(std::string_view hook, std::string_view what) {
  return absl::FailedPreconditionError(str_cat(hook, ": ", what));
}

constexpr std::string_view kOffloaded =
    "tensors are offloaded (offload_all); call reload_all first";

}  // namespace

// Layers 0 up to the highest registered one exist (a layer with nothing registered is an empty
// layer, e.g. an activation between two linear layers); others are a mistake.
absl::Status Runtime::Impl::check_layer(const char* hook, int layer) const {
  const std::vector<int> all = registry.layers();
  if (layer >= 0 && !all.empty() && layer <= all.back()) return absl::OkStatus();
  return absl::InvalidArgumentError(str_cat(hook, "(", layer,
                                            "): no such layer; the registered layers are ",
                                            registry.describe_layers()));
}

std::string Runtime::Impl::outstanding_holds() const {
  std::string out;
  int count = 0;
  for (const auto& e : registry.entries()) {
    if (e->holds == 0) continue;
    if (++count <= 8)
      str_append(&out, out.empty() ? "" : ", ", "'", e->spec.name, "' (", e->holds, ")");
  }
  if (count > 8) str_append(&out, ", ... (", count, " tensors in all)");
  return out;
}

absl::Status Runtime::Impl::finish_optimizer_step(PolicyContext& ctx) {
  if (!step.optimizer_unfinished) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(policy->on_end_optimizer_step(ctx));
  step.optimizer_unfinished = false;
  return absl::OkStatus();
}

absl::Status Runtime::prepare() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  if (im.step.in_step || im.step.in_optimizer_step) {
    return misuse("prepare", "a step is under way; call it between steps");
  }
  STRATA_RETURN_IF_ERROR(im.engine.fence_compute());
  STRATA_RETURN_IF_ERROR(im.engine.poll());
  PolicyContext ctx(*this);
  STRATA_RETURN_IF_ERROR(im.finish_optimizer_step(ctx));
  return im.policy->on_prepare(ctx);
}

absl::Status Runtime::begin_step() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  if (im.step.in_step)
    return misuse("begin_step", "the step begun last has not ended; call end_step first");
  if (im.step.in_optimizer_step) {
    return misuse("begin_step", "an optimizer step is under way; call end_optimizer_step first");
  }
  if (im.step.offloaded) return misuse("begin_step", kOffloaded);
  STRATA_RETURN_IF_ERROR(im.undo.check_empty("begin_step"));
  STRATA_RETURN_IF_ERROR(im.engine.fence_compute());
  STRATA_RETURN_IF_ERROR(im.engine.poll());
  PolicyContext ctx(*this);
  STRATA_RETURN_IF_ERROR(im.finish_optimizer_step(ctx));
  STRATA_RETURN_IF_ERROR(im.policy->on_begin_step(ctx));
  im.step.in_step = true;
  return absl::OkStatus();
}

absl::Status Runtime::end_step() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  if (!im.step.in_step) return misuse("end_step", "no step has begun; call begin_step first");
  if (im.step.in_optimizer_step) {
    return misuse("end_step", "the optimizer step has not ended; call end_optimizer_step first");
  }
  STRATA_RETURN_IF_ERROR(im.engine.fence_compute());
  STRATA_RETURN_IF_ERROR(im.engine.poll());
  PolicyContext ctx(*this);
  STRATA_RETURN_IF_ERROR(im.finish_optimizer_step(ctx));
  STRATA_RETURN_IF_ERROR(im.policy->on_end_step(ctx));
  if (std::string held = im.outstanding_holds(); !held.empty()) {
    return misuse("end_step", str_cat("tensors are still held (acquire without release): ", held,
                                      "; release them, then call end_step again"));
  }
  im.step.in_step = false;
  return absl::OkStatus();
}

absl::Status Runtime::layer_hook(LayerHook which, int layer) {
  const char* hook = which == LayerHook::kBeforeForward    ? "before_forward"
                     : which == LayerHook::kBeforeBackward ? "before_backward"
                                                           : "after_backward";
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  if (!im.step.in_step) return misuse(hook, "no step has begun; call begin_step first");
  if (im.step.in_optimizer_step) {
    return misuse(hook, "the optimizer step has not ended; call end_optimizer_step first");
  }
  STRATA_RETURN_IF_ERROR(im.check_layer(hook, layer));
  STRATA_RETURN_IF_ERROR(im.engine.fence_compute());
  STRATA_RETURN_IF_ERROR(im.engine.poll());
  PolicyContext ctx(*this);
  STRATA_RETURN_IF_ERROR(im.finish_optimizer_step(ctx));
  switch (which) {
    case LayerHook::kBeforeForward:
      return im.policy->on_before_forward(ctx, layer);
    case LayerHook::kBeforeBackward:
      return im.policy->on_before_backward(ctx, layer);
    case LayerHook::kAfterBackward:
      return im.policy->on_after_backward(ctx, layer);
  }
  return absl::InternalError("layer_hook: unknown hook");
}

absl::Status Runtime::before_forward(int layer) {
  return layer_hook(LayerHook::kBeforeForward, layer);
}

absl::Status Runtime::before_backward(int layer) {
  return layer_hook(LayerHook::kBeforeBackward, layer);
}

absl::Status Runtime::after_backward(int layer) {
  return layer_hook(LayerHook::kAfterBackward, layer);
}

absl::Status Runtime::begin_optimizer_step() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  if (im.step.in_optimizer_step) {
    return misuse("begin_optimizer_step",
                  "the optimizer step begun last has not ended; call end_optimizer_step first");
  }
  if (im.step.offloaded) return misuse("begin_optimizer_step", kOffloaded);
  for (const auto& [id, fn] : im.before_optimizer_step) STRATA_RETURN_IF_ERROR(fn());
  STRATA_RETURN_IF_ERROR(im.engine.fence_compute());
  PolicyContext ctx(*this);
  STRATA_RETURN_IF_ERROR(im.finish_optimizer_step(ctx));
  // The policy's first fetches go out before the host collects what finished since the last hook:
  // after a step with no hook in between, that is every copy of it (milliseconds of bookkeeping
  // for hundreds of copies), and the link would idle meanwhile.
  absl::Status s = im.policy->on_begin_optimizer_step(ctx);
  if (s.ok()) s = im.engine.poll();
  if (!s.ok()) {
    // Not begun: what the policy staged goes home (its end of step is resumable), now or, if that
    // fails too, first thing at the next hook.
    im.step.optimizer_unfinished = true;
    (void)im.finish_optimizer_step(ctx);
    return s;
  }
  im.step.in_optimizer_step = true;
  return absl::OkStatus();
}

absl::Status Runtime::end_optimizer_step() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  if (!im.step.in_optimizer_step && !im.step.optimizer_unfinished) {
    return misuse("end_optimizer_step",
                  "no optimizer step has begun; call begin_optimizer_step first");
  }
  im.step.in_optimizer_step = false;
  im.step.optimizer_unfinished = true;
  PolicyContext ctx(*this);
  STRATA_RETURN_IF_ERROR(im.finish_optimizer_step(ctx));
  // Ended: a copy whose completion cannot be read now is collected by the next call that polls.
  (void)im.engine.poll();
  return absl::OkStatus();
}

std::vector<int> Runtime::optimizer_layer_order() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const PolicyContext ctx(const_cast<Runtime&>(*this));
  return impl_->policy->optimizer_layer_order(ctx);
}

bool Runtime::places_steps() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->policy->places_steps();
}

absl::StatusOr<std::string> Runtime::place_steps(const StepCosts& costs) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (int layer : impl_->registry.layers()) {
    if (!impl_->layer_tensors_locked(layer, RoleSet::optimizer_states()).empty()) {
      return absl::FailedPreconditionError(
          str_cat("place_steps: layer ", layer,
                  " already has optimizer states; steps are placed before any is registered"));
    }
  }
  PolicyContext ctx(*this);
  return impl_->policy->on_place_steps(ctx, costs);
}

StepPlace Runtime::step_place(int layer) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->policy->step_place(layer);
}

bool Runtime::wants_step_times() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->policy->wants_step_times();
}

absl::StatusOr<std::string> Runtime::step_measured(const StepTimes& times) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Impl::StepState& step = impl_->step;
  if (impl_->undo.size() != 0 || step.in_optimizer_step || step.optimizer_unfinished ||
      step.offloaded) {
    return absl::FailedPreconditionError(
        "step_measured: an optimizer step is under way, its undo kept, or the tensors offloaded; "
        "hand step times in between steps");
  }
  PolicyContext ctx(*this);
  return impl_->policy->on_step_measured(ctx, times);
}

absl::Status Runtime::refuse_step_move() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  PolicyContext ctx(*this);
  return impl_->policy->on_move_refused(ctx);
}

// --- PolicyContext: the runtime's calls with its mutex already held -------------------------

std::vector<TensorHandle> PolicyContext::tensors() const {
  return runtime_.impl_->tensors_locked();
}

absl::StatusOr<TensorInfo> PolicyContext::info(TensorHandle tensor) const {
  return runtime_.impl_->info_locked(tensor);
}

std::vector<TensorHandle> PolicyContext::layer_tensors(int layer, RoleSet roles) const {
  return runtime_.impl_->layer_tensors_locked(layer, roles);
}

std::vector<int> PolicyContext::layers() const { return runtime_.impl_->registry.layers(); }

std::size_t PolicyContext::layer_bytes(int layer, RoleSet roles) const {
  return runtime_.impl_->layer_bytes_locked(layer, roles);
}

std::uint64_t PolicyContext::unregistrations() const {
  return runtime_.impl_->registry.unregistrations();
}

std::vector<int> PolicyContext::optimizer_layer_order() const {
  return runtime_.impl_->policy->optimizer_layer_order(*this);
}

absl::Status PolicyContext::migrate(TensorHandle tensor, Tier dst) {
  return runtime_.impl_->migrate_locked(tensor, dst);
}

absl::Status PolicyContext::wait_all() { return runtime_.impl_->engine.wait_all(); }

absl::Status PolicyContext::configure_staging(int slots, RoleSet roles) {
  return runtime_.impl_->staging.configure(slots, roles);
}

absl::Status PolicyContext::release_staging() { return runtime_.impl_->staging.release(); }

absl::Status PolicyContext::stage_layer(int layer, std::optional<RoleSet> roles, StageOrder order) {
  return runtime_.impl_->staging.stage(layer, roles, order);
}

absl::Status PolicyContext::unstage_layer(int layer, std::optional<RoleSet> write_back) {
  return runtime_.impl_->staging.unstage(layer, write_back);
}

bool PolicyContext::is_staged(int layer) const { return runtime_.impl_->staging.is_staged(layer); }

absl::Status PolicyContext::hold_layer(int layer, RoleSet roles, Tier tier, StreamHandle stream) {
  return runtime_.impl_->acquire_layer_locked(layer, roles, tier, stream).status();
}

absl::Status PolicyContext::hold_layer_in_place(int layer, RoleSet roles, StreamHandle stream) {
  return runtime_.impl_->acquire_layer_locked(layer, roles, std::nullopt, stream).status();
}

absl::Status PolicyContext::release(const std::vector<TensorHandle>& tensors, StreamHandle stream) {
  Runtime::Impl& im = *runtime_.impl_;
  std::vector<internal::Entry*> members;
  members.reserve(tensors.size());
  for (TensorHandle h : tensors) {
    STRATA_ASSIGN_OR_RETURN(internal::Entry * e, im.registry.get(h));
    members.push_back(e);
  }
  return im.release_locked(members, stream);
}

StreamHandle PolicyContext::compute_stream() const { return runtime_.impl_->engine.compute(); }

std::size_t PolicyContext::gpu_budget() const { return runtime_.impl_->gpu_budget_locked(); }

std::size_t PolicyContext::gpu_pool_budget() const {
  return runtime_.impl_->allocator->pool(Tier::kGpu).budget();
}

alloc::TierStats PolicyContext::gpu_pool_stats() const {
  return runtime_.impl_->allocator->stats(Tier::kGpu);
}

}  // namespace strata::rt
