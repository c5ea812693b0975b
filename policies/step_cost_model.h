// policies/step_cost_model.h: the cost model with which the hybrid policy splits an optimizer step
// between layers stepped on the GPU (their states streamed over the link) and layers stepped on the
// host (gradients out, host Adam, parameters back). Pure arithmetic on rates measured elsewhere;
// See Note [Hybrid cost model].
//
//   StepRates rates{.link_h2d_gbps = h2d, .link_d2h_gbps = d2h, .link_both_gbps = both,
//                   .host_params_per_s = host_adam, .link_h2d_loaded_gbps = h2d_meanwhile,
//                   .link_d2h_loaded_gbps = d2h_meanwhile};
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
// Host Adam and the link work at once, and the step lasts until both are done:
//   - host Adam takes host = sum_H params / host_params_per_s, the kernel's rate measured while
//     the link copies both ways.
//   - the link, for those `host` seconds, moves each direction at its rate measured while both
//     directions copy and the host kernel runs (link_*_loaded_gbps). Both draw on host memory,
//     and the cores take their share of it first: on an H200's host, host to GPU falls by a third
//     as the kernel's threads go up to one a core, GPU to host hardly at all (the probe in
//     tools/gpu/probes/link_host_adam.cu measures the pairs). What is left after that moves as
//     with no host work: while both directions carry bytes each moves at link_both_gbps (lower
//     than either alone: the two share the host's side of the link); once the lighter direction
//     is done, the busier one's rest moves alone, at that direction's own rate:
//       rest = min(h2d, d2h) / both + (max(h2d, d2h) - min(h2d, d2h)) / rate of the busier one.
//     A direction that is done while the host still runs leaves the other at its loaded rate.
//     This takes the copies of both directions to be in flight together from the start, which
//     layer after layer streaming gives once it is under way.
//   - the GPU's Adam kernel: sum_G params / gpu_params_per_s, or nothing when that rate is 0 (a
//     streamed step's kernel runs far faster than its states cross the link).
// The predicted time is the largest of link, host and gpu, and `bound` names it (on equal times
// the first of them). It is a floor, not an estimate of the whole: it leaves out the first layer's
// fetch and the last layer's write-back (the pipeline's fill and drain), each copy's start gap,
// and the wait for gradients that backward has not produced yet. An earlier form had a host-memory
// term instead of the loaded link rates: every DMA byte and the host kernel's bytes over a
// parallel copy's bandwidth. Host memory does not add up so (the DMA engines and the cores do not
// draw on one pool): that term predicted splits slower than the streamed step that measured
// faster, so the model chose none. The loaded rates are what the two take from each other,
// measured.
//
// Which layers to step on the host: host Adam costs the same per parameter whatever the layer, so
// layers differ only in their byte figures. choose_split orders the layers by the link bytes a
// parameter saves on the host, 2*state_bytes - grad_bytes - param_bytes, most first (on equal
// savings the higher layer index first, since backward produces the last layers' gradients
// first), predicts every prefix of that order on the host (none, the first, the first two, ...,
// all) and keeps the fastest, the shorter prefix on equal times. A layer whose savings are
// negative comes last, and a prefix that includes it is kept only where it predicts faster. A
// forced fraction f of parameters stepped on the GPU takes the prefix whose host parameter count
// is nearest (1 - f) * N instead.
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
  double seconds = 0;  // the largest of the three below
  double link_s = 0;
  double host_s = 0;
  double gpu_s = 0;
  std::string bound = "link";  // "link", "host" or "gpu": the one equal to seconds
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
