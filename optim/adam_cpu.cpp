#include <algorithm>

#include "optim/adam_kernels.h"

namespace strata::optim {
namespace {

// Elements [begin, end) of the concatenation of all tensors.
void run_range(const AdamTensor* tensors, std::size_t count, const AdamScalars& s, float inv,
               std::int64_t begin, std::int64_t end) {
  std::int64_t base = 0;
  for (std::size_t t = 0; t < count && base < end; ++t) {
    const AdamTensor& x = tensors[t];
    const std::int64_t lo = std::max<std::int64_t>(begin - base, 0);
    const std::int64_t hi = std::min<std::int64_t>(end - base, x.numel);
    AdamScalars own = s;
    if (lo < hi && x.bias != nullptr) {
      // See Note [Bias corrections from the device] in adam_kernels.h.
      own.step_size = x.bias[0];
      own.bias_correction2_sqrt = x.bias[1];
    } else if (lo < hi) {
      bias_corrections(own, settled_step(x));  // See Note [Skipped steps]
    }
    for (std::int64_t i = lo; i < hi; ++i) adam_tensor_element(x, i, own, inv);
    base += x.numel;
  }
}

}  // namespace

void adam_step_cpu(const AdamTensor* tensors, std::size_t count, const AdamScalars& scalars,
                   float inv_grad_scale, ThreadPool* pool) {
  const AdamScalars& s = scalars;
  std::int64_t total = 0;
  for (std::size_t t = 0; t < count; ++t) total += tensors[t].numel;
  // A part of fewer than 2^18 elements costs less than handing it to another thread.
  const std::int64_t kMinPerPart = std::int64_t{1} << 18;
  const int threads = pool != nullptr ? pool->size() : 1;
  const int n = static_cast<int>(std::clamp<std::int64_t>(total / kMinPerPart, 1, threads));
  if (n == 1) {
    run_range(tensors, count, s, inv_grad_scale, 0, total);
    return;
  }
  const std::int64_t per = (total + n - 1) / n;
  pool->parallel_for(n, [&](int part) {
    const std::int64_t begin = per * part;
    run_range(tensors, count, s, inv_grad_scale, begin, std::min(total, begin + per));
  });
}

void adam_count_skipped_cpu(const AdamTensor* tensors, std::size_t count) {
  for (std::size_t t = 0; t < count; ++t) {
    if (tensors[t].skipped != nullptr) ++*tensors[t].skipped;
  }
}

}  // namespace strata::optim
