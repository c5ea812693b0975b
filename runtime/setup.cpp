#include "runtime/setup.h"

#include "allocator/tiered_allocator.h"

namespace strata::rt {

RuntimeOptions runtime_options(const ProgramSetup& setup) {
  RuntimeOptions o;
  o.policy = setup.policy;
  o.policy_source = setup.policy_source;
  o.device = setup.device;
  o.cuda_device = setup.cuda_device;
  o.policy_config.prefetch_depth = setup.prefetch_depth;
  o.policy_config.roles = setup.roles;
  o.policy_config.offload_after_step = true;
  o.policy_config.overlap = setup.overlap;
  o.policy_config.undo_on_gpu = setup.undo_on_gpu;
  o.policy_config.hybrid_fraction = setup.hybrid_fraction;
  o.allocator.track_allocations = true;
  o.allocator.device_method = setup.gpu_memory;
  if (setup.gpu_budget) o.allocator.budgets[alloc::tier_index(Tier::kGpu)] = *setup.gpu_budget;
  if (setup.pinned_budget) {
    o.allocator.budgets[alloc::tier_index(Tier::kPinnedHost)] = *setup.pinned_budget;
  }
  return o;
}

}  // namespace strata::rt
