// runtime/phase.cpp: phase switches, Runtime::offload_all and Runtime::reload_all, the same under
// every policy.
//
// Note [Phase switches]
// ~~~~~~~~~~~~~~~~~~~~~
// Between training phases (an RL trainer's rollout) everything training keeps on the GPU goes to
// host memory, and the GPU memory it held goes back to the driver, so that another engine can take
// it; then it all comes back. offload_all:
//   1. lets the policy put home what it staged and release what it holds (on_offload_all);
//   2. waits for copies in flight, then queues a move of every tensor of the roles asked for that
//      is in the GPU tier's pool to pinned memory (pageable where pinned has no room), and marks it
//      offloaded; a tensor that cannot move (held by an acquire) fails the call, and what moved
//      stays moved, marked, for reload_all;
//   3. unless keep_cached, frees the staging ring and gives every segment of the GPU tier back to
//      the driver as soon as it is entirely free, while later copies still stream
//      (See Note [Freeing behind the copies]); then waits for the rest of the copies.
// reload_all takes a GPU block for every tensor marked offloaded, then moves them all back into
// them (See Note [Allocating before the copies]; it may take GPU memory from the driver; it pins no
// host memory, the host blocks go back to their pool), waits, and lets the policy reserve its ring
// again (on_reload_all) and resume where it was. From offload_all until reload_all no step can
// begin, even when nothing was on the GPU to move (a step would take GPU memory for the policy's
// ring); reading tensors (a checkpoint) can. reload_all with nothing offloaded does nothing.
#include <vector>

#include "base/status.h"
#include "base/strings.h"
#include "runtime/runtime_impl.h"

namespace strata::rt {

using internal::Entry;

absl::Status Runtime::offload_all(OffloadOptions options) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  if (im.step.in_optimizer_step) {
    return absl::FailedPreconditionError(
        "offload_all: the optimizer step has not ended; call end_optimizer_step first");
  }
  STRATA_RETURN_IF_ERROR(im.undo.check_empty("offload_all"));
  STRATA_RETURN_IF_ERROR(im.engine.fence_compute());
  STRATA_RETURN_IF_ERROR(im.engine.poll());
  PolicyContext ctx(*this);
  STRATA_RETURN_IF_ERROR(im.finish_optimizer_step(ctx));
  STRATA_RETURN_IF_ERROR(im.policy->on_offload_all(ctx));
  // The policy has let go of its ring: from here on the phase is offloaded, even when nothing of
  // the roles is on the GPU to move, until reload_all.
  im.step.offloaded = true;
  // A tensor still arriving somewhere moves once it has landed.
  STRATA_RETURN_IF_ERROR(im.engine.wait_all());
  std::vector<Entry*> moving;
  for (const auto& e : im.registry.entries()) {
    if (!options.roles.contains(e->spec.role) || e->loc.tier != Tier::kGpu || e->bytes == 0) {
      continue;
    }
    if (e->loc.slot >= 0) {
      return absl::FailedPreconditionError(str_cat("offload_all: tensor '", e->spec.name,
                                                   "' is staged (layer ", e->spec.layer,
                                                   "); unstage_layer first"));
    }
    moving.push_back(e.get());
  }
  for (Entry* e : moving) {
    absl::Status s = im.engine.migrate(*e, Tier::kPinnedHost);
    if (s.code() == absl::StatusCode::kResourceExhausted) {
      s = im.engine.migrate(*e, Tier::kPageableHost);
    }
    if (!s.ok()) {
      return absl::Status(s.code(), str_cat("offload_all: ", s.message(),
                                            " (what moved before it stays offloaded; "
                                            "reload_all brings it back)"));
    }
    e->offloaded = true;
  }
  if (!options.keep_cached) {
    // Note [Freeing behind the copies]
    // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    // The ring holds nothing now and no copy reads it; each segment goes back as soon as the copies
    // out of it have landed, while the later ones still stream. The copies go in registration
    // order, the order in which the tensors' blocks were carved out of the segments, so one
    // segment's tensors mostly leave together (and the tensors registered first are the first to
    // get pinned memory). On virtual memory the frees do not wait for those copies
    // (See Note [Device memory method] in allocator/cuda_device_upstream.cpp), so they hide behind
    // the link; with cudaFree the first free waits for every copy queued, and the rest follow, as
    // if freed at the end. A trim walks every block of the pool, so it runs once per sixteenth of
    // the bytes, not once per tensor (10^4 tensors would make that 10^8 block visits); the frees of
    // the last sixteenth come after the copies.
    std::size_t total = 0;
    for (const Entry* e : moving) total += e->bytes;
    const std::size_t trim_every = total / 16;
    STRATA_RETURN_IF_ERROR(im.staging.release());
    std::size_t landed = 0;
    for (Entry* e : moving) {
      STRATA_RETURN_IF_ERROR(im.engine.wait_entry(*e));
      landed += e->bytes;
      if (landed < trim_every) continue;
      landed = 0;
      STRATA_RETURN_IF_ERROR(im.allocator->trim(Tier::kGpu).status());
    }
  }
  STRATA_RETURN_IF_ERROR(im.engine.wait_all());
  // The blocks the copies read are reusable (kept) or can go back to the driver (trimmed) only
  // once no copy or kernel can still use them.
  STRATA_RETURN_IF_ERROR(im.allocator->pool(Tier::kGpu).synchronize_pending());
  if (options.keep_cached) return absl::OkStatus();
  return im.allocator->trim(Tier::kGpu).status();
}

absl::Status Runtime::reload_all() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  if (im.step.in_optimizer_step) {
    return absl::FailedPreconditionError(
        "reload_all: the optimizer step has not ended; call end_optimizer_step first");
  }
  if (!im.step.offloaded) return absl::OkStatus();  // nothing to bring back
  STRATA_RETURN_IF_ERROR(im.engine.fence_compute());
  STRATA_RETURN_IF_ERROR(im.engine.poll());
  STRATA_RETURN_IF_ERROR(im.engine.wait_all());
  // Note [Allocating before the copies]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // Every block the tensors come back to is taken first, and only then are the copies queued, back
  // to back. Taking GPU memory from the driver while a copy streams is slower than taking it idle
  // (tools/gpu/probes/free_overlap.cu), and while the host allocates the next block the copy queue
  // runs dry; allocating first brought the reload to its link floor plus the allocation time; the
  // rest is the driver's work on memory another engine has just given back
  // (bench/results/2026-11-24-H200-c14555e/h2d_pages.txt). And a reload that does not fit moves
  // nothing.
  std::vector<Entry*> coming;
  for (const auto& e : im.registry.entries()) {
    if (e->offloaded) coming.push_back(e.get());
  }
  std::vector<void*> blocks(coming.size(), nullptr);
  auto free_blocks = [&](std::size_t from) {
    for (std::size_t i = from; i < blocks.size(); ++i) {
      if (blocks[i] != nullptr) (void)im.allocator->deallocate(Tier::kGpu, blocks[i]);
    }
  };
  for (std::size_t i = 0; i < coming.size(); ++i) {
    if (coming[i]->bytes == 0) continue;
    absl::StatusOr<void*> block = im.allocator->allocate(
        Tier::kGpu, coming[i]->bytes, {.stream = nullptr, .owner = coming[i]->spec.name});
    if (!block.ok()) {
      free_blocks(0);
      // The segments taken for them go back too: the memory is another engine's until it fits.
      (void)im.allocator->trim(Tier::kGpu);
      return absl::Status(block.status().code(),
                          str_cat("reload_all: moving '", coming[i]->spec.name, "' to ",
                                  tier_name(Tier::kGpu), ": ", block.status().message(),
                                  " (nothing came back; call reload_all again once there is "
                                  "room)"));
    }
    blocks[i] = *block;
  }
  for (std::size_t i = 0; i < coming.size(); ++i) {
    Entry& e = *coming[i];
    if (absl::Status s = im.engine.migrate(e, Tier::kGpu, blocks[i]); !s.ok()) {
      // A copy into the block may have been queued: it goes back behind the copy stream.
      if (blocks[i] != nullptr) im.engine.free_after(Tier::kGpu, blocks[i], {im.engine.h2d()});
      free_blocks(i + 1);
      (void)im.allocator->trim(Tier::kGpu);
      return absl::Status(s.code(), str_cat("reload_all: ", s.message(),
                                            " (what came back before it stays; call reload_all "
                                            "again once there is room)"));
    }
    e.offloaded = false;
  }
  STRATA_RETURN_IF_ERROR(im.engine.wait_all());
  im.step.offloaded = false;
  PolicyContext ctx(*this);
  return im.policy->on_reload_all(ctx);
}

bool Runtime::offloaded() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->step.offloaded;
}

}  // namespace strata::rt
