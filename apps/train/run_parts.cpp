#include "apps/train/run_parts.h"

#ifdef STRATA_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace strata::apps {

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

Gpt make_model(const TrainOptions& o) {
  torch::manual_seed(o.seed);
  Gpt model(o.model);
  model->to(device_of(o), o.dtype);
  return model;
}

Batch batch_for(const TrainOptions& o, int step, int micro) {
  const int index = (step - 1) * o.grad_accum + micro + 1;
  torch::Tensor tokens = (o.text != nullptr ? o.text->batch(o.model, o.seed, index)
                                            : synthetic_batch(o.model, o.seed, index))
                             .to(device_of(o));
  return {tokens.slice(1, 0, -1), tokens.slice(1, 1)};
}

torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}).to(torch::kFloat), targets.reshape({-1}));
}

std::string message_of(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

}  // namespace strata::apps
