// policies/step_cost_model.h: the cost model with which the hybrid policy splits an optimizer step
// between layers stepped on the GPU (their states streamed over the link) and layers stepped on the
// host (gradients out, host Adam, parameters back). Pure arithmetic on rates measured elsewhere;
// See Note [Hybrid cost model].
//
//   StepRates rates{.link_h2d_gbps = h2d, .link_d2h_gbps = d2h, .link_both_gbps = both,
//                   .host_params_per_s = host_adam, .host_memory_gbps = host_memory};
//   std::vector<LayerCost> layers = ...;   // one per layer: params and bytes per parameter
//   STRATA_ASSIGN_OR_RETURN(HybridSplit split, choose_split(rates, layers, std::nullopt));
//   std::printf("%s\n", describe(split).c_str());   // "hybrid: 9 of 24 layers (...) ..."
//
// Note [Hybrid cost model]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A streamed (GPU-stepped) layer moves its optimizer states both ways: state_bytes a parameter
// host to GPU before its kernel and as many back after. A host-stepped layer moves its gradient out
// (grad_bytes a parameter) and its updated parameters back (param_bytes a parameter), and costs
// host Adam time. Over a step, with H the host-stepped layers and G the streamed ones:
//   h2d bytes = sum_G params*state_bytes + sum_H params*param_bytes
//   d2h bytes = sum_G params*state_bytes + sum_H params*grad_bytes
// and four resources work at once, layer after layer, so the slowest one bounds the step:
//   - the link. While both directions carry bytes each moves at link_both_gbps (lower than either
//     direction alone: the two share the host's side of the link). Once the lighter direction is
//     done, what the busier one has left moves alone, at that direction's own rate:
//       link = min(h2d, d2h) / both + (max(h2d, d2h) - min(h2d, d2h)) / rate of the busier one.
//     Equal directions run overlapped throughout; a direction alone (the other carries nothing)
//     runs at its own rate throughout. This takes the copies of both directions to be in flight
//     together from the start, which layer after layer streaming gives once it is under way.
//   - host Adam: sum_H params / host_params_per_s. The rate is to be measured while the link copies
//     both ways, since DMA slows the host kernel down through host memory.
//   - host memory, which DMA and host Adam share: every byte the link moves is read or written in
//     host memory once, and host Adam reads and writes host_touch_bytes a parameter (moments,
//     masters, gradient, parameter), so host memory = (h2d + d2h + sum_H params*host_touch_bytes)
//     / host_memory_gbps.
//   - the GPU's Adam kernel: sum_G params / gpu_params_per_s, or nothing when that rate is 0 (a
//     streamed step's kernel runs far faster than its states cross the link).
// The predicted time is the largest of the four and `bound` names it (on equal times the first of
// link, host, host memory, gpu). It is a floor, not an estimate of the whole: it leaves out the
// first layer's fetch and the last layer's write-back (the pipeline's fill and drain), each copy's
// start gap, and the wait for gradients that backward has not produced yet.
//
// Which layers to step on the host: host Adam costs the same per parameter whatever the layer, so
// layers differ only in their byte figures. choose_split orders the layers by the link bytes a
// parameter saves on the host, 2*state_bytes - grad_bytes - param_bytes, most first (on equal
// savings the higher layer index first, since backward produces the last layers' gradients
// first), predicts every prefix of that order on the host (none, the first, the first two, ...,
// all) and keeps the fastest, the shorter prefix on equal times. Since the host memory a parameter
// costs is host_touch_bytes less those same savings, this order is also the best for host memory
// where host_touch_bytes is the same for every layer (the usual case); where it differs, the order
// is a heuristic. A layer whose savings are negative comes last, and a prefix that includes it is
// kept only where it predicts faster. A forced fraction f of parameters stepped on the GPU takes
// the prefix whose host parameter count is nearest (1 - f) * N instead.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/step_costs.h"

namespace strata::policy {

// Measured rates (optim/step_rates.h measures them; See Note [Hybrid cost model]).
using rt::StepRates;

using rt::LayerCost;

struct StepPrediction {
  double seconds = 0;  // the largest of the four below
  double link_s = 0;
  double host_s = 0;
  double host_memory_s = 0;
  double gpu_s = 0;
  std::string bound = "link";  // "link", "host", "host memory" or "gpu": the one equal to seconds
  std::int64_t host_params = 0;
  std::int64_t gpu_params = 0;
};

struct HybridSplit {
  std::vector<bool> on_host;  // per input layer, in the input's order
  StepPrediction predicted;
  StepPrediction all_gpu;   // the streamed step: every layer on the GPU
  double gpu_fraction = 1;  // of parameters; 1 when there are none
};

// OK, or kInvalidArgument naming the first bad figure: a rate that is not positive and finite
// (gpu_params_per_s may be 0), a negative params count, or a byte figure negative or not finite.
absl::Status validate_cost_inputs(const StepRates& rates, const std::vector<LayerCost>& layers);

// The step with the layers marked in `on_host` stepped on the host and the rest streamed.
// on_host.size() must equal layers.size(); inputs are taken as valid (validate_cost_inputs).
StepPrediction predict(const StepRates& rates, const std::vector<LayerCost>& layers,
                       const std::vector<bool>& on_host);

// The split with the lowest predicted time, or with `forced_fraction` (of parameters stepped on the
// GPU, in [0, 1]) the split nearest it; kInvalidArgument for a fraction out of range or NaN and
// for what validate_cost_inputs refuses. Deterministic.
absl::StatusOr<HybridSplit> choose_split(const StepRates& rates,
                                         const std::vector<LayerCost>& layers,
                                         std::optional<double> forced_fraction);

// Positions in `layers` in the order they go to the host (See Note [Hybrid cost model]): a split
// choose_split considers is a prefix of it.
std::vector<std::size_t> host_order(const std::vector<LayerCost>& layers);

// One line: "hybrid: 9 of 24 layers (37.5% of parameters) stepped on the host; predicted 171.2 ms
// (bound: link) against 205.3 ms streamed (0.83x)".
std::string describe(const HybridSplit& split);

}  // namespace strata::policy
