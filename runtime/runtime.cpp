// runtime/runtime.cpp: the Runtime facade: creation (device, allocator, the runtime's own pools,
// streams, policy), teardown, statistics and accessors. The rooms it ties together are listed in
// runtime_impl.h.
#include "runtime/runtime.h"

#include <cstdio>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "runtime/runtime_impl.h"

namespace strata::rt {

using internal::Entry;

absl::Status Runtime::Impl::release_scratch() {
  STRATA_RETURN_IF_ERROR(staging.release());
  STRATA_RETURN_IF_ERROR(engine.release_bounce());
  engine.drain_timing(/*wait=*/true);
  return absl::OkStatus();
}

// Note [Teardown after a failed wait]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// When the device cannot say that its work is done (a wait fails: a sticky error, a device that
// stopped), a copy may still write memory the runtime holds. That memory then goes back to its pool
// behind every stream the runtime used, so the pool keeps it until an event on each completes; a
// pool that cannot wait for those keeps its segments from the upstream for good (and says so)
// rather than give back memory a copy may still write.
Runtime::Impl::~Impl() {
  bool device_ok = true;
  {
    std::lock_guard<std::mutex> lock(mu);
    absl::Status waited = engine.wait_all();
    if (!waited.ok()) {
      device_ok = false;
      std::fprintf(stderr, "strata: runtime shutdown: %s\n", std::string(waited.message()).c_str());
    }
    // An undo still kept (a step taken in backward never validated: its take-back failed, or the
    // runtime goes mid-step) has nothing left to protect. It is freed as a commit frees it, behind
    // the streams that may still use it, while they exist and before the entries' blocks and the
    // pools go; after a failed wait the pools keep such blocks from reuse.
    undo.commit();
    const std::initializer_list<StreamHandle> every_stream = {engine.h2d(), engine.d2h(),
                                                              engine.compute()};
    for (const auto& e : registry.entries()) {
      if (device_ok && !engine.wait_ready_on_host(*e).ok()) device_ok = false;
      for (const Entry::Ready& r : e->ready) engine.device().release(r.event);
      e->ready.clear();
      if (e->in_flight) {
        engine.device().release(e->arrival);
        if (e->dst.slot < 0 && e->dst.ptr != nullptr && e->bytes > 0) {
          engine.free_after(e->dst.tier, e->dst.ptr, every_stream);
        }
        std::erase(engine.in_flight(), e.get());
        e->in_flight = false;
      }
      if (e->bytes == 0) continue;
      for (const internal::Location& loc : {e->loc, e->rest}) {
        if (loc.ptr == nullptr || loc.slot >= 0) continue;
        if (device_ok) {
          engine.free_location(*e, loc);
        } else {
          engine.free_after(loc.tier, loc.ptr, every_stream);
        }
      }
    }
    if (device_ok) {
      if (absl::Status s = release_scratch(); !s.ok()) {
        device_ok = false;
        std::fprintf(stderr, "strata: runtime shutdown: %s\n", std::string(s.message()).c_str());
      }
    }
    if (!device_ok) {
      staging.abandon();
      engine.abandon();
    }
  }
  engine.destroy_streams(device_ok);
  policy.reset();
}

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Runtime::~Runtime() = default;

absl::StatusOr<std::unique_ptr<Runtime>> Runtime::create(RuntimeOptions options,
                                                         const PolicyRegistry& policies) {
  const PolicyChoice choice = choose_policy_name(options.policy, options.policy_source);
  absl::StatusOr<std::unique_ptr<ResidencyPolicy>> policy =
      policies.create(choice.name, options.policy_config);
  if (!policy.ok()) {
    return absl::Status(policy.status().code(), str_cat(policy.status().message(),
                                                        " (policy chosen by ", choice.source, ")"));
  }
  std::shared_ptr<Device> device;
  if (options.device_override != nullptr) {
    device = std::move(options.device_override);
  } else {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> made,
                            make_device(options.device, options.cuda_device));
    device = std::move(made);
  }
  alloc::AllocatorOptions& a = options.allocator;
  a.device =
      device->is_simulated() ? alloc::DeviceBackend::kSimulated : alloc::DeviceBackend::kCuda;
  if (!device->is_simulated()) a.cuda_device = device->cuda_device();
  a.stream_ops = device;
  std::unique_ptr<alloc::Upstream> staging_upstream;
  std::unique_ptr<alloc::Upstream> bounce_upstream;
  if (device->is_simulated()) {
    staging_upstream = alloc::make_simulated_device_upstream(a.simulated_device);
    bounce_upstream = alloc::make_simulated_pinned_upstream();
  } else {
    STRATA_ASSIGN_OR_RETURN(staging_upstream,
                            alloc::make_cuda_device_upstream(a.cuda_device, a.device_method));
    STRATA_ASSIGN_OR_RETURN(bounce_upstream,
                            alloc::make_pinned_host_upstream(a.pinned_method, a.cuda_device));
  }
  if (options.wrap_internal_upstream) {
    staging_upstream = options.wrap_internal_upstream(std::move(staging_upstream));
    bounce_upstream = options.wrap_internal_upstream(std::move(bounce_upstream));
  }
  const bool tracking = a.track_allocations;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<alloc::TieredAllocator> allocator,
                          alloc::TieredAllocator::create(std::move(a)));
  // The staging pool holds one allocation, the ring, kept apart from the main pool so streaming
  // never fragments it; it draws on the GPU tier's budget, so the two together never pass it.
  auto staging_pool = std::make_unique<alloc::BlockPool>(
      alloc::PoolConfig{.tier = Tier::kGpu,
                        .track_allocations = tracking,
                        .shared_budget = allocator->budget(Tier::kGpu)},
      std::move(staging_upstream), device);
  auto bounce_pool = std::make_unique<alloc::BlockPool>(
      alloc::PoolConfig{Tier::kPinnedHost, alloc::kNoBudget, tracking}, std::move(bounce_upstream),
      device);
  auto impl = std::make_unique<Impl>(device, std::move(allocator), std::move(staging_pool),
                                     std::move(bounce_pool));
  impl->choice = choice;
  impl->policy = std::move(*policy);
  impl->undo_on_gpu = impl->policy->config().undo_on_gpu;
  STRATA_RETURN_IF_ERROR(impl->engine.create_streams());
  return std::unique_ptr<Runtime>(new Runtime(std::move(impl)));
}

int Runtime::add_on_moved(std::function<void(TensorHandle, Tier, void*)> fn) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const int id = impl_->next_callback++;
  impl_->engine.on_moved()[id] = std::move(fn);
  return id;
}

void Runtime::remove_on_moved(int id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->engine.on_moved().erase(id);
}

int Runtime::add_before_optimizer_step(std::function<absl::Status()> fn) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const int id = impl_->next_callback++;
  impl_->before_optimizer_step[id] = std::move(fn);
  return id;
}

void Runtime::remove_before_optimizer_step(int id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->before_optimizer_step.erase(id);
}

void Runtime::set_compute_stream(StreamHandle stream) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->engine.set_compute(stream);  // nullptr is the legacy default stream, not "unset"
}

std::vector<std::pair<std::string_view, StatValue>> named_stats(const RuntimeStats& s) {
  return {{"migrated_bytes_h2d", s.migrated_bytes_h2d},
          {"migrated_bytes_d2h", s.migrated_bytes_d2h},
          {"migrated_bytes_h2h", s.migrated_bytes_h2h},
          {"num_migrations", s.num_migrations},
          {"failed_migrations", s.failed_migrations},
          {"h2d_busy_ms", s.h2d_busy_ms},
          {"d2h_busy_ms", s.d2h_busy_ms},
          {"timed_bytes_h2d", s.timed_bytes_h2d},
          {"timed_bytes_d2h", s.timed_bytes_d2h},
          {"h2d_gbps", s.h2d_gbps()},
          {"d2h_gbps", s.d2h_gbps()},
          {"prefetch_hits", s.prefetch_hits},
          {"prefetch_waits", s.prefetch_waits},
          {"prefetch_stall_ms", s.prefetch_stall_ns / 1e6},
          {"host_syncs", s.host_syncs},
          {"staging_bytes", s.staging_bytes},
          {"staged_peak_bytes", s.staged_peak_bytes},
          {"gpu_reserved_bytes", s.gpu_reserved_bytes},
          {"gpu_reserved_peak_bytes", s.gpu_reserved_peak_bytes},
          {"gpu_upstream_alloc_ms", s.gpu_upstream_alloc_ns / 1e6},
          {"gpu_upstream_free_ms", s.gpu_upstream_free_ns / 1e6},
          {"undo_bytes", s.undo_bytes},
          {"undo_peak_bytes", s.undo_peak_bytes},
          {"undo_copied_bytes", s.undo_copied_bytes}};
}

RuntimeStats Runtime::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  RuntimeStats s = impl_->engine.stats();
  s.host_syncs = impl_->engine.device().host_syncs();
  const alloc::Budget& gpu = *impl_->allocator->budget(Tier::kGpu);
  s.gpu_reserved_bytes = static_cast<std::int64_t>(gpu.reserved());
  s.gpu_reserved_peak_bytes = static_cast<std::int64_t>(gpu.peak());
  for (const alloc::TierStats& t :
       {impl_->allocator->stats(Tier::kGpu), impl_->staging.pool().stats()}) {
    s.gpu_upstream_alloc_ns += t.upstream_alloc_ns;
    s.gpu_upstream_free_ns += t.upstream_free_ns;
  }
  return s;
}

std::size_t Runtime::Impl::gpu_budget_locked() const {
  return allocator->budget(Tier::kGpu)->limit();
}

std::size_t Runtime::gpu_budget() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->gpu_budget_locked();
}

absl::Status Runtime::set_gpu_budget(std::size_t budget) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  if (im.step.in_step || im.step.in_optimizer_step || im.step.offloaded) {
    return absl::FailedPreconditionError(
        "set_gpu_budget: a step is under way or the tensors are offloaded; call it between "
        "steps");
  }
  STRATA_RETURN_IF_ERROR(im.undo.check_empty("set_gpu_budget"));
  alloc::Budget& gpu = *im.allocator->budget(Tier::kGpu);
  if (budget == 0 || (budget != alloc::kNoBudget && budget < gpu.reserved())) {
    return absl::InvalidArgumentError(str_cat("set_gpu_budget: ", format_bytes(budget),
                                              " is below the ", format_bytes(gpu.reserved()),
                                              " strata holds on the GPU now"));
  }
  // What the last step left moving (write-backs of staged layers) lands first: a tensor still on
  // its way home cannot move again. One host wait, between steps.
  STRATA_RETURN_IF_ERROR(im.engine.fence_compute());
  PolicyContext ctx(*this);
  STRATA_RETURN_IF_ERROR(im.finish_optimizer_step(ctx));
  STRATA_RETURN_IF_ERROR(im.engine.wait_all());
  const std::size_t before = gpu.limit();
  gpu.set_limit(budget);
  absl::Status s = im.policy->on_budget_changed(ctx);
  if (!s.ok()) {
    gpu.set_limit(before);
    (void)im.policy->on_budget_changed(ctx);
  }
  return s;
}

alloc::TieredAllocator& Runtime::allocator() { return *impl_->allocator; }
Device& Runtime::device() { return impl_->engine.device(); }
int Runtime::cuda_device() const { return impl_->engine.device().cuda_device(); }
const ResidencyPolicy& Runtime::policy() const { return *impl_->policy; }
const PolicyChoice& Runtime::policy_choice() const { return impl_->choice; }
StreamHandle Runtime::h2d_stream() const { return impl_->engine.h2d(); }
StreamHandle Runtime::d2h_stream() const { return impl_->engine.d2h(); }

StreamHandle Runtime::compute_stream() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->engine.compute();
}

}  // namespace strata::rt
