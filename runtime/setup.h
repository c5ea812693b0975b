// runtime/setup.h: the runtime a program asks for, turned into RuntimeOptions in one place.
//
// strata-train's flags and strata.optim's arguments name the same things: a policy, a device, the
// policy's knobs and the budgets. Both fill a ProgramSetup and call runtime_options(), so the C++
// apps and Python set the runtime up alike (the same defaults, the same offload between steps, the
// same leak tracking) and nothing of it is written twice.
//
// Example:
//   rt::ProgramSetup setup;
//   setup.policy = "layer_prefetch";
//   setup.policy_source = "--strata_policy";
//   setup.prefetch_depth = 3;
//   setup.gpu_budget = std::size_t{8} << 30;
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<rt::Runtime> runtime,
//                           rt::Runtime::create(rt::runtime_options(setup),
//                                               policy::builtin_policies()));
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "allocator/upstream.h"
#include "runtime/device.h"
#include "runtime/policy.h"
#include "runtime/runtime.h"

namespace strata::rt {

struct ProgramSetup {
  // See choose_policy_name: this, else STRATA_POLICY, else the default. `policy_source` names the
  // flag or argument it came from, for the runtime's errors.
  std::optional<std::string> policy;
  std::string policy_source = "RuntimeOptions::policy";
  DeviceKind device = DeviceKind::kAuto;
  int cuda_device = kCurrentCudaDevice;  // See Note [One CUDA device a runtime] in runtime.h
  // The policy's knobs (See PolicyConfig).
  int prefetch_depth = PolicyConfig{}.prefetch_depth;
  RoleSet roles = PolicyConfig{}.roles;
  Overlap overlap = Overlap::kNone;
  bool undo_on_gpu = false;
  std::optional<double> hybrid_fraction;
  // Budgets: none given leaves the allocator's defaults (no GPU limit, the machine's host budgets).
  std::optional<std::size_t> gpu_budget;
  std::optional<std::size_t> pinned_budget;
  alloc::DeviceMethod gpu_memory = alloc::DeviceMethod::kAuto;
};

// The options for `setup`. Beyond what it names, a program's runtime:
// - rests the moved roles on the host between steps (PolicyConfig::offload_after_step), which is
//   what a user who offloads expects of bulk, and what layer_prefetch and hybrid do anyway;
// - tracks its allocations, for the leak report after unregistering.
RuntimeOptions runtime_options(const ProgramSetup& setup);

}  // namespace strata::rt
