// apps/train/run_parts.h: what a strata run and a PyTorch baseline run of strata-train share: the
// model from the seed, the batches, the loss, the loss scale, torch's peak memory, an exception's
// message. The strata run is apps/train/train.cpp, the PyTorch baselines apps/train/torch_run.cpp.
//
// Example:
//   Gpt model = make_model(o);
//   const Batch b = batch_for(o, /*step=*/1);
//   loss_of(model->forward(b.inputs, [](int) {}, [](int) {}), b.targets).backward();
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <exception>
#include <string>

#include "apps/train/gpt.h"
#include "apps/train/torch_device.h"
#include "apps/train/train.h"

namespace strata::apps {

// torch's own GPU memory (activations, temporaries; everything for a PyTorch run): its peak,
// reset at a run's (and a step's) start and read at its end.
void reset_torch_peak(const TrainOptions& o);
std::int64_t torch_peak_bytes(const TrainOptions& o);

// The same model, from the same seed (drawn in float32, then converted), on the run's device.
Gpt make_model(const TrainOptions& o);

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
Batch batch_for(const TrainOptions& o, int step, int micro = 0);

// In float32 whatever the model's dtype, as mixed-precision training computes its loss.
torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& targets);

// c10::Error's message without its backtrace; what() otherwise.
std::string message_of(const std::exception& e);

}  // namespace strata::apps
