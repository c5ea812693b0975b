// strata-train: trains a GPT-style decoder in LibTorch under a strata residency policy and shows
// what the runtime did: one progress line per step, a summary table, the allocator's per-tier
// statistics and its leak report. With --compare it trains the same model from the same seed under
// every strata policy and PyTorch's own AdamW baselines and says whether the strata losses agree
// bitwise. Runs on the GPU when there is one, on the simulated device (model on the CPU) otherwise.
//
//   build/bin/strata-train [--strata_policy=layer_prefetch] [--strata_gpu_budget=8GiB]
//                          [--strata_roles=optimizer_states|all] [--steps=20] [--layers=4
//                          --d_model=128 --heads=4 --vocab=256
//                          --seq=64 --batch=8] [--dtype=float32|bfloat16|float16]
//                          [--clip_grad_norm=1.0] [--phase_switch_every=N]
//                          [--strata_overlap=none|backward] [--strata_undo_on_gpu]
//                          [--strata_step_stream=own|compute] [--grad_accum=N]
//                          [--step_end=stream|device] [--compare]
//                          [--json=FILE] [--chart=FILE.svg]
//
// Exit codes: 0 trained (with --compare: at least two strata policies trained with bitwise equal
// losses); 1 a run failed (a leak, losses that differ or cannot be compared, an error during
// training); 2 bad usage (an unknown policy or flag value, an output file that cannot be written,
// a GPU budget in which the policy cannot lay out even one layer: found at setup, before any
// step).
#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "allocator/upstream.h"
#include "apps/train/report.h"
#include "apps/train/text_data.h"
#include "apps/train/train.h"
#include "base/strings.h"
#include "base/units.h"
#include "optim/state_decl.h"
#include "policies/builtin.h"
#include "runtime/device.h"
#include "runtime/policy.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::apps {

// The value of --strata_policy: not given, or the name given (an empty one, `--strata_policy=`,
// is bad usage, as an empty STRATA_POLICY is).
struct PolicyFlag {
  std::optional<std::string> name;
};
bool AbslParseFlag(absl::string_view text, PolicyFlag* flag, std::string* /*error*/) {
  flag->name = std::string(text);
  return true;
}
std::string AbslUnparseFlag(const PolicyFlag& flag) { return flag.name.value_or(""); }

}  // namespace strata::apps

ABSL_FLAG(strata::apps::PolicyFlag, strata_policy, strata::apps::PolicyFlag{},
          "residency policy of the strata runtime (keep_on_gpu, bulk, layer_prefetch, hybrid); "
          "else STRATA_POLICY, else layer_prefetch");
ABSL_FLAG(std::string, strata_gpu_budget, "",
          "GPU memory strata may use for model state, e.g. 8GiB (default: no limit)");
ABSL_FLAG(std::string, strata_gpu_memory, "auto",
          "how strata's GPU tier gets its memory: virtual (CUDA virtual memory management, whose "
          "frees overlap copies in flight), cudamalloc, or auto (virtual where supported)");
ABSL_FLAG(std::string, strata_roles, "optimizer_states",
          "what bulk moves and layer_prefetch streams: optimizer_states, or all (parameters and "
          "gradients too, for a model larger than the GPU budget), or a list of roles such as "
          "parameter,optimizer_state");
ABSL_FLAG(std::string, state_dtype, "float32",
          "how strata's Adam stores exp_avg and exp_avg_sq: float32, bfloat16 (stochastically "
          "rounded) or int8 (a float32 scale per block of 256), on every tier and on the link");
ABSL_FLAG(std::string, optimizer, "adamw",
          "the optimizer strata steps: adamw, or lion (one state a parameter; See Note [Step "
          "rules] in optim/step_rule.h); lion leaves PyTorch's AdamW baselines out of --compare");
ABSL_FLAG(std::string, text_dir, "",
          "train on real text: the bytes of the *.py files in this directory (e.g. the Python "
          "standard library's), up to 64 MiB, instead of the synthetic data; needs --vocab=256");
ABSL_FLAG(int, steps, 20, "training steps");
ABSL_FLAG(int64_t, layers, 4, "transformer blocks");
ABSL_FLAG(int64_t, d_model, 128, "model width");
ABSL_FLAG(int64_t, heads, 4, "attention heads (must divide d_model)");
ABSL_FLAG(int64_t, vocab, 256, "vocabulary size");
ABSL_FLAG(int64_t, seq, 64, "tokens per sequence");
ABSL_FLAG(int64_t, batch, 8, "sequences per step");
ABSL_FLAG(double, lr, 3e-3, "AdamW learning rate");
ABSL_FLAG(int, prefetch_depth, 1, "layer_prefetch: layers fetched ahead (K)");
ABSL_FLAG(uint64_t, seed, 7, "seed of the initial weights and of the synthetic data");
ABSL_FLAG(std::string, device, "auto", "auto (the GPU if there is one), cuda, or simulated");
ABSL_FLAG(std::string, dtype, "float32",
          "parameters and gradients: float32, or bfloat16 / float16 with float32 master weights "
          "(float16 with dynamic loss scaling, as torch.amp.GradScaler)");
ABSL_FLAG(double, clip_grad_norm, 1.0,
          "clip gradients to this global 2-norm each step, as torch.nn.utils.clip_grad_norm_ "
          "(0: off)");
ABSL_FLAG(int, phase_switch_every, 0,
          "after every N-th step, a phase switch as an RL trainer makes one for its rollout: "
          "offload_all, a stand-in for the rollout engine allocating the freed GPU memory through "
          "torch, reload_all (0: none)");
ABSL_FLAG(std::string, strata_overlap, "none",
          "when the optimizer steps: none (after backward), or backward (each layer as soon as its "
          "backward is done, validated after backward and redone when clipping triggers or inf is "
          "found; results are bitwise the same)");
ABSL_FLAG(bool, strata_undo_on_gpu, false,
          "with the overlapped step: the copies a redo needs of tensors resting on the GPU stay "
          "on the GPU while the budget has room, instead of crossing the link to pinned memory");
ABSL_FLAG(double, strata_hybrid_fraction, -1,
          "hybrid: the share of parameters whose optimizer step runs on the GPU, in [0, 1] (the "
          "rest on the host); below 0: the cost model chooses");
ABSL_FLAG(int, strata_host_threads, 0,
          "hybrid: threads the host kernel steps host-placed layers on (0: one a core)");
ABSL_FLAG(std::string, strata_step_stream, "own",
          "with the overlapped step: where each layer's step runs, own (a stream of its own, so "
          "that its wait for the layer's states does not hold up backward) or compute (the stream "
          "backward computes on; for measuring what the own stream gains)");
ABSL_FLAG(std::string, step_end, "stream",
          "where a step's time ends: stream (when the stream the model computes on is done, as a "
          "training loop that reads its loss waits; copies still running, such as the last "
          "write-backs, go on into the next step, whose time runs from this one's end) or device "
          "(when every stream is done)");
ABSL_FLAG(int, grad_accum, 1,
          "micro-batches per step: gradients accumulate over them before the optimizer steps");
ABSL_FLAG(std::string, runs, "",
          "with --compare: only these runs, in this order, e.g. "
          "layer_prefetch+overlap,torch_adamw_resident,layer_prefetch; a name given twice runs "
          "twice, so that repetitions interleave (default: every strata policy, then "
          "torch_adamw_resident and torch_adamw_to; torch_adamw_host, torch's fused AdamW on the "
          "host with its copies, runs only when named)");
ABSL_FLAG(bool, compare, false,
          "train under every strata policy and PyTorch's AdamW baselines, side by side");
ABSL_FLAG(std::string, json, "", "write everything measured to this JSON file");
ABSL_FLAG(std::string, chart, "", "draw step time and peak GPU memory to this SVG file");

namespace strata::apps {
namespace {

constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

int usage_error(const std::string& message) {
  std::fprintf(stderr, "strata-train: %s\n", message.c_str());
  return kExitUsage;
}

// The PyTorch baseline a run name names, if it names one.
std::optional<TorchBaseline> baseline_named(std::string_view name) {
  for (TorchBaseline b : kTorchBaselines) {
    if (name == baseline_name(b)) return b;
  }
  return std::nullopt;
}

bool gpu_present() { return alloc::cuda_device_count() > 0 && torch::cuda::is_available(); }

// A file --json or --chart will write must be writable before training starts, not after.
std::string check_writable(const std::string& flag, const std::string& path) {
  if (path.empty()) return "";
  const std::filesystem::path p(path);
  const std::filesystem::path dir = p.has_parent_path() ? p.parent_path() : ".";
  std::error_code ec;
  if (std::filesystem::is_directory(p, ec)) return str_cat(flag, ": '", path, "' is a directory");
  if (!std::filesystem::is_directory(dir, ec)) {
    return str_cat(flag, ": the folder of '", path, "' does not exist");
  }
  const std::filesystem::path probe = std::filesystem::exists(p, ec) ? p : dir;
  if (access(probe.c_str(), W_OK) != 0)
    return str_cat(flag, ": '", probe.string(), "' is not writable");
  return "";
}

// Exit codes: a run that failed at setup because of what was asked for (a GPU budget too small for
// the policy, a bad option the runtime refused) is bad usage; anything else is a failed run.
bool usage_failure(const RunResult& r) {
  return r.failed_at_setup && (absl::StartsWith(r.error, "RESOURCE_EXHAUSTED") ||
                               absl::StartsWith(r.error, "INVALID_ARGUMENT"));
}

std::string gpu_name() {
#ifdef STRATA_HAS_CUDA
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) return prop.name;
#endif
  return "a CUDA GPU";
}

void print_run_end(const RunResult& r) {
  if (!r.ok) {
    std::printf("[%s] FAILED: %s\n", r.name.c_str(), r.error.c_str());
  } else if (r.strata) {
    std::printf("[%s] allocator, per tier, at the end of training:\n%s", r.name.c_str(),
                r.allocator_table.c_str());
    std::printf("[%s] leak report after unregistering everything: %s\n", r.name.c_str(),
                r.leak_report.c_str());
  }
  std::fflush(stdout);
}

// The training options strata-train's flags give; kInvalidArgument saying which flag is wrong.
absl::StatusOr<TrainOptions> options_from_flags() {
  TrainOptions o;
  o.model = {.vocab = absl::GetFlag(FLAGS_vocab),
             .d_model = absl::GetFlag(FLAGS_d_model),
             .heads = absl::GetFlag(FLAGS_heads),
             .layers = absl::GetFlag(FLAGS_layers),
             .seq = absl::GetFlag(FLAGS_seq),
             .batch = absl::GetFlag(FLAGS_batch)};
  o.steps = absl::GetFlag(FLAGS_steps);
  o.lr = absl::GetFlag(FLAGS_lr);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.prefetch_depth = absl::GetFlag(FLAGS_prefetch_depth);
  const GptConfig& m = o.model;
  if (o.steps < 1) return absl::InvalidArgumentError("--steps must be at least 1");
  if (m.layers < 1 || m.d_model < 1 || m.heads < 1 || m.vocab < 2 || m.seq < 1 || m.batch < 1) {
    return absl::InvalidArgumentError(
        "--layers, --d_model, --heads, --seq and --batch must be positive and "
        "--vocab at least 2");
  }
  if (const std::string dir = absl::GetFlag(FLAGS_text_dir); !dir.empty()) {
    if (m.vocab != 256)
      return absl::InvalidArgumentError("--text_dir trains on bytes: it needs --vocab=256");
    absl::StatusOr<TextCorpus> text = TextCorpus::load(dir, std::int64_t{64} << 20);
    if (!text.ok()) return absl::InvalidArgumentError(std::string(text.status().message()));
    if (text->size() <= m.seq)
      return absl::InvalidArgumentError("--text_dir: fewer bytes than one sequence");
    o.text = std::make_shared<const TextCorpus>(std::move(*text));
  }
  if (m.d_model % m.heads != 0) {
    return absl::InvalidArgumentError(
        str_cat("--heads (", m.heads, ") must divide --d_model (", m.d_model, ")"));
  }
  if (!(o.lr > 0)) return absl::InvalidArgumentError("--lr must be positive");
  if (o.prefetch_depth < 0) return absl::InvalidArgumentError("--prefetch_depth must be 0 or more");
  o.phase_switch_every = absl::GetFlag(FLAGS_phase_switch_every);
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype == "float32") {
    o.dtype = torch::kFloat;
  } else if (dtype == "bfloat16") {
    o.dtype = torch::kBFloat16;
  } else if (dtype == "float16") {
    o.dtype = torch::kHalf;
  } else {
    return absl::InvalidArgumentError(
        str_cat("--dtype must be float32, bfloat16 or float16, not '", dtype, "'"));
  }
  o.clip_grad_norm = absl::GetFlag(FLAGS_clip_grad_norm);
  if (!(o.clip_grad_norm >= 0) || std::isinf(o.clip_grad_norm)) {
    return absl::InvalidArgumentError("--clip_grad_norm must be a finite number >= 0 (0: off)");
  }
  if (o.phase_switch_every < 0)
    return absl::InvalidArgumentError("--phase_switch_every must be 0 or more");
  o.undo_on_gpu = absl::GetFlag(FLAGS_strata_undo_on_gpu);
  if (const double f = absl::GetFlag(FLAGS_strata_hybrid_fraction); f >= 0) o.hybrid_fraction = f;
  o.host_threads = absl::GetFlag(FLAGS_strata_host_threads);
  if (o.host_threads < 0) return absl::InvalidArgumentError("--strata_host_threads must be >= 0");
  if (absl::StatusOr<optim::StateType> t =
          optim::parse_state_dtype(absl::GetFlag(FLAGS_state_dtype));
      t.ok()) {
    o.state_dtype = *t;
  } else {
    return absl::InvalidArgumentError(str_cat("--state_dtype: ", t.status().message()));
  }
  if (absl::StatusOr<std::shared_ptr<const optim::StepRule>> rule =
          optim::make_step_rule(absl::GetFlag(FLAGS_optimizer));
      rule.ok()) {
    o.rule = *rule;
  } else {
    return absl::InvalidArgumentError(str_cat("--optimizer: ", rule.status().message()));
  }
  if (const std::string where = absl::GetFlag(FLAGS_strata_step_stream); where == "compute") {
    o.step_on_own_stream = false;
  } else if (where != "own") {
    return absl::InvalidArgumentError(
        str_cat("--strata_step_stream: '", where, "' is neither 'own' nor 'compute'"));
  }
  if (const std::string end = absl::GetFlag(FLAGS_step_end); end == "device") {
    o.step_end = TrainOptions::StepEnd::kDevice;
  } else if (end != "stream") {
    return absl::InvalidArgumentError(
        str_cat("--step_end: '", end, "' is neither 'stream' nor 'device'"));
  }
  o.grad_accum = absl::GetFlag(FLAGS_grad_accum);
  if (o.grad_accum < 1) return absl::InvalidArgumentError("--grad_accum must be 1 or more");

  absl::StatusOr<rt::DeviceChoice> device = rt::parse_device(absl::GetFlag(FLAGS_device));
  if (!device.ok())
    return absl::InvalidArgumentError(str_cat("--device: ", device.status().message()));
  if (device->cuda_device != rt::kCurrentCudaDevice) {
    // Its model and its runtime both take the current device (See Note [One CUDA device a
    // runtime] in runtime/runtime.h).
    return absl::InvalidArgumentError(
        "--device: strata-train runs on the current CUDA device; choose it with "
        "CUDA_VISIBLE_DEVICES and pass --device=cuda");
  }
  if (device->kind == rt::DeviceKind::kCuda && !gpu_present()) {
    return absl::InvalidArgumentError("--device=cuda, but no GPU is visible");
  }
  o.cuda = device->kind == rt::DeviceKind::kCuda ||
           (device->kind == rt::DeviceKind::kAuto && gpu_present());

  absl::StatusOr<rt::RoleSet> roles = rt::RoleSet::parse(absl::GetFlag(FLAGS_strata_roles));
  if (!roles.ok())
    return absl::InvalidArgumentError(str_cat("--strata_roles: ", roles.status().message()));
  o.roles = *roles;

  const std::string budget_flag = absl::GetFlag(FLAGS_strata_gpu_budget);
  if (!budget_flag.empty()) {
    absl::StatusOr<std::size_t> budget = parse_bytes(budget_flag);
    if (!budget.ok()) {
      return absl::InvalidArgumentError(
          str_cat("--strata_gpu_budget: ", budget.status().message()));
    }
    o.gpu_budget = *budget;
  }

  absl::StatusOr<alloc::DeviceMethod> memory =
      alloc::parse_device_method(absl::GetFlag(FLAGS_strata_gpu_memory));
  if (!memory.ok())
    return absl::InvalidArgumentError(str_cat("--strata_gpu_memory ", memory.status().message()));
  o.gpu_memory = *memory;

  absl::StatusOr<rt::Overlap> overlap = rt::parse_overlap(absl::GetFlag(FLAGS_strata_overlap));
  if (!overlap.ok())
    return absl::InvalidArgumentError(str_cat("--strata_overlap: ", overlap.status().message()));
  o.overlap = *overlap;

  return o;
}

// --runs: each a policy (with kOverlapSuffix or not) or a PyTorch baseline; empty: every one.
absl::StatusOr<std::vector<std::string>> runs_from_flag() {
  std::vector<std::string> selected_runs;
  const std::vector<std::string> known = policy::builtin_policies().names();
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_runs), ',', absl::SkipEmpty())) {
    std::string policy(name);
    if (policy.ends_with(kOverlapSuffix)) policy.resize(policy.size() - kOverlapSuffix.size());
    if (!baseline_named(std::string(name)) &&
        std::find(known.begin(), known.end(), policy) == known.end()) {
      return absl::InvalidArgumentError(str_cat(
          "--runs: unknown run '", name, "'; use policy names (with +overlap or not), ",
          baseline_name(TorchBaseline::kResident), ", ", baseline_name(TorchBaseline::kMovedWithTo),
          " or ", baseline_name(TorchBaseline::kHostStep)));
    }
    selected_runs.emplace_back(name);
  }
  return selected_runs;
}

// The policy named (checked before any model is built, so a typo costs nothing), and a budget in
// which that policy could lay out at least one layer's optimizer step.
absl::Status check_policy_and_budget(const rt::PolicyChoice& choice, const TrainOptions& o) {
  const std::vector<std::string> policies = policy::builtin_policies().names();
  if (std::find(policies.begin(), policies.end(), choice.name) == policies.end()) {
    std::string valid;
    for (const std::string& p : policies) str_append(&valid, valid.empty() ? "" : ", ", p);
    return absl::InvalidArgumentError(
        str_cat(choice.name.empty() ? std::string("empty policy name")
                                    : str_cat("unknown policy '", choice.name, "'"),
                " (from ", choice.source, "); valid policies: ", valid));
  }

  // A budget below one layer's step working set could train under no policy.
  const std::vector<std::int64_t> layer_bytes = layer_step_bytes(o);
  const auto largest = std::max_element(layer_bytes.begin(), layer_bytes.end());
  if (static_cast<std::size_t>(*largest) > o.gpu_budget) {
    return absl::InvalidArgumentError(str_cat(
        "the GPU budget of ", format_bytes(o.gpu_budget), " is too small for one layer: layer ",
        largest - layer_bytes.begin(), " needs ", format_bytes(*largest),
        " on the GPU for its optimizer step (parameters, gradients and two Adam moments)"));
  }
  return absl::OkStatus();
}

// What is about to run: the device, the model, its dtype and clipping, strata's budget and roles,
// the step's overlap and where a step's time ends.
void print_setup(const Report& report, const rt::PolicyChoice& choice) {
  const TrainOptions& o = report.options;
  const GptConfig& m = o.model;
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  const std::int64_t params = parameter_bytes(m);
  std::printf("strata-train on %s\n", report.device.c_str());
  std::printf(
      "model: %lld blocks, d_model %lld, %lld heads, vocab %lld, %lld x %lld tokens/step; "
      "%.2f M parameters (%s), Adam states %s\n",
      static_cast<long long>(m.layers), static_cast<long long>(m.d_model),
      static_cast<long long>(m.heads), static_cast<long long>(m.vocab),
      static_cast<long long>(m.batch), static_cast<long long>(m.seq), params / 4 / 1e6,
      format_bytes(params).c_str(), format_bytes(2 * params).c_str());
  // keep_on_gpu moves nothing, whatever the roles say.
  const bool moves = report.compare || choice.name != "keep_on_gpu";
  std::printf("dtype: %s%s; gradient clipping: %s\n", dtype.c_str(),
              o.dtype == torch::kFloat ? "" : " parameters and gradients, float32 master weights",
              o.clip_grad_norm > 0 ? str_cat("global norm ", o.clip_grad_norm).c_str() : "off");
  std::printf(
      "strata GPU budget: %s (GPU memory method: %s); moved or streamed: %s\n",
      o.gpu_budget == static_cast<std::size_t>(-1) ? "none" : format_bytes(o.gpu_budget).c_str(),
      std::string(alloc::device_method_name(o.gpu_memory)).c_str(),
      moves ? str_cat(o.roles.to_string(), report.compare ? " (keep_on_gpu moves nothing)" : "")
                  .c_str()
            : "nothing (keep_on_gpu keeps everything on the GPU)");
  if (o.overlap == rt::Overlap::kBackward || o.grad_accum > 1) {
    std::printf("optimizer step: %s; %d micro-batch(es) a step\n",
                o.overlap == rt::Overlap::kBackward
                    ? str_cat("each layer during backward (--strata_overlap=backward), on ",
                              o.step_on_own_stream ? "a stream of its own" : "the compute stream",
                              o.undo_on_gpu ? ", undo copies on the GPU" : "")
                          .c_str()
                    : "after backward",
                o.grad_accum);
  }
  if (o.cuda) {
    std::printf("a step's time ends %s\n",
                o.step_end == TrainOptions::StepEnd::kStream
                    ? "when its compute stream is done; copies still running go on into the next "
                      "step (--step_end=stream)"
                    : "when every stream is done (--step_end=device)");
  }
  std::fflush(stdout);
}

// The runs of --compare: every policy (twice with --strata_overlap=backward, without and with the
// step overlapped, so that the comparison covers both), then PyTorch's resident and .to()
// baselines (its host step, seconds a step, runs only where --runs names it); or --runs.
std::vector<std::string> compare_run_names(const TrainOptions& o,
                                           const std::vector<std::string>& selected) {
  if (!selected.empty()) {
    if (o.overlap == rt::Overlap::kBackward) {
      std::printf(
          "(--strata_overlap=backward adds the +overlap runs to --compare's own list; "
          "with --runs each run steps as its name says: overlapped where it ends in %s)\n",
          std::string(kOverlapSuffix).c_str());
    }
    return selected;
  }
  std::vector<std::string> runs;
  for (const std::string& p : policy::builtin_policies().names()) {
    if (p == "hybrid" && !(o.roles == rt::RoleSet::optimizer_states())) {
      std::printf("(hybrid left out: it moves optimizer states only, and --strata_roles=%s)\n",
                  o.roles.to_string().c_str());
      continue;
    }
    runs.push_back(p);
    if (o.overlap == rt::Overlap::kBackward && p != "keep_on_gpu") {
      runs.push_back(str_cat(p, kOverlapSuffix));
    }
  }
  if (o.rule->name() != "adam") {
    std::printf("(PyTorch's baselines left out: they step AdamW, and --optimizer=%s)\n",
                std::string(o.rule->name()).c_str());
    return runs;
  }
  for (TorchBaseline b : {TorchBaseline::kResident, TorchBaseline::kMovedWithTo}) {
    runs.push_back(baseline_name(b));
  }
  return runs;
}

// 0: every run trained and left no leak (and, comparing, every loss agreed); kExitUsage: a single
// run failed at setup because of what was asked for; kExitFailed otherwise.
int exit_code(const Report& report) {
  bool ok = true;
  for (const RunResult& r : report.runs) {
    if (r.strata && r.ok && !r.leak_free) ok = false;
  }
  if (report.compare) {
    ok = ok && report.comparison.losses_identical;
  } else if (!report.runs.front().ok) {
    return usage_failure(report.runs.front()) ? kExitUsage : kExitFailed;
  }
  return ok ? 0 : kExitFailed;
}

int run(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "trains a GPT-style decoder under a strata residency policy; see apps/train/main.cpp");
  // --help lists the flags of the file named like the program by default; strata-train's live in
  // this file (main.cpp).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "apps/train/");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) return usage_error(str_cat("unexpected argument '", rest[1], "'"));

  // Every policy must see the same numbers: deterministic kernels where torch has a choice, and a
  // fixed cuBLAS workspace (read when cuBLAS starts, so before any GPU work).
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);

  absl::StatusOr<TrainOptions> options = options_from_flags();
  if (!options.ok()) return usage_error(std::string(options.status().message()));
  const TrainOptions& o = *options;
  if (o.text != nullptr) {
    std::printf("text: %lld bytes of %d files in %s\n", static_cast<long long>(o.text->size()),
                o.text->files(), absl::GetFlag(FLAGS_text_dir).c_str());
  }
  absl::StatusOr<std::vector<std::string>> selected_runs = runs_from_flag();
  if (!selected_runs.ok()) return usage_error(std::string(selected_runs.status().message()));
  for (const std::string& run : *selected_runs) {
    if (baseline_named(run) && o.rule->name() != "adam") {
      return usage_error(str_cat("--runs: ", run, " is PyTorch's AdamW; with --optimizer=",
                                 o.rule->name(), " leave PyTorch's baselines out"));
    }
  }
  for (const auto& [flag, path] : {std::pair{"--json", absl::GetFlag(FLAGS_json)},
                                   std::pair{"--chart", absl::GetFlag(FLAGS_chart)}}) {
    if (std::string bad = check_writable(flag, path); !bad.empty()) return usage_error(bad);
  }

  const rt::PolicyChoice choice =
      rt::choose_policy_name(absl::GetFlag(FLAGS_strata_policy).name, "--strata_policy");
  if (absl::Status s = check_policy_and_budget(choice, o); !s.ok()) {
    return usage_error(std::string(s.message()));
  }

  Report report;
  report.options = o;
  report.compare = absl::GetFlag(FLAGS_compare);
  report.device = o.cuda ? gpu_name() : "simulated device (model on the CPU)";
  print_setup(report, choice);

  const StepCallback progress = [&](const RunResult& run, const StepRecord& step) {
    std::printf("%s\n", progress_line(run, step, o.steps).c_str());
    if (!run.phase_switches.empty() && run.phase_switches.back().after_step == step.step) {
      std::printf("%s\n", phase_switch_line(run, run.phase_switches.back()).c_str());
    }
    std::fflush(stdout);
  };
  if (report.compare) {
    TrainOptions plain = o;
    plain.overlap = rt::Overlap::kNone;
    for (const std::string& p : compare_run_names(o, *selected_runs)) {
      if (const std::optional<TorchBaseline> b = baseline_named(p)) {
        std::printf("\n== PyTorch, %s\n", p.c_str());
        report.runs.push_back(run_torch(o, *b, progress));
      } else {
        std::printf("\n== strata, policy %s\n", p.c_str());
        report.runs.push_back(run_strata(plain, p, progress));
      }
      print_run_end(report.runs.back());
    }
  } else {
    if (o.hybrid_fraction && choice.name != "hybrid") {
      return usage_error(
          str_cat("--strata_hybrid_fraction places optimizer steps; only "
                  "--strata_policy=hybrid does that, not ",
                  choice.name));
    }
    std::printf("policy: %s (from %s)\n\n", choice.name.c_str(), choice.source.c_str());
    report.runs.push_back(run_strata(
        o, o.overlap == rt::Overlap::kBackward ? str_cat(choice.name, kOverlapSuffix) : choice.name,
        progress));
    print_run_end(report.runs.back());
  }
  report.comparison = compare_runs(report.runs);

  std::printf("\nsummary\n%s", summary_table(report).c_str());
  for (const auto& [flag, text] : {std::pair{absl::GetFlag(FLAGS_json), to_json(report)},
                                   std::pair{absl::GetFlag(FLAGS_chart), to_svg(report)}}) {
    if (flag.empty()) continue;
    if (absl::Status s = write_file(flag, text); !s.ok()) {
      std::fprintf(stderr, "strata-train: %s\n", std::string(s.message()).c_str());
      return kExitFailed;
    }
    std::printf("wrote %s\n", flag.c_str());
  }
  return exit_code(report);
}

}  // namespace
}  // namespace strata::apps

int main(int argc, char** argv) { return strata::apps::run(argc, argv); }
