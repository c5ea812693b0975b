#include "apps/train/train.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <fstream>
#include <memory>
#include <optional>

#include "apps/train/phase_switch.h"
#include "apps/train/pinned_states.h"
#include "apps/train/torch_adamw.h"
#include "apps/train/torch_device.h"
#include "base/host_memory.h"
#include "bridge/grad_stats.h"
#include "bridge/model_hooks.h"
#include "bridge/scalar_reader.h"
#include "bridge/status.h"
#include "bridge/torch_runtime.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "runtime/copy_trace.h"
#include "runtime/runtime.h"
#include "runtime/setup.h"

#ifdef STRATA_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace strata::apps {
namespace {

// torch's own GPU memory (activations, temporaries; everything for a PyTorch run).
void reset_torch_peak(const TrainOptions& o) {
  init_torch_cuda(o);
#ifdef STRATA_HAS_CUDA
  if (o.cuda) c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
}
std::int64_t torch_peak_bytes(const TrainOptions& o) {
#ifdef STRATA_HAS_CUDA
  if (o.cuda) {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(0)
        .reserved_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
        .peak;
  }
#endif
  return 0;
}

// The same model, from the same seed (drawn in float32, then converted), on the run's device.
Gpt make_model(const TrainOptions& o) {
  torch::manual_seed(o.seed);
  Gpt model(o.model);
  model->to(device_of(o), o.dtype);
  return model;
}

// torch.amp.GradScaler's dynamic loss scale, kept on the device with its growth tracker (float16
// runs; a scale of 1 that never changes otherwise).
struct LossScaler {
  bool enabled;
  torch::Tensor scale;   // float32 scalar
  torch::Tensor growth;  // int32 scalar
  explicit LossScaler(const TrainOptions& o) : enabled(o.dtype == torch::kHalf) {
    const auto on = torch::TensorOptions().device(device_of(o));
    scale = torch::full({}, enabled ? kInitialLossScale : 1.0, on.dtype(torch::kFloat));
    growth = torch::zeros({}, on.dtype(torch::kInt));
  }
  torch::Tensor scaled(const torch::Tensor& loss) const { return enabled ? loss * scale : loss; }
  // Backs off after a step whose gradients overflowed, grows after a run of clean ones.
  void update(const torch::Tensor& found_inf) {
    if (enabled) {
      at::_amp_update_scale_(scale, growth, found_inf, 2.0, 0.5, kLossScaleGrowthInterval);
    }
  }
};

struct Batch {
  torch::Tensor inputs, targets;
};
// Micro-batch `micro` of `step` (1-based; one per step without accumulation: micro 0).
Batch batch_for(const TrainOptions& o, int step, int micro = 0) {
  const int index = (step - 1) * o.grad_accum + micro + 1;
  torch::Tensor tokens = (o.text != nullptr ? o.text->batch(o.model, o.seed, index)
                                            : synthetic_batch(o.model, o.seed, index))
                             .to(device_of(o));
  return {tokens.slice(1, 0, -1), tokens.slice(1, 1)};
}

// In float32 whatever the model's dtype, as mixed-precision training computes its loss.
torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}).to(torch::kFloat), targets.reshape({-1}));
}

// Note [PyTorch's step, no host wait]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The baselines step as a PyTorch user's loop does, with nothing read on the host before the step's
// end: torch.nn.utils.clip_grad_norm_ as Python runs it on CUDA (foreach norms, their norm, the
// coefficient clamped to 1 and multiplied in on the GPU; the C++ API's version reads the norm on
// the host and takes one kernel per tensor), and under loss scaling GradScaler's found_inf handed
// to the fused kernel, which then changes nothing (GradScaler.step does not read it for an
// optimizer that supports it). The norm, the loss scale and found_inf are read with the loss, after
// the step's time.
torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& grads, double max_norm) {
  const std::vector<torch::Tensor> norms = at::_foreach_norm(grads, 2.0);
  const torch::Tensor total = at::linalg_vector_norm(at::stack(norms), 2.0);
  const torch::Tensor coef = at::clamp(max_norm / (total + 1e-6), std::nullopt, 1.0);
  at::_foreach_mul_(grads, coef);
  return total;
}

std::string message_of(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

// The traced step's copies and marks as CSV: kind (h2d or d2h for the link's copy streams, other
// for copies on any other stream, such as the undo copies an overlapped step keeps on the GPU, or
// mark), bytes (a mark's label), start and end in ms from the step's start.
void write_trace(rt::CopyTracer& tracer, rt::Runtime& runtime, const std::string& path) {
  const std::vector<rt::CopySpan> spans = bridge::unwrap(tracer.finish());
  std::ofstream csv(path);
  csv << "kind,bytes_or_label,start_ms,end_ms\n";
  for (const rt::CopySpan& c : spans) {
    const char* kind = c.stream == runtime.h2d_stream()   ? "h2d"
                       : c.stream == runtime.d2h_stream() ? "d2h"
                                                          : "other";
    csv << kind << ',' << c.bytes << ',' << c.start_ms << ',' << c.end_ms << '\n';
  }
  for (const auto& [label, at] : tracer.marks()) {
    csv << "mark," << label << ',' << at << ',' << at << '\n';
  }
  if (!csv) bridge::check(absl::InternalError(str_cat("writing the trace ", path, " failed")));
  std::printf("wrote the copy trace %s (%zu copies)\n", path.c_str(), spans.size());
}

// The run's runtime, from the options (runtime/setup.h); `tracer` is set when `trace_dir` asks for
// a copy trace on the GPU.
std::unique_ptr<rt::Runtime> make_runtime(const TrainOptions& o, const std::string& policy,
                                          rt::Overlap overlap, const std::string& trace_dir,
                                          rt::CopyTracer*& tracer) {
  rt::ProgramSetup setup;
  setup.policy = policy;
  setup.device = o.cuda ? rt::DeviceKind::kCuda : rt::DeviceKind::kSimulated;
  setup.prefetch_depth = o.prefetch_depth;
  setup.roles = o.roles;
  setup.overlap = overlap;
  setup.undo_on_gpu = o.undo_on_gpu;
  if (policy == "hybrid") setup.hybrid_fraction = o.hybrid_fraction;
  setup.gpu_budget = o.gpu_budget;
  setup.gpu_memory = o.gpu_memory;
  rt::RuntimeOptions ro = rt::runtime_options(setup);
  // STRATA_TRACE_DIR: the last step's copies, and where each layer's backward ended, go to
  // DIR/<run>.csv (runtime/copy_trace.h), for a plot of the link against backward's layers.
  if (!trace_dir.empty() && o.cuda) {
    auto traced =
        std::make_unique<rt::CopyTracer>(bridge::unwrap(rt::make_device(rt::DeviceKind::kCuda)));
    tracer = traced.get();
    ro.device_override = std::move(traced);
  }
  return bridge::unwrap(rt::Runtime::create(std::move(ro), policy::builtin_policies()));
}

// AdamW over the bound model: weight decay for the matrices only (GptImpl::decays), states in the
// options' dtype. Prints the step placement when the policy places steps.
std::unique_ptr<optim::Adam> make_adam(rt::Runtime& rt, bridge::TorchBinding& binding,
                                       GptImpl& model, const TrainOptions& o,
                                       const std::string& run_name) {
  optim::AdamOptions ao;
  ao.state_dtype = o.state_dtype;
  ao.groups.resize(2);
  ao.groups[0].hyper = {.lr = o.lr, .weight_decay = o.weight_decay, .decoupled = true};
  ao.groups[1].hyper = {.lr = o.lr, .weight_decay = 0.0, .decoupled = true};
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    const std::size_t g = GptImpl::decays(p.key()) ? 0 : 1;
    ao.groups[g].params.push_back({binding.handle(p.value()), binding.handle(p.value().grad())});
  }
  // Adam registers its states and lets the policy lay everything out under the GPU budget: a
  // budget too small fails here, at setup.
  std::unique_ptr<optim::Adam> adam = bridge::unwrap(optim::Adam::create(rt, std::move(ao)));
  if (!adam->placement().empty()) {
    std::printf("[%s] %s\n", run_name.c_str(), adam->placement().c_str());
  }
  return adam;
}

// Each layer's gradients, in the model's layer grouping.
std::vector<std::vector<torch::Tensor>> layer_gradients(GptImpl& model) {
  std::vector<std::vector<torch::Tensor>> out(model.num_layers());
  const auto params = model.named_parameters(/*recurse=*/true);
  const std::vector<std::vector<std::string>> grouping = model.layer_grouping();
  for (std::size_t layer = 0; layer < grouping.size(); ++layer) {
    for (const std::string& name : grouping[layer]) out[layer].push_back(params[name].grad());
  }
  return out;
}

// The strata run proper; throws (c10::Error) on failure, which run_strata records. Its step loop
// is kept whole, longer than a screen: a step's order (hooks, forward and backward per micro-batch,
// clipping's scale, the optimizer, the clocks, the reads) is the thing to check, and reads top to
// bottom here.
void train_strata(const TrainOptions& o, const std::string& run_name, const StepCallback& on_step,
                  RunResult& result, bool& started) {
  std::string policy = run_name;
  rt::Overlap overlap = o.overlap;
  if (policy.ends_with(kOverlapSuffix)) {
    policy.resize(policy.size() - kOverlapSuffix.size());
    overlap = rt::Overlap::kBackward;
  }
  const bool overlapped = overlap == rt::Overlap::kBackward;
  const char* trace_env = std::getenv("STRATA_TRACE_DIR");
  const std::string trace_dir = trace_env != nullptr ? trace_env : "";
  rt::CopyTracer* tracer = nullptr;
  std::unique_ptr<rt::Runtime> runtime = make_runtime(o, policy, overlap, trace_dir, tracer);
  rt::Runtime& rt = *runtime;

  release_torch_cache(o);
  reset_torch_peak(o);
  Gpt model = make_model(o);
  std::unique_ptr<optim::Adam> adam;
  {
    bridge::TorchBinding binding(rt);
    // The parameters live in strata's GPU tier (on the simulated device too, where the model's
    // CPU tensors address it directly); the gradients exist from the start so autograd
    // accumulates into the bound memory.
    binding.register_module(*model, model->layer_grouping(), rt::Tier::kGpu);
    for (torch::Tensor& p : model->parameters()) p.mutable_grad() = torch::zeros_like(p);
    binding.register_gradients(*model, rt::Tier::kGpu);

    adam = make_adam(rt, binding, *model, o, run_name);
    result.placement = adam->placement();
    result.host_layers = adam->host_layers();
    result.host_threads = adam->host_threads();
    result.step_rates = adam->step_rates();
    result.setup_gpu_bytes = rt.stats().gpu_reserved_peak_bytes;
    for (rt::TensorHandle h : rt.tensors()) {
      rt::TensorInfo info = bridge::unwrap(rt.info(h));
      if (info.spec.state == "exp_avg" || info.spec.state == "exp_avg_sq") {
        result.state_bytes += static_cast<std::int64_t>(info.bytes);
      }
    }

    // Each layer's gradients are zeroed just before its backward, and clipping and the float16
    // overflow check take each layer's part as its backward finishes, before the policy sends its
    // gradients away (bridge/model_hooks.h; See Note [Zeroing streamed gradients] in
    // bridge/model_hooks.cpp).
    bridge::ModelHooks hooks(rt, /*zero_before_backward=*/true);
    hooks.set_layer_gradients(layer_gradients(*model));
    LossScaler scaler(o);
    // Only loss scaling reads found_inf (See Note [Opt-in inf check] in bridge/grad_stats.h).
    hooks.stats().set_check_non_finite(scaler.enabled);
    torch::Tensor grad_scale, found_inf;  // alive until the step that reads them has run
    // Each layer steps as its backward ends, dividing by the loss scale alone; finish_step
    // validates against the true grad_scale and found_inf (See Note [Overlapped step] in
    // optim/adam.h).
    // The trace marks where backward is: on the stream it computes on, whichever the step uses.
    const rt::StreamHandle compute_stream = rt.compute_stream();
    hooks.set_after_layer(
        [&](int layer) {
          if (tracer != nullptr) {
            bridge::check(tracer->mark(compute_stream, str_cat("backward ", layer)));
          }
          if (!overlapped) return;
          bridge::check(
              adam->step_layer(layer, scaler.enabled ? scaler.scale.data_ptr<float>() : nullptr));
        },
        o.step_on_own_stream ? bridge::ModelHooks::AfterLayerStream::kOwnStream
                             : bridge::ModelHooks::AfterLayerStream::kComputeStream);
    started = true;
    StepClock clock(o, [&] {
      if (o.cuda) bridge::check(rt.device().stream_synchronize(rt.compute_stream()));
    });
    bridge::ScalarReader reader;
    for (int step = 1; step <= o.steps; ++step) {
      rt.allocator().reset_peak_stats();
      reset_torch_peak(o);
      const bool traced = tracer != nullptr && step == o.steps;
      // The traced step's time includes the wait for the copies the step before left running:
      // here on the host, so that the trace holds this step's copies alone.
      const Clock::time_point start = clock.start();
      if (traced) {
        synchronize(o);
        bridge::check(tracer->start(rt.compute_stream()));
      }
      const rt::RuntimeStats before = rt.stats();
      const optim::Adam::HostStepBytes host_before = adam->host_step_bytes();

      // Gradient accumulation: each micro-batch's loss is divided by their number, as the mean
      // over the whole batch; the last micro-batch's hooks take the statistics (and overlap).
      torch::Tensor loss = torch::zeros({}, torch::TensorOptions().device(device_of(o)));
      for (int micro = 0; micro < o.grad_accum; ++micro) {
        const Batch batch = batch_for(o, step, micro);
        const bool last = micro + 1 == o.grad_accum;
        hooks.begin_step({.first = micro == 0, .last = last});
        // Each layer's after_backward runs as soon as its backward is done, so that a policy
        // streaming parameters and gradients can send them out and bring the next layer in while
        // backward goes on; the embeddings' (layer 0) runs once backward returns.
        torch::Tensor logits = model->forward(
            batch.inputs, [&](int layer) { hooks.before_forward(layer); },
            [&](int layer) { hooks.after_backward(layer); });
        torch::Tensor micro_loss = loss_of(logits, batch.targets) / o.grad_accum;
        hooks.begin_backward();
        scaler.scaled(micro_loss).backward();
        hooks.finish_backward();
        loss = loss + micro_loss.detach();
        if (!last) hooks.end_step();
      }
      bridge::GradientStats& stats = hooks.stats();
      const torch::Tensor loss_scale = scaler.enabled ? scaler.scale : torch::Tensor();
      grad_scale = o.clip_grad_norm > 0 || scaler.enabled
                       ? stats.grad_scale(loss_scale, o.clip_grad_norm).clone()
                       : torch::Tensor();
      found_inf = scaler.enabled ? stats.found_inf() : torch::Tensor();
      const torch::Tensor grad_norm = stats.total_norm(loss_scale);
      const torch::Tensor step_scale = scaler.scale.clone();
      clock.wait();
      const Clock::time_point optimizer_start = Clock::now();
      const optim::Adam::StepOutcome outcome = bridge::unwrap(
          adam->finish_step(grad_scale.defined() ? grad_scale.data_ptr<float>() : nullptr,
                            found_inf.defined() ? found_inf.data_ptr<float>() : nullptr));
      clock.wait();
      if (found_inf.defined()) scaler.update(found_inf);
      const double optimizer_ms = ms_since(optimizer_start);
      hooks.end_step();
      clock.wait();
      const double step_ms = clock.end(start);
      const std::vector<double> read = reader.read({loss, grad_norm, step_scale, found_inf});
      bridge::check(rt.poll());
      if (traced) {
        // The trace covers the step's copies to the last: the step is the run's last, so the
        // wait for them is the run's drain.
        result.drain_ms += clock.drain([&] { bridge::check(rt.wait_all()); });
        std::string file = run_name;  // "layer_prefetch+overlap" -> "layer_prefetch-overlap.csv"
        std::replace(file.begin(), file.end(), '+', '-');
        write_trace(*tracer, rt, str_cat(trace_dir, "/", file, ".csv"));
      }

      const rt::RuntimeStats after = rt.stats();
      StepRecord r;
      r.step = step;
      r.loss = static_cast<float>(read[0]);
      r.step_ms = step_ms;
      r.optimizer_ms = optimizer_ms;
      r.grad_norm = static_cast<float>(read[1]);
      r.loss_scale = static_cast<float>(read[2]);
      r.skipped = found_inf.defined() && read[3] != 0.0;
      r.redone = outcome == optim::Adam::StepOutcome::kRedone;
      // The runtime's migrations and the host-stepped layers' copies (See Note [Host-stepped
      // layers] in optim/adam_host_step.cpp).
      const optim::Adam::HostStepBytes host_after = adam->host_step_bytes();
      r.h2d_bytes =
          after.migrated_bytes_h2d - before.migrated_bytes_h2d + host_after.h2d - host_before.h2d;
      r.d2h_bytes =
          after.migrated_bytes_d2h - before.migrated_bytes_d2h + host_after.d2h - host_before.d2h;
      const double h2d_ms = after.h2d_busy_ms - before.h2d_busy_ms;
      const double d2h_ms = after.d2h_busy_ms - before.d2h_busy_ms;
      if (h2d_ms > 0) r.h2d_gbps = (after.timed_bytes_h2d - before.timed_bytes_h2d) / h2d_ms / 1e6;
      if (d2h_ms > 0) r.d2h_gbps = (after.timed_bytes_d2h - before.timed_bytes_d2h) / d2h_ms / 1e6;
      r.waited_ms = (after.prefetch_stall_ns - before.prefetch_stall_ns) / 1e6;
      r.strata_gpu_bytes = after.gpu_reserved_peak_bytes;
      r.peak_gpu_bytes = r.strata_gpu_bytes + torch_peak_bytes(o);
      for (rt::Tier tier : alloc::kAllTiers) {
        r.fragmentation[alloc::tier_index(tier)] = rt.allocator().stats(tier).fragmentation;
      }
      r.host_rss_bytes = resident_bytes();
      result.pinned_reserved_peak_bytes =
          std::max(result.pinned_reserved_peak_bytes,
                   rt.allocator().stats(rt::Tier::kPinnedHost).reserved_bytes.peak);
      result.steps.push_back(r);
      if (o.phase_switch_every > 0 && step % o.phase_switch_every == 0) {
        const PhaseSwitchOps ops{
            .offload = [&] { bridge::check(rt.offload_all()); },
            .reload = [&] { bridge::check(rt.reload_all()); },
            .gpu_bytes = [&] { return rt.stats().gpu_reserved_bytes; },
            .moved_bytes =
                [&] {
                  const rt::RuntimeStats s = rt.stats();
                  return std::pair{s.migrated_bytes_h2d, s.migrated_bytes_d2h};
                },
            .pinned_allocations =
                [&] { return rt.allocator().stats(rt::Tier::kPinnedHost).num_segment_allocs; },
            .gpu_upstream_ns =
                [&] {
                  const rt::RuntimeStats s = rt.stats();
                  return std::pair{s.gpu_upstream_alloc_ns, s.gpu_upstream_free_ns};
                }};
        result.phase_switches.push_back(phase_switch(o, step, ops));
        clock.synchronized();
      }
      if (on_step) on_step(result, r);
    }

    result.drain_ms += clock.drain([&] { bridge::check(rt.wait_all()); });
    const rt::RuntimeStats end = rt.stats();
    result.host_syncs = end.host_syncs;
    result.staged_peak_bytes = end.staged_peak_bytes;
    result.staging_bytes = end.staging_bytes;
    result.undo_peak_bytes = end.undo_peak_bytes;
    result.allocator_table = rt.allocator().format_stats();
    result.allocator_json = rt.allocator().stats_json();

    // Tear down in order: the optimizer (which unregisters its states), then the bound gradients
    // and parameters; what the allocator still holds after that is a leak.
    adam.reset();
    for (torch::Tensor& p : model->parameters()) {
      binding.unregister(p.mutable_grad());
      binding.unregister(p);
    }
  }
  result.leak_free = rt.allocator().leak_report().empty();
  result.leak_report = rt.allocator().format_leak_report();
  result.ok = true;
}

// A PyTorch trainer's phase switch at its best: parameters, gradients and (when resident) Adam
// states to host memory with non_blocking copies (torch pins the destinations and caches them),
// torch's cache emptied; back the same way. set_data keeps each parameter's identity, under
// which the optimizer keeps its state.
PhaseSwitchOps torch_phase_switch(const TrainOptions& o, Gpt& model,
                                  std::vector<torch::Tensor>& masters, TorchFusedAdamW& optimizer,
                                  bool states_resident,
                                  std::pair<std::int64_t, std::int64_t>& moved) {
  auto move_all = [&o, &model, &masters, &optimizer, states_resident, &moved](bool to_host) {
    const torch::Device to = to_host ? torch::Device(torch::kCPU) : device_of(o);
    std::int64_t& counter = to_host ? moved.second : moved.first;
    auto move = [&](const torch::Tensor& t) {
      if (o.cuda) counter += static_cast<std::int64_t>(t.nbytes());
      return t.to(to, /*non_blocking=*/true);
    };
    for (torch::Tensor& p : model->parameters()) {
      p.set_data(move(p.data()));
      if (p.grad().defined()) p.mutable_grad() = move(p.grad());
    }
    for (torch::Tensor& m : masters) {
      m.set_data(move(m.data()));
      if (m.grad().defined()) m.mutable_grad() = move(m.grad());
    }
    if (states_resident) {
      for (torch::Tensor* t : optimizer.states()) *t = move(*t);
    }
    synchronize(o);
    if (to_host) release_torch_cache(o);
  };
  return PhaseSwitchOps{.offload = [move_all] { move_all(true); },
                        .reload = [move_all] { move_all(false); },
                        .gpu_bytes =
                            [&o] {
#ifdef STRATA_HAS_CUDA
                              if (o.cuda) {
                                return c10::cuda::CUDACachingAllocator::getDeviceStats(0)
                                    .allocated_bytes[static_cast<std::size_t>(
                                        c10::CachingAllocator::StatType::AGGREGATE)]
                                    .current;
                              }
#endif
                              return std::int64_t{0};
                            },
                        .moved_bytes = [&moved] { return moved; }};
}

void train_torch(const TrainOptions& o, TorchBaseline which, const StepCallback& on_step,
                 RunResult& result) {
  release_torch_cache(o);
  reset_torch_peak(o);
  Gpt model = make_model(o);
  // Mixed precision as PyTorch users train: the optimizer steps float32 master weights, and the
  // model's bfloat16 / float16 parameters are copied from them (rounded to nearest even) after
  // each step. In float32 the masters are the parameters themselves.
  const bool low = o.dtype != torch::kFloat;
  std::vector<torch::Tensor> params, masters, decay, no_decay;
  for (const auto& p : model->named_parameters(/*recurse=*/true)) {
    params.push_back(p.value());
    masters.push_back(low ? p.value().detach().to(torch::kFloat).clone() : p.value());
    (GptImpl::decays(p.key()) ? decay : no_decay).push_back(masters.back());
  }
  std::vector<torch::Tensor> low_masters = low ? masters : std::vector<torch::Tensor>();
  LossScaler scaler(o);
  // torch.optim.AdamW(fused=True)'s kernel, the best PyTorch offers for this step.
  TorchFusedAdamW optimizer({{decay, o.lr, o.weight_decay}, {no_decay, o.lr, 0.0}});
  PinnedStates pinned;  // the .to() baseline's states between steps
  const torch::Device device = device_of(o);
  std::pair<std::int64_t, std::int64_t> moved;  // by phase switches: host -> GPU, GPU -> host

  StepClock clock(o, nullptr);
  bridge::ScalarReader reader;
  for (int step = 1; step <= o.steps; ++step) {
    reset_torch_peak(o);
    const Clock::time_point start = clock.start();
    model->zero_grad();
    torch::Tensor loss = torch::zeros({}, torch::TensorOptions().device(device));
    for (int micro = 0; micro < o.grad_accum; ++micro) {
      const Batch batch = batch_for(o, step, micro);
      torch::Tensor micro_loss =
          loss_of(model->forward(batch.inputs, [](int) {}), batch.targets) / o.grad_accum;
      scaler.scaled(micro_loss).backward();
      loss = loss + micro_loss.detach();
    }
    clock.wait();
    const Clock::time_point optimizer_start = Clock::now();
    StepRecord r;
    std::vector<torch::Tensor> grads;
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (low) masters[i].mutable_grad() = params[i].grad().to(torch::kFloat);
      grads.push_back(masters[i].grad());
    }
    // The step as PyTorch users run it, with no host wait
    // (See Note [PyTorch's step, no host wait]).
    const torch::Tensor step_scale = scaler.scale.clone();
    torch::Tensor found_inf = torch::zeros({}, scaler.scale.options());
    if (scaler.enabled) {
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, scaler.scale.reciprocal());
    }
    const torch::Tensor grad_norm =
        o.clip_grad_norm > 0 ? clip_grad_norm(grads, o.clip_grad_norm) : torch::Tensor();
    if (which == TorchBaseline::kMovedWithTo) pinned.to_gpu(optimizer.states(), device);
    optimizer.step(scaler.enabled ? found_inf : torch::Tensor());
    if (which == TorchBaseline::kMovedWithTo) pinned.to_host(optimizer.states());
    if (low) {
      // A skipped step left the masters as they were: the parameters are rewritten unchanged.
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < params.size(); ++i) params[i].copy_(masters[i]);
    }
    scaler.update(found_inf);
    clock.wait();
    const double optimizer_ms = ms_since(optimizer_start);
    r.step = step;
    r.step_ms = clock.end(start);
    const std::vector<double> read = reader.read({loss, grad_norm, step_scale, found_inf});
    r.loss = static_cast<float>(read[0]);
    r.skipped = read[3] != 0.0;
    // As before this step read its values on the host: a skipped step reports no norm.
    r.grad_norm = grad_norm.defined() && !r.skipped ? static_cast<float>(read[1]) : 0.0f;
    r.loss_scale = static_cast<float>(read[2]);
    r.optimizer_ms = optimizer_ms;
    if (which == TorchBaseline::kMovedWithTo && o.cuda) {
      // The states' bytes, each way (the first step only moves them out).
      const std::int64_t bytes = optimizer.moment_bytes();
      r.h2d_bytes = step > 1 ? bytes : 0;
      r.d2h_bytes = bytes;
    }
    r.peak_gpu_bytes = torch_peak_bytes(o);
    r.host_rss_bytes = resident_bytes();
    result.steps.push_back(r);
    if (o.phase_switch_every > 0 && step % o.phase_switch_every == 0) {
      const bool states_resident = which == TorchBaseline::kResident;
      result.phase_switches.push_back(phase_switch(
          o, step, torch_phase_switch(o, model, low_masters, optimizer, states_resident, moved)));
      clock.synchronized();
    }
    if (on_step) on_step(result, r);
  }
  result.drain_ms = clock.drain(nullptr);
  result.ok = true;
}

}  // namespace

std::vector<std::int64_t> layer_step_bytes(const TrainOptions& options) {
  std::vector<std::int64_t> out = layer_parameter_counts(options.model);
  // float32: parameter, gradient and two moments; bfloat16 / float16: parameter and gradient of 2
  // bytes, master and two moments of 4. Sixteen bytes either way.
  for (std::int64_t& n : out) n *= 16;
  return out;
}

RunResult run_strata(const TrainOptions& options, const std::string& policy,
                     const StepCallback& on_step) {
  RunResult result;
  result.name = policy;
  result.strata = true;
  bool started = false;
  const bool fresh_peak = reset_peak_resident();
  result.host_rss_at_start_bytes = resident_bytes();
  try {
    train_strata(options, policy, on_step, result, started);
  } catch (const std::exception& e) {
    result.ok = false;
    result.failed_at_setup = !started;
    result.error = message_of(e);
    // Parameters and gradients that stay on the GPU can be what does not fit.
    if (policy != "keep_on_gpu" && !options.roles.contains(rt::Role::kParameter) &&
        result.error.find("out of memory in tier gpu") != std::string::npos) {
      result.error +=
          " (the parameters and gradients stay on the GPU; --strata_roles=all "
          "streams them too)";
    }
  }
  result.peak_host_rss_bytes = fresh_peak ? peak_resident_bytes() : -1;
  release_torch_cache(options);
  return result;
}

std::string baseline_name(TorchBaseline which) {
  return which == TorchBaseline::kResident ? "torch_adamw_resident" : "torch_adamw_to";
}

RunResult run_torch(const TrainOptions& options, TorchBaseline which, const StepCallback& on_step) {
  RunResult result;
  result.name = baseline_name(which);
  result.strata = false;
  const bool fresh_peak = reset_peak_resident();
  result.host_rss_at_start_bytes = resident_bytes();
  try {
    train_torch(options, which, on_step, result);
  } catch (const std::exception& e) {
    result.ok = false;
    result.error = message_of(e);
  }
  result.peak_host_rss_bytes = fresh_peak ? peak_resident_bytes() : -1;
  release_torch_cache(options);
  return result;
}

}  // namespace strata::apps
