// policies/builtin.h: strata's residency policies and the registry that names them.
//
//   keep_on_gpu     everything registered lives on the GPU; nothing moves.
//   bulk            tensors live at their home tier (normally the GPU); offload_all moves every
//                   tensor of the configured roles to pinned host memory while the pinned budget
//                   allows and to pageable memory after, reload_all brings them back; with
//                   PolicyConfig::offload_after_step they rest on the host and come back for
//                   every step as far as the GPU budget allows, the rest streaming a layer at a
//                   time (See Note [Bulk over budget] in bulk.cpp).
//   layer_prefetch  tensors of the configured roles (optimizer states by default) live in pinned
//                   host memory; during the optimizer step the next K layers are fetched into the
//                   staging ring while layer i computes, and layer i is written back after;
//                   with parameters among the roles, forward and backward stream the same way;
//                   with a GPU budget, whole layers that fit beside the ring stay on the GPU.
//   hybrid          layer_prefetch with some layers' optimizer steps on the host: their gradients
//                   go to pinned memory, the optimizer's host kernel steps their states there, and
//                   their parameters come back; the split comes from a cost model over rates
//                   measured on the machine, or from hybrid_fraction (See Note [Hybrid placement]
//                   in hybrid.cpp).
//
// Example:
//   RuntimeOptions options;
//   options.policy = "layer_prefetch";
//   options.policy_config.prefetch_depth = 2;
//   STRATA_ASSIGN_OR_RETURN(auto rt, Runtime::create(std::move(options), builtin_policies()));
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "runtime/policy.h"

namespace strata::policy {

// The registry with keep_on_gpu, bulk, layer_prefetch and hybrid.
const rt::PolicyRegistry& builtin_policies();

absl::StatusOr<std::unique_ptr<rt::ResidencyPolicy>> make_keep_on_gpu(const rt::PolicyConfig& c);
absl::StatusOr<std::unique_ptr<rt::ResidencyPolicy>> make_bulk(const rt::PolicyConfig& c);
absl::StatusOr<std::unique_ptr<rt::ResidencyPolicy>> make_layer_prefetch(const rt::PolicyConfig& c);
absl::StatusOr<std::unique_ptr<rt::ResidencyPolicy>> make_hybrid(const rt::PolicyConfig& c);
// layer_prefetch that streams every layer, whatever the budget leaves (no resident layers;
// See Note [Resident layers] in ring_plan.cpp): bulk's streaming step, after which bulk moves
// everything to the host anyway.
absl::StatusOr<std::unique_ptr<rt::ResidencyPolicy>> make_layer_streamer(const rt::PolicyConfig& c);

}  // namespace strata::policy
