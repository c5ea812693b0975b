// runtime/runtime_impl.h (internal to runtime/): the state behind the Runtime facade, one member
// per room, and the one mutex every public call takes.
//
//   registry.{h,cpp}    entries, names, layers; register, unregister, info, read, write
//   migration.{h,cpp}   streams, events, bounce buffers; migrate, poll, wait_all
//   staging.{h,cpp}     the staging ring and its slot layouts
//   guards.cpp          acquire and release, holds
//   hooks.cpp           the step hooks, the step's state, and the PolicyContext
//   phase.cpp           phase switches: offload_all, reload_all
//   runtime.cpp         creation, teardown, statistics
//
// Functions named *_locked run with `mu` held and are what PolicyContext calls.
//
// Example (a public call):
//   absl::Status Runtime::wait_all() {
//     std::lock_guard<std::mutex> lock(impl_->mu);
//     return impl_->engine.wait_all();
//   }
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/migration.h"
#include "runtime/registry.h"
#include "runtime/runtime.h"
#include "runtime/staging.h"
#include "runtime/undo_log.h"

namespace strata::rt {

struct Runtime::Impl {
  Impl(std::shared_ptr<Device> device, std::unique_ptr<alloc::TieredAllocator> allocator,
       std::unique_ptr<alloc::BlockPool> staging_pool,
       std::unique_ptr<alloc::BlockPool> bounce_pool)
      : allocator(std::move(allocator)),
        engine(std::move(device), *this->allocator, std::move(bounce_pool)),
        staging(registry, engine, *this->allocator, std::move(staging_pool)),
        undo(*this->allocator, engine) {}
  ~Impl();

  // Where a step is (See Note [Step states] in hooks.cpp).
  struct StepState {
    bool in_step = false;
    bool in_optimizer_step = false;
    // end_optimizer_step was called but the policy could not finish its end of step.
    bool optimizer_unfinished = false;
    // Between offload_all and reload_all (See Note [Phase switches]).
    bool offloaded = false;
  };

  // registry.cpp
  absl::Status unregister_locked(TensorHandle tensor);
  void erase_refused(internal::Entry& e);
  absl::StatusOr<TensorInfo> info_locked(TensorHandle tensor) const;
  std::vector<TensorHandle> tensors_locked() const;
  std::vector<TensorHandle> layer_tensors_locked(int layer, RoleSet roles) const;
  std::size_t layer_bytes_locked(int layer, RoleSet roles) const;
  // migration.cpp
  absl::Status migrate_locked(TensorHandle tensor, Tier dst);
  // guards.cpp
  absl::StatusOr<void*> acquire_locked(internal::Entry& e, Tier tier, StreamHandle stream);
  absl::Status release_locked(const std::vector<internal::Entry*>& members, StreamHandle stream);
  // `tier` nullopt: each tensor where it is (where it is going, if it is moving).
  absl::StatusOr<std::vector<void*>> acquire_layer_locked(int layer, RoleSet roles,
                                                          std::optional<Tier> tier,
                                                          StreamHandle stream);
  // hooks.cpp
  absl::Status check_layer(const char* hook, int layer) const;
  absl::Status finish_optimizer_step(PolicyContext& ctx);
  std::string outstanding_holds() const;
  // runtime.cpp
  absl::Status release_scratch();
  std::size_t gpu_budget_locked() const;

  PolicyChoice choice;
  std::unique_ptr<alloc::TieredAllocator> allocator;
  internal::Registry registry;
  internal::MigrationEngine engine;
  internal::StagingRing staging;
  std::unique_ptr<ResidencyPolicy> policy;
  StepState step;
  int next_callback = 1;
  std::map<int, std::function<absl::Status()>> before_optimizer_step;
  internal::UndoLog undo;  // See Note [Undo log] in undo_log.cpp
  // Where the undo of a tensor resting on the GPU is kept: PolicyConfig::undo_on_gpu at first,
  // then Runtime::set_undo_on_gpu's.
  bool undo_on_gpu = false;
  mutable std::mutex mu;
};

}  // namespace strata::rt
