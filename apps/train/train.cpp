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
#include "apps/train/run_parts.h"
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

namespace strata::apps {
namespace {

// The traced step's copies and marks as CSV: kind (h2d or d2h for the link's copy streams, other
// for copies on any other stream, such as the undo copies an overlapped step keeps on the GPU or a
// host-stepped layer's gradients and parameters, or mark), bytes (a mark's label), start and end
// in ms from the step's start, and the stream (numbered in the order streams first copied; marks
// have none).
void write_trace(rt::CopyTracer& tracer, rt::Runtime& runtime, const std::string& path) {
  const std::vector<rt::CopySpan> spans = bridge::unwrap(tracer.finish());
  std::ofstream csv(path);
  csv << "kind,bytes_or_label,start_ms,end_ms,stream\n";
  std::vector<rt::StreamHandle> streams;
  for (const rt::CopySpan& c : spans) {
    const char* kind = c.stream == runtime.h2d_stream()   ? "h2d"
                       : c.stream == runtime.d2h_stream() ? "d2h"
                                                          : "other";
    auto it = std::find(streams.begin(), streams.end(), c.stream);
    if (it == streams.end()) it = streams.insert(streams.end(), c.stream);
    csv << kind << ',' << c.bytes << ',' << c.start_ms << ',' << c.end_ms << ','
        << (it - streams.begin()) << '\n';
  }
  for (const auto& [label, at] : tracer.marks()) {
    csv << "mark," << label << ',' << at << ',' << at << ",\n";
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

// The optimizer over the bound model (AdamW, or the rule --optimizer names): weight decay for the
// matrices only (GptImpl::decays), states in the options' dtype. Prints the step placement when the
// policy places steps.
std::unique_ptr<optim::Adam> make_adam(rt::Runtime& rt, bridge::TorchBinding& binding,
                                       GptImpl& model, const TrainOptions& o,
                                       const std::string& run_name) {
  optim::AdamOptions ao;
  ao.state_dtype = o.state_dtype;
  ao.rule = o.rule;
  ao.cpu_threads = o.host_threads;
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
      const optim::Adam::HostStepSeconds host_seconds_before = adam->host_step_seconds();

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
      if (traced) bridge::check(tracer->mark(rt.compute_stream(), "optimizer step"));
      const optim::Adam::StepOutcome outcome = bridge::unwrap(
          adam->finish_step(grad_scale.defined() ? grad_scale.data_ptr<float>() : nullptr,
                            found_inf.defined() ? found_inf.data_ptr<float>() : nullptr));
      clock.wait();
      if (found_inf.defined()) scaler.update(found_inf);
      const double optimizer_ms = ms_since(optimizer_start);
      hooks.end_step();
      if (adam->placement() != result.placement) {  // See Note [Measured split]
        result.placement = adam->placement();
        std::printf("[%s] %s\n", run_name.c_str(), result.placement.c_str());
      }
      result.host_layers = adam->host_layers();
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
      const optim::Adam::HostStepSeconds host_seconds = adam->host_step_seconds();
      r.host_queued_ms = (host_seconds.queued - host_seconds_before.queued) * 1e3;
      r.host_waited_ms = (host_seconds.waited - host_seconds_before.waited) * 1e3;
      r.host_kernel_ms = (host_seconds.kernel - host_seconds_before.kernel) * 1e3;
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

}  // namespace strata::apps
