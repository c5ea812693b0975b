// runtime/policy.h: the ResidencyPolicy interface, its configuration, the PolicyContext through
// which a policy acts on the runtime, and the name -> factory registry from which a policy is
// chosen at startup.
//
// A policy decides where tensors live and when they move; the runtime calls it from its hooks
// (begin/end of step, before forward and after backward of a layer, the optimizer step, phase
// switches) and the policy answers through the PolicyContext it is handed: the runtime's registry,
// migration, staging and guard calls, run under the runtime's mutex, which the runtime holds for
// the whole hook (See Note [Hooks hold the runtime's mutex] in hooks.cpp). The concrete policies
// live in policies/; this layer only knows their names through a PolicyRegistry.
//
// Choosing by name: RuntimeOptions::policy (which a program fills from its own flag or argument),
// else the environment variable STRATA_POLICY, else kDefaultPolicy. A name that is unknown, or
// empty where it was given, is kInvalidArgument listing the valid names.
//
// Example:
//   PolicyRegistry registry;
//   STRATA_RETURN_IF_ERROR(registry.add("keep_on_gpu", [](const PolicyConfig& c) { ... }));
//   STRATA_ASSIGN_OR_RETURN(std::string name, choose_policy_name(options.policy));
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<ResidencyPolicy> p, registry.create(name, config));
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/stats.h"
#include "allocator/stream_ops.h"
#include "runtime/step_costs.h"
#include "runtime/tensor.h"

namespace strata::rt {

class Runtime;
using alloc::StreamHandle;

// The order in which stage_layer queues a layer's copies (See Note [Staging order] in runtime.h).
enum class StageOrder { kRegistered, kSmallestFirst, kLargestFirst };

// What a policy may do, from inside a hook: the calls of Runtime's that carry the same names (see
// runtime.h for each), run with the runtime's mutex already held. Only the runtime makes one, for
// the duration of a hook; a policy must not keep it.
class PolicyContext {
 public:
  std::vector<TensorHandle> tensors() const;
  absl::StatusOr<TensorInfo> info(TensorHandle tensor) const;
  std::vector<TensorHandle> layer_tensors(int layer, RoleSet roles) const;
  std::vector<int> layers() const;
  std::size_t layer_bytes(int layer, RoleSet roles) const;
  // Tensors unregistered so far (Runtime::unregistrations): a layout made before it changed may
  // hold room for tensors that are gone.
  std::uint64_t unregistrations() const;
  std::vector<int> optimizer_layer_order() const;

  [[nodiscard]] absl::Status migrate(TensorHandle tensor, Tier dst);
  [[nodiscard]] absl::Status wait_all();
  [[nodiscard]] absl::Status configure_staging(int slots, RoleSet roles);
  // Frees the staging ring (nothing may be staged), so its GPU memory is the main pool's to use.
  [[nodiscard]] absl::Status release_staging();
  [[nodiscard]] absl::Status stage_layer(int layer, std::optional<RoleSet> roles = std::nullopt,
                                         StageOrder order = StageOrder::kRegistered);
  [[nodiscard]] absl::Status unstage_layer(int layer,
                                           std::optional<RoleSet> write_back = std::nullopt);
  bool is_staged(int layer) const;
  // Holds the layer's tensors of `roles` on `tier` for work on `stream` (acquire_layer, without
  // the addresses), all or nothing.
  [[nodiscard]] absl::Status hold_layer(int layer, RoleSet roles, Tier tier, StreamHandle stream);
  // The same, each tensor where it is (where it is going, if it is moving): nothing moves, and
  // `stream` waits for whatever copy brings a tensor there.
  [[nodiscard]] absl::Status hold_layer_in_place(int layer, RoleSet roles, StreamHandle stream);
  [[nodiscard]] absl::Status release(const std::vector<TensorHandle>& tensors, StreamHandle stream);
  StreamHandle compute_stream() const;

  // The GPU memory strata may use (Runtime::gpu_budget), and the GPU tier's main pool.
  std::size_t gpu_budget() const;
  std::size_t gpu_pool_budget() const;
  alloc::TierStats gpu_pool_stats() const;

 private:
  friend class Runtime;
  explicit PolicyContext(Runtime& runtime) : runtime_(runtime) {}
  Runtime& runtime_;
};

inline constexpr std::string_view kDefaultPolicy = "layer_prefetch";

// When the optimizer steps (See Note [Overlapped step] in optim/adam.h): after backward (kNone), or
// each layer as soon as its backward is done (kBackward), speculatively, validated after backward.
enum class Overlap { kNone, kBackward };
// "none" / "backward"; kInvalidArgument naming both for anything else.
absl::StatusOr<Overlap> parse_overlap(std::string_view name);
std::string_view overlap_name(Overlap overlap);

// Note [Step placement]
// ~~~~~~~~~~~~~~~~~~~~~
// A policy decides where tensors live and also where each layer's optimizer step runs: on the GPU
// (its states brought there, streamed or resident) or on the host (its gradients copied out, the
// optimizer's host kernel stepping its states where they rest in pinned memory, its parameters
// copied back). A policy that places steps says so (places_steps); the optimizer then hands it,
// once and before it registers any state (the states a layer needs depend on where it steps: a
// float32 parameter stepped on the host keeps a float32 master copy there), what each layer's step
// costs and the rates measured on this machine (Runtime::place_steps), and asks step_place(layer)
// from then on. Every other policy steps every layer on the GPU.
enum class StepPlace { kGpu, kHost };
std::string_view step_place_name(StepPlace place);

struct PolicyConfig {
  // layer_prefetch: layers fetched ahead of the one the optimizer works on (K >= 0). The staging
  // area holds K + 1 layers.
  int prefetch_depth = 1;
  // Which roles the policy moves (bulk: at phase switches; layer_prefetch: through staging).
  RoleSet roles = RoleSet::optimizer_states();
  // bulk: move everything of `roles` to the host after every step and back before the next.
  bool offload_after_step = false;
  // layer_prefetch: with kBackward, a layer's optimizer states come to the GPU during backward and
  // the layer stays staged after its backward until the optimizer released it (its step).
  Overlap overlap = Overlap::kNone;
  // With kBackward: the bytes an overlapped step keeps for its redo of a tensor resting on the GPU
  // are copied on the GPU (no link traffic) while the GPU tier has room under the budget, and to
  // pinned host memory otherwise (See Note [Undo log] in runtime/undo_log.cpp).
  bool undo_on_gpu = false;
  // hybrid: the fraction of parameters whose step runs on the GPU, forced (0: every layer on the
  // host, 1: none); unset: the cost model's choice (See Note [Hybrid cost model] in
  // policies/step_cost_model.h).
  std::optional<double> hybrid_fraction = std::nullopt;
};

class ResidencyPolicy {
 public:
  virtual ~ResidencyPolicy() = default;
  virtual std::string_view name() const = 0;
  const PolicyConfig& config() const { return config_; }

  // Where a tensor lives once registered; the default is its spec's home tier.
  virtual Tier placement(const TensorSpec& spec) const { return spec.home; }
  // Called after a tensor is placed; an error undoes the registration (e.g. a layer that no longer
  // fits the GPU budget).
  [[nodiscard]] virtual absl::Status on_register(PolicyContext& rt, TensorHandle tensor) {
    return absl::OkStatus();
  }
  // Lays out what the registered tensors need on the GPU under the budget (a staging ring, layers
  // kept resident, what comes back each step), so that a budget too small is an error here, at
  // setup, and never half way through a step. Runtime::prepare calls it; a policy also calls it
  // itself before the first step after tensors were registered or unregistered.
  [[nodiscard]] virtual absl::Status on_prepare(PolicyContext& rt) { return absl::OkStatus(); }
  [[nodiscard]] virtual absl::Status on_begin_step(PolicyContext& rt) { return absl::OkStatus(); }
  [[nodiscard]] virtual absl::Status on_end_step(PolicyContext& rt) { return absl::OkStatus(); }
  [[nodiscard]] virtual absl::Status on_before_forward(PolicyContext& rt, int layer) {
    return absl::OkStatus();
  }
  // Before anything of the layer's backward is queued (Runtime::before_backward; clients may
  // not call it, so a policy must stay correct without it for layers whose backward passes run
  // in the reverse order of their forward).
  [[nodiscard]] virtual absl::Status on_before_backward(PolicyContext& rt, int layer) {
    return absl::OkStatus();
  }
  [[nodiscard]] virtual absl::Status on_after_backward(PolicyContext& rt, int layer) {
    return absl::OkStatus();
  }
  [[nodiscard]] virtual absl::Status on_begin_optimizer_step(PolicyContext& rt) {
    return absl::OkStatus();
  }
  // The optimizer released `layer` (its kernel is queued on the compute stream).
  [[nodiscard]] virtual absl::Status on_layer_released(PolicyContext& rt, int layer) {
    return absl::OkStatus();
  }
  [[nodiscard]] virtual absl::Status on_end_optimizer_step(PolicyContext& rt) {
    return absl::OkStatus();
  }
  // Phase switches (See Note [Phase switches] in runtime/phase.cpp): before offload_all moves
  // tensors, the policy puts home what it staged and releases what it holds; after reload_all
  // brought them back, it reserves again what it needs (its staging ring) and resumes.
  // Runtime::rollback_undo put back the bytes of a step taken during backward: the layers the
  // optimizer released since the step began are to be stepped again.
  [[nodiscard]] virtual absl::Status on_undo_rolled_back(PolicyContext& rt) {
    return absl::OkStatus();
  }
  // Runtime::set_gpu_budget changed the budget, between steps: lay out again what the policy
  // keeps on the GPU (as on_prepare does), so that a budget too small fails here.
  [[nodiscard]] virtual absl::Status on_budget_changed(PolicyContext& rt) {
    return absl::OkStatus();
  }
  [[nodiscard]] virtual absl::Status on_offload_all(PolicyContext& rt) { return absl::OkStatus(); }
  [[nodiscard]] virtual absl::Status on_reload_all(PolicyContext& rt) { return absl::OkStatus(); }
  // See Note [Step placement]. Whether this policy places steps (the default: no, all on the GPU).
  virtual bool places_steps() const { return false; }
  // Decides where each layer of `costs` steps; called before the optimizer registers its states.
  // Returns one line saying what it decided, for the log.
  [[nodiscard]] virtual absl::StatusOr<std::string> on_place_steps(PolicyContext& rt,
                                                                   const StepCosts& costs) {
    return std::string();
  }
  // Where the optimizer steps `layer`.
  virtual StepPlace step_place(int layer) const { return StepPlace::kGpu; }
  // Whether the policy wants the optimizer's step times now (See Note [Measured split] in
  // policies/split_search.h); the optimizer then hands it each step's times, between steps,
  // and it may move layers' steps there (step_place changes; a failed move leaves them where they
  // were and stops measuring). Returns a line saying what it decided once its search ends, empty
  // otherwise.
  virtual bool wants_step_times() const { return false; }
  [[nodiscard]] virtual absl::StatusOr<std::string> on_step_measured(PolicyContext& rt,
                                                                     const StepTimes& times) {
    return std::string();
  }
  // The optimizer could not measure a step or follow what on_step_measured moved (no host memory
  // for the moved layers' buffers): the policy stops measuring and puts back what the last
  // on_step_measured moved.
  [[nodiscard]] virtual absl::Status on_move_refused(PolicyContext& rt) { return absl::OkStatus(); }
  // The order in which the optimizer walks layers; default ascending.
  virtual std::vector<int> optimizer_layer_order(const PolicyContext& rt) const;

 protected:
  explicit ResidencyPolicy(PolicyConfig config) : config_(config) {}

 private:
  PolicyConfig config_;
};

using PolicyFactory =
    std::function<absl::StatusOr<std::unique_ptr<ResidencyPolicy>>(const PolicyConfig&)>;

class PolicyRegistry {
 public:
  // kAlreadyExists for a name added twice; kInvalidArgument for an empty name.
  [[nodiscard]] absl::Status add(std::string name, PolicyFactory factory);
  // kInvalidArgument for an unknown or empty name (listing the valid names) and for an invalid
  // configuration (from the factory).
  [[nodiscard]] absl::StatusOr<std::unique_ptr<ResidencyPolicy>> create(
      std::string_view name, const PolicyConfig& config) const;
  // Sorted.
  std::vector<std::string> names() const;

 private:
  std::map<std::string, PolicyFactory, std::less<>> factories_;
};

// The name to use: `given` if set, else STRATA_POLICY if set, else kDefaultPolicy. Returns it
// unchecked (PolicyRegistry::create checks it; an empty name is an error there); `source` says
// where it came from: `given_source` (a program names its flag or argument, e.g.
// "--strata_policy"), "STRATA_POLICY" or "default". The runtime reads no flag of its own: flags
// belong to the binaries.
struct PolicyChoice {
  std::string name;
  std::string source;
};
PolicyChoice choose_policy_name(const std::optional<std::string>& given,
                                std::string_view given_source = "RuntimeOptions::policy");

}  // namespace strata::rt
