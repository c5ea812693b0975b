// apps/train/train.h: one training run of the GPT decoder, under a strata policy or as one of
// PyTorch's own baselines, with what each step did.
//
// A strata run binds the model's parameters and gradients to a runtime (bridge/), registers the
// Adam states through strata's Adam, and calls the runtime's hooks around forward, backward and the
// optimizer step; the policy decides where the states live. A PyTorch run trains the same model
// from the same seed with torch::optim::AdamW, its states resident on the device or moved there and
// back with .to() around each step. Runs never throw: a failure (out of memory, a bad option) is
// recorded in the result with its message.
//
// Example:
//   TrainOptions options;
//   options.steps = 5;
//   RunResult r = run_strata(options, "layer_prefetch", print_progress);
//   if (!r.ok) std::fprintf(stderr, "%s\n", r.error.c_str());
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "allocator/tier.h"
#include "allocator/upstream.h"
#include "apps/train/gpt.h"
#include "apps/train/text_data.h"
#include "optim/state_codec.h"
#include "optim/step_rule.h"
#include "runtime/policy.h"
#include "runtime/step_costs.h"
#include "runtime/tensor.h"

namespace strata::apps {

struct TrainOptions {
  GptConfig model;
  int steps = 20;
  double lr = 3e-3;
  double weight_decay = 0.01;  // matrices only; biases and norms take none
  std::uint64_t seed = 7;
  bool cuda = false;  // the GPU; otherwise the simulated device, with the model on the CPU
  std::size_t gpu_budget = static_cast<std::size_t>(-1);  // strata's GPU tier; unlimited
  int prefetch_depth = 1;                                 // layer_prefetch's K
  // How strata's GPU tier gets its memory (See Note [Device memory method] in
  // allocator/cuda_device_upstream.cpp).
  alloc::DeviceMethod gpu_memory = alloc::DeviceMethod::kAuto;
  // What bulk moves and layer_prefetch streams; with parameters and gradients too, a model larger
  // than the GPU budget trains (See Note [Bulk over budget] in policies/bulk.cpp).
  rt::RoleSet roles = rt::RoleSet::optimizer_states();
  // After every N-th step, a phase switch (apps/train/phase_switch.h); 0: none.
  int phase_switch_every = 0;
  // The model's parameters and gradients: float32, or bfloat16 / float16 with float32 master
  // weights (strata's Adam keeps them as optimizer state; PyTorch runs keep a float32 copy).
  torch::Dtype dtype = torch::kFloat;
  // Global gradient-norm clipping as torch.nn.utils.clip_grad_norm_; 0: off.
  double clip_grad_norm = 1.0;
  // The overlap of run names without a "+overlap" suffix (See Note [Overlapped step] in
  // optim/adam.h): kBackward steps each layer during backward.
  rt::Overlap overlap = rt::Overlap::kNone;
  // With the overlap: each layer's step on a stream of its own (See Note [The step stream] in
  // bridge/model_hooks.cpp), and PolicyConfig::undo_on_gpu.
  bool step_on_own_stream = true;
  bool undo_on_gpu = false;
  // hybrid: the share of parameters stepped on the GPU, forced; unset: the cost model's choice.
  std::optional<double> hybrid_fraction;
  // Threads of the host kernel (AdamOptions::cpu_threads); 0: one a core.
  int host_threads = 0;
  // Real text to train on (--text_dir); null: synthetic_batch.
  std::shared_ptr<const TextCorpus> text;
  // How strata's Adam stores the moments (See Note [Compressed moments] in optim/state_codec.h).
  optim::StateType state_dtype = optim::StateType::kF32;
  // The step rule strata's optimizer applies (See Note [Step rules] in optim/step_rule.h).
  std::shared_ptr<const optim::StepRule> rule = optim::adam_rule();
  // Micro-batches per step (gradient accumulation), each of `model.batch` sequences.
  int grad_accum = 1;
  // Where a step's time ends (See Note [Step end] in apps/train/torch_device.h).
  enum class StepEnd { kStream, kDevice };
  StepEnd step_end = StepEnd::kStream;
};

// The suffix of a run name whose optimizer steps during backward: "layer_prefetch+overlap".
inline constexpr std::string_view kOverlapSuffix = "+overlap";

// float16 runs scale the loss dynamically as torch.amp.GradScaler does (these defaults).
inline constexpr double kInitialLossScale = 65536.0;
inline constexpr int kLossScaleGrowthInterval = 2000;

struct StepRecord {
  int step = 0;  // 1-based
  float loss = 0;
  // Forward + backward + optimizer, from the previous step's end (See Note [Step end] in
  // torch_device.h).
  double step_ms = 0;
  double optimizer_ms = 0;  // the optimizer step alone (synchronized before and after)
  std::int64_t h2d_bytes = 0;
  std::int64_t d2h_bytes = 0;
  double h2d_gbps = 0;  // over the time the copy streams were busy (0: nothing timed)
  double d2h_gbps = 0;
  double waited_ms = 0;  // time compute waited on prefetches, on the GPU
  // The host-stepped layers' host time (optim::Adam::host_step_seconds), in ms: queueing the GPU
  // layers before the host's first wait, waiting for gradients, and the host kernel.
  double host_queued_ms = 0;
  double host_waited_ms = 0;
  double host_kernel_ms = 0;
  float grad_norm = 0;   // before clipping, as clip_grad_norm_ returns it
  float loss_scale = 1;  // the step's loss scale (float16)
  bool skipped = false;  // its gradients held inf/NaN: no parameter changed
  // Overlapped runs: the step taken during backward was rolled back and taken again (clipping
  // triggered, or inf was found).
  bool redone = false;
  std::int64_t peak_gpu_bytes = 0;    // strata's GPU memory and torch's own, at their peaks
  std::int64_t strata_gpu_bytes = 0;  // of which strata's (GPU tier and staging ring, <= budget)
  double fragmentation[alloc::kNumTiers] = {};  // strata runs: per tier, at the end of the step
  std::int64_t host_rss_bytes = -1;  // the process's resident set at the step's end (-1: unknown)
};

// One phase switch (apps/train/phase_switch.h).
struct PhaseSwitchRecord {
  int after_step = 0;
  double offload_ms = 0;             // until the data is on the host and the GPU memory handed back
  double reload_ms = 0;              // until everything is back and training can go on
  std::int64_t offloaded_bytes = 0;  // GPU -> host during the offload
  std::int64_t reloaded_bytes = 0;   // host -> GPU during the reload
  // The run's own GPU memory (strata: its GPU tier and staging ring) before and after the offload.
  std::int64_t gpu_bytes_before_offload = 0;
  std::int64_t gpu_reserved_after_offload_bytes = 0;
  // Free GPU memory as cudaMemGetInfo sees it, after the offload minus before; -1 without a GPU.
  std::int64_t driver_freed_bytes = -1;
  // What the rollout's stand-in took through torch and gave back while training was away.
  std::int64_t rollout_stand_in_bytes = 0;
  std::int64_t pinned_allocations = 0;  // strata's pinned segments allocated by the switch
  // The link right before the switch (raw pinned copies, GPU only), and the time its bytes need
  // at those rates: the floors of offload_ms and reload_ms.
  double link_h2d_gbps = 0;
  double link_d2h_gbps = 0;
  double offload_floor_ms = 0;
  double reload_floor_ms = 0;
  // Time inside cudaMalloc / cudaFree for the run's GPU memory during the whole switch (the
  // offload frees, the reload allocates), where the run can tell (strata: its GPU tier).
  double cuda_malloc_ms = 0;
  double cuda_free_ms = 0;
};

struct RunResult {
  std::string name;  // the policy, or "torch_adamw_resident" / "torch_adamw_to"
  bool strata = true;
  bool ok = false;
  std::string error;  // when !ok
  // The run failed before its first step began: building the runtime, binding the model, making
  // the optimizer (where the policy lays itself out under the GPU budget).
  bool failed_at_setup = false;
  std::vector<StepRecord> steps;
  std::vector<PhaseSwitchRecord> phase_switches;  // with TrainOptions::phase_switch_every
  // Host memory: the process's resident set when the run began and at its peak during the run
  // (base/host_memory.h); -1 where unknown (the peak: where it could not be started anew, so that
  // it would cover earlier runs too).
  std::int64_t host_rss_at_start_bytes = -1;
  std::int64_t peak_host_rss_bytes = -1;
  // With TrainOptions::StepEnd::kStream: the wait, after the last step, for its copies that were
  // still running when its time ended (See Note [Step end] in torch_device.h).
  double drain_ms = 0;
  // strata runs:
  std::string allocator_table;  // per-tier statistics at the end of training
  std::string allocator_json;
  std::string leak_report;  // after every tensor was unregistered
  bool leak_free = false;
  std::int64_t host_syncs = 0;  // the runtime's own host waits
  std::int64_t staged_peak_bytes = 0;
  std::int64_t staging_bytes = 0;
  std::int64_t setup_gpu_bytes = 0;  // strata's GPU memory at its peak during setup
  std::int64_t state_bytes = 0;      // Adam moments registered
  // Where the optimizer steps each layer (See Note [Step placement] in runtime/policy.h): the
  // policy's line (empty when it places none), the host-stepped layers, the host kernel's threads
  // and the rates measured for the placement.
  std::string placement;
  std::vector<int> host_layers;
  int host_threads = 0;
  std::optional<rt::StepRates> step_rates;
  // The pinned tier's reserved bytes at their peak over the steps, and the undo log's peak
  // (See Note [Undo log] in runtime/undo_log.cpp: what an overlapped step keeps for a redo).
  std::int64_t pinned_reserved_peak_bytes = 0;
  std::int64_t undo_peak_bytes = 0;
};

// Called after each step with the run so far (for progress lines).
using StepCallback = std::function<void(const RunResult&, const StepRecord&)>;

// The model's layers' step working sets (parameters, gradients, two moments), by strata layer.
std::vector<std::int64_t> layer_step_bytes(const TrainOptions& options);

// `policy`: a policy's name, with kOverlapSuffix for a run that steps during backward.
RunResult run_strata(const TrainOptions& options, const std::string& policy,
                     const StepCallback& on_step);

// kResident: torch's fused AdamW with its states on the GPU. kMovedWithTo: the same, its states
// moved to pinned host memory after each step and back before the next. kHostStep: torch's fused
// AdamW on the host over float32 masters and states in host memory, the gradients copied out and
// the masters copied back around it (the path of FSDP2's CPUOffloadPolicy); named in --runs only.
enum class TorchBaseline { kResident, kMovedWithTo, kHostStep };
inline constexpr TorchBaseline kTorchBaselines[] = {
    TorchBaseline::kResident, TorchBaseline::kMovedWithTo, TorchBaseline::kHostStep};
std::string baseline_name(TorchBaseline which);
RunResult run_torch(const TrainOptions& options, TorchBaseline which, const StepCallback& on_step);

}  // namespace strata::apps
