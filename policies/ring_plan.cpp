// policies/ring_plan.cpp: LayerPrefetch's layout under the GPU budget: which layers stream, how
// many slots the staging ring takes, and which layers stay resident (policies/layer_prefetch.h).
#include <algorithm>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "policies/layer_prefetch.h"

namespace strata::policy {
namespace internal {

// Note [Resident layers]
// ~~~~~~~~~~~~~~~~~~~~~~
// A GPU budget says how much of the GPU strata may use. The ring takes K + 1 layers of it; with
// what the main pool has left, whole layers move there at the start of a step, in ascending order,
// as many as fit, and stay: they never stream, which saves their bytes on the link at every step
// (forward, backward and the optimizer step alike). Without a budget every layer streams: nothing
// says how much of the GPU strata may take. A layer only partly on the GPU streams the rest
// (stage_layer copies only what is not there). Tensors registered later compete with the resident
// layers for the main pool.

std::vector<int> LayerPrefetch::streamed_layers(const rt::PolicyContext& rt, RoleSet roles) const {
  std::vector<int> out;
  for (int layer : rt.layers()) {
    if (on_host(layer)) continue;
    for (rt::TensorHandle h : rt.layer_tensors(layer, roles)) {
      absl::StatusOr<rt::TensorInfo> info = rt.info(h);
      if (info.ok() && info->bytes > 0 && !resident(*info)) {
        out.push_back(layer);
        break;
      }
    }
  }
  return out;
}

// Note [Ring under a budget]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Once per change in the registry, the ring takes as many slots as fit the GPU budget beside what
// the main pool holds, K + 1 at most (and one more to drain under overlap: See Note [Draining
// slot]) and one at least (fewer slots prefetch less but stream the same bytes); a budget in which
// not even one slot fits is an error here, at setup. Then whole layers move into what is left
// (See Note [Resident layers]), in ascending order, as many as fit (the allocator refuses what
// would pass the budget). Nothing may be staged meanwhile. The ring comes first: when layers made
// resident by an earlier settle leave it fewer than K + 1 slots, they go home and the slots are
// counted again. Otherwise a role registered after a first step (gradients, in a loop that
// registers them once backward made them) would find the main pool full of the layers that
// settled without it, and the ring cut down to what is left: fewer layers prefetched, and in an
// overlapped step each fetch waiting for a write-back to free its slot.
absl::Status LayerPrefetch::settle(rt::PolicyContext& rt) {
  // A tensor unregistered since (a float32 master the hybrid's split moved off the host) may have
  // had room in the layout.
  if (settled_ && rt.unregistrations() == settled_unregistrations_) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(reset(rt));
  absl::Status fit = fit_ring(rt);
  if (!fit.ok() || slots_cap_ < wanted_slots(rt)) {
    STRATA_ASSIGN_OR_RETURN(const bool moved, unsettle_residents(rt));
    if (moved) fit = fit_ring(rt);
  }
  if (!fit.ok()) {
    return absl::Status(fit.code(),
                        str_cat("layer_prefetch: the GPU budget (", format_bytes(rt.gpu_budget()),
                                ") has no room for even one staging slot beside "
                                "what stays on the GPU: ",
                                fit.message()));
  }
  if (keep_resident_layers_ && rt.gpu_budget() != alloc::kNoBudget) {
    STRATA_RETURN_IF_ERROR(settle_residents(rt));
  }
  settled_ = true;
  settled_unregistrations_ = rt.unregistrations();
  return absl::OkStatus();
}

absl::Status LayerPrefetch::settle_residents(rt::PolicyContext& rt) {
  bool moved = false;
  for (int layer : rt.layers()) {
    if (on_host(layer)) continue;  // See Note [Hybrid placement]
    for (rt::TensorHandle h : rt.layer_tensors(layer, config().roles)) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, rt.info(h));
      if (info.bytes == 0 || resident(info)) continue;
      absl::Status s = rt.migrate(h, rt::Tier::kGpu);
      // No room left (a segment would pass the budget): the rest of this layer streams.
      if (s.code() == absl::StatusCode::kResourceExhausted) break;
      STRATA_RETURN_IF_ERROR(s);
      moved = true;
    }
  }
  if (!moved) return absl::OkStatus();
  // One host wait, at setup: the ring's slot count and the forward order are computed from where
  // the tensors are.
  STRATA_RETURN_IF_ERROR(rt.wait_all());
  parameter_layers_.reset();
  return configure(rt);
}

std::size_t LayerPrefetch::wanted_slots(const rt::PolicyContext& rt) const {
  return std::min<std::size_t>(
      config().prefetch_depth + 1,
      std::max<std::size_t>(streamed_layers(rt, config().roles).size(), 1));
}

absl::Status LayerPrefetch::fit_ring(rt::PolicyContext& rt) {
  // With a slot draining while at least two are staged (one ahead of the one in use), else
  // without one (See Note [Draining slot]).
  absl::Status fit;
  for (const bool drain : {true, false}) {
    if (drain && !overlap()) continue;  // nothing drains: the same sizes come next
    no_room_to_drain_ = !drain;
    for (std::size_t slots = wanted_slots(rt); slots >= (drain ? 2 : 1); --slots) {
      slots_cap_ = slots;
      fit = configure(rt);
      if (fit.code() != absl::StatusCode::kResourceExhausted) return fit;
    }
  }
  return fit;
}

absl::StatusOr<bool> LayerPrefetch::unsettle_residents(rt::PolicyContext& rt) {
  bool moved = false;
  for (int layer : rt.layers()) {
    for (rt::TensorHandle h : rt.layer_tensors(layer, config().roles)) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, rt.info(h));
      if (info.bytes == 0 || !resident(info)) continue;
      STRATA_RETURN_IF_ERROR(rt.migrate(h, placement(info.spec)));
      moved = true;
    }
  }
  if (!moved) return false;
  parameter_layers_.reset();
  STRATA_RETURN_IF_ERROR(rt.wait_all());  // one host wait, at setup, as settle_residents'
  return true;
}

// Note [Draining slot]
// ~~~~~~~~~~~~~~~~~~~~
// Under overlap a layer leaves its slot as soon as the optimizer stepped it in backward, and its
// write-back out of the slot waits for that step. A fetch into the same slot must wait for the
// write-back, and a copy engine runs the host-to-device copies in the order they were queued,
// across streams (design.md section 10): so that fetch, queued right behind the step, held up every
// host-to-device copy queued after it, torch's own included. Under FSDP2 that is the small copy its
// reduce-scatter queues on the compute stream for every unit, and backward waited at each unit
// for a step, a write-back and a fetch. So under overlap, when more layers stream than the ring
// holds, the ring has one slot more than it stages layers: the slot a release frees drains while
// the next fetch goes into the one freed a release earlier, whose write-back was queued a layer
// before (the ring gives a fetch the free slot freed longest ago, whatever order layers leave
// in: backward releases the layers whose parameters stream in the reverse of their staging).
// K layers are then fetched ahead of the one stepping, as without overlap. The budget counts the
// extra slot. Under a budget, two staged slots and one draining come before more staged and none
// draining; with room for fewer than three, the slots stage layers and none drains (one ahead is
// worth more than none waiting). The measurements:
// bench/results/2026-11-27-H200-f7e51cb-draining-slot/.
absl::Status LayerPrefetch::configure(rt::PolicyContext& rt) {
  const std::size_t layers = streamed_layers(rt, config().roles).size();
  slots_ = std::max<std::size_t>(1, std::min(slots_cap_, std::max<std::size_t>(layers, 1)));
  draining_slot_ = overlap() && layers > slots_ && slots_ >= 2 && !no_room_to_drain_;
  return rt.configure_staging(static_cast<int>(slots_ + (draining_slot_ ? 1 : 0)), config().roles);
}

}  // namespace internal

}  // namespace strata::policy
