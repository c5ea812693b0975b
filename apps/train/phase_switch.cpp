#include "apps/train/phase_switch.h"

#include <torch/torch.h>

#include <algorithm>
#include <vector>

#include "apps/train/torch_device.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::apps {
namespace {

// Free GPU memory as the driver sees it; -1 without a GPU.
std::int64_t driver_free_bytes(const TrainOptions& o) {
#ifdef STRATA_HAS_CUDA
  std::size_t free = 0, total = 0;
  if (o.cuda && cudaMemGetInfo(&free, &total) == cudaSuccess)
    return static_cast<std::int64_t>(free);
#else
  (void)o;
#endif
  return -1;
}

// The link's rates right before the switch (See Note [Adjacent floor] in bench/link_rig.h: a host's
// link drifts within minutes): raw copies between pinned host memory and the GPU through torch, the
// median of three per direction, in GB/s.
std::pair<double, double> link_rates(const TrainOptions& o) {
  if (!o.cuda) return {0, 0};
  constexpr std::int64_t kBytes = 256LL << 20;
  torch::Tensor host = torch::empty({kBytes}, torch::dtype(torch::kUInt8).pinned_memory(true));
  torch::Tensor device = torch::empty({kBytes}, torch::dtype(torch::kUInt8).device(torch::kCUDA));
  host.fill_(1);
  auto rate = [&](torch::Tensor& dst, const torch::Tensor& src) {
    std::vector<double> ms;
    for (int i = 0; i < 4; ++i) {
      synchronize(o);
      const Clock::time_point start = Clock::now();
      dst.copy_(src, /*non_blocking=*/true);
      synchronize(o);
      if (i > 0) ms.push_back(ms_since(start));  // the first warms up
    }
    std::sort(ms.begin(), ms.end());
    return kBytes / ms[ms.size() / 2] / 1e6;
  };
  const double h2d = rate(device, host);
  const double d2h = rate(host, device);
  return {h2d, d2h};
}

// The rollout engine's stand-in: takes, through torch, up to `target` bytes of GPU memory (host
// memory on the simulated device) in pieces, writes them, and gives them back. Returns what it
// got.
std::int64_t rollout_stand_in(const TrainOptions& o, std::int64_t target) {
  constexpr std::int64_t kPiece = 256LL << 20;
  std::vector<torch::Tensor> taken;
  std::int64_t got = 0;
  const auto options = torch::dtype(torch::kUInt8).device(o.cuda ? torch::kCUDA : torch::kCPU);
  while (got < target) {
    const std::int64_t bytes = std::min(kPiece, target - got);
    try {
      taken.push_back(torch::empty({bytes}, options).fill_(7));
    } catch (const c10::OutOfMemoryError&) {
      break;
    }
    got += bytes;
  }
  synchronize(o);
  taken.clear();
  release_torch_cache(o);
  return got;
}

}  // namespace

PhaseSwitchRecord phase_switch(const TrainOptions& o, int after_step, const PhaseSwitchOps& ops) {
  PhaseSwitchRecord r;
  r.after_step = after_step;
  synchronize(o);
  const auto [h2d_gbps, d2h_gbps] = link_rates(o);
  r.link_h2d_gbps = h2d_gbps;
  r.link_d2h_gbps = d2h_gbps;
  release_torch_cache(o);
  const std::int64_t pinned_before = ops.pinned_allocations ? ops.pinned_allocations() : 0;
  const auto [h2d_before, d2h_before] = ops.moved_bytes();
  const auto upstream_ns = [&ops] {
    return ops.gpu_upstream_ns ? ops.gpu_upstream_ns() : std::pair<std::int64_t, std::int64_t>{};
  };
  const auto [malloc_before, free_before_ns] = upstream_ns();
  r.gpu_bytes_before_offload = ops.gpu_bytes();
  const std::int64_t free_before = driver_free_bytes(o);

  Clock::time_point start = Clock::now();
  ops.offload();
  synchronize(o);
  r.offload_ms = ms_since(start);
  r.gpu_reserved_after_offload_bytes = ops.gpu_bytes();
  if (free_before >= 0) r.driver_freed_bytes = driver_free_bytes(o) - free_before;
  const auto [h2d_mid, d2h_mid] = ops.moved_bytes();
  r.offloaded_bytes = d2h_mid - d2h_before;

  // What the rollout may take: what the driver saw freed on a GPU (torch's cache emptied too),
  // what the run gave back on the simulated device.
  release_torch_cache(o);
  const std::int64_t freed = free_before >= 0
                                 ? driver_free_bytes(o) - free_before
                                 : r.gpu_bytes_before_offload - r.gpu_reserved_after_offload_bytes;
  r.rollout_stand_in_bytes = rollout_stand_in(o, std::max<std::int64_t>(freed, 0));

  start = Clock::now();
  ops.reload();
  synchronize(o);
  r.reload_ms = ms_since(start);
  const auto [h2d_after, d2h_after] = ops.moved_bytes();
  r.reloaded_bytes = h2d_after - h2d_mid;
  if (ops.pinned_allocations) r.pinned_allocations = ops.pinned_allocations() - pinned_before;
  const auto [malloc_after, free_after_ns] = upstream_ns();
  r.cuda_malloc_ms = (malloc_after - malloc_before) / 1e6;
  r.cuda_free_ms = (free_after_ns - free_before_ns) / 1e6;
  if (d2h_gbps > 0) r.offload_floor_ms = r.offloaded_bytes / d2h_gbps / 1e6;
  if (h2d_gbps > 0) r.reload_floor_ms = r.reloaded_bytes / h2d_gbps / 1e6;
  return r;
}

}  // namespace strata::apps
