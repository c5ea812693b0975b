// apps/train/torch_run.cpp: strata-train's PyTorch baselines (TorchBaseline): the same model and
// batches trained with torch's fused AdamW, its states resident on the GPU, moved to the host and
// back with .to() around each step, or stepped on the host (HostStep), phase switches done as a
// PyTorch trainer does them.
#include <torch/torch.h>

#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "apps/train/phase_switch.h"
#include "apps/train/pinned_states.h"
#include "apps/train/run_parts.h"
#include "apps/train/torch_adamw.h"
#include "apps/train/torch_device.h"
#include "apps/train/train.h"
#include "base/host_memory.h"
#include "bridge/scalar_reader.h"

namespace strata::apps {
namespace {

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

// Note [The host step's baseline]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch's own way to step on the host, as FSDP2's CPUOffloadPolicy takes it: float32 masters and
// Adam states in host memory (the masters pinned), torch's fused AdamW on the CPU (its intra-op
// threads), and around it the float32 gradients copied to pinned host buffers and the masters
// copied back to the GPU, where a bfloat16 or float16 model's parameters are rounded from them.
// Both copies move 4 bytes a parameter, as FSDP2 moves its float32 gradients and sharded
// parameters. Nothing is pipelined: every gradient is out before the CPU steps, and the masters go
// back after it, so the step costs the copies plus the host kernel (the figure strata's hybrid step
// is measured against, issue 38).
class HostStep {
 public:
  HostStep(const std::vector<torch::Tensor>& masters, const TrainOptions& o) {
    for (const torch::Tensor& m : masters) {
      const torch::TensorOptions host = m.options().device(torch::kCPU).pinned_memory(o.cuda);
      host_masters_.push_back(torch::empty(m.sizes(), host));
      host_masters_.back().copy_(m);
      host_masters_.back().mutable_grad() = torch::empty(m.sizes(), host);
    }
  }
  // The host masters, in the order of `masters`: what the host optimizer steps.
  const std::vector<torch::Tensor>& masters() const { return host_masters_; }

  // Gradients out, `optimizer` (over masters()) stepped on the host, the masters back into the GPU
  // masters `to`. found_inf: undefined, or the GPU's flag.
  void step(const std::vector<torch::Tensor>& grads, TorchFusedAdamW& optimizer,
            const torch::Tensor& found_inf, std::vector<torch::Tensor>& to, const TrainOptions& o) {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < grads.size(); ++i) {
      host_masters_[i].mutable_grad().copy_(grads[i], /*non_blocking=*/true);
    }
    const torch::Tensor inf = found_inf.defined() ? found_inf.to(torch::kCPU) : torch::Tensor();
    synchronize(o);
    optimizer.step(inf);
    for (std::size_t i = 0; i < to.size(); ++i)
      to[i].copy_(host_masters_[i], /*non_blocking=*/true);
  }

  std::int64_t bytes() const {
    std::int64_t b = 0;
    for (const torch::Tensor& m : host_masters_) b += static_cast<std::int64_t>(m.nbytes());
    return b;
  }

 private:
  std::vector<torch::Tensor> host_masters_;
};

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
  // See Note [The host step's baseline]: its optimizer steps host copies of the masters.
  std::optional<HostStep> host;
  if (which == TorchBaseline::kHostStep) {
    host.emplace(masters, o);
    decay.clear();
    no_decay.clear();
    const auto named = model->named_parameters(/*recurse=*/true);
    for (std::size_t i = 0; i < named.size(); ++i) {
      (GptImpl::decays(named[i].key()) ? decay : no_decay).push_back(host->masters()[i]);
    }
  }
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
    if (host) {
      host->step(grads, optimizer, scaler.enabled ? found_inf : torch::Tensor(), masters, o);
    } else {
      optimizer.step(scaler.enabled ? found_inf : torch::Tensor());
    }
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
    if (host && o.cuda) r.h2d_bytes = r.d2h_bytes = host->bytes();  // gradients out, masters back
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

std::string baseline_name(TorchBaseline which) {
  switch (which) {
    case TorchBaseline::kResident:
      return "torch_adamw_resident";
    case TorchBaseline::kMovedWithTo:
      return "torch_adamw_to";
    case TorchBaseline::kHostStep:
      return "torch_adamw_host";
  }
  return "";
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
