// runtime/step_costs.h: what an optimizer step split between the GPU and the host costs: the rates
// measured on this machine (optim/step_rates.h measures them) and each layer's share (the optimizer
// knows it). A policy that places steps is handed both (ResidencyPolicy::on_place_steps) and
// predicts from them (policies/step_cost_model.h).
//
// Example:
//   StepCosts costs;
//   costs.rates = {.link_h2d_gbps = 50, .link_d2h_gbps = 50, .link_both_gbps = 40,
//                  .host_params_per_s = 2e9, .link_h2d_loaded_gbps = 30,
//                  .link_d2h_loaded_gbps = 38};
//   costs.layers.push_back({.layer = 0, .params = 1 << 24, .state_bytes = 8, .grad_bytes = 4,
//                           .param_bytes = 4});
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::rt {

// GB/s are 1e9 bytes a second. See Note [Hybrid cost model] in policies/step_cost_model.h.
struct StepRates {
  double link_h2d_gbps = 0;   // host to GPU, that direction alone
  double link_d2h_gbps = 0;   // GPU to host, alone
  double link_both_gbps = 0;  // each direction, both copying at once
  // The host Adam kernel with the threads it may use, while the link copies both ways (it shares
  // host memory with the copies).
  double host_params_per_s = 0;
  // Each direction while both copy and the host kernel runs: host memory that the kernel takes is
  // not there for DMA (See Note [Hybrid cost model] in policies/step_cost_model.h).
  double link_h2d_loaded_gbps = 0;
  double link_d2h_loaded_gbps = 0;
  double host_params_per_s_alone =
      0;  // the host kernel with the link idle (reported, not modelled)
  double host_memory_gbps =
      0;  // a parallel copy's bandwidth (read + write; reported, not modelled)
  double gpu_params_per_s = 0;  // the GPU Adam kernel; 0: not measured (not modelled)
  int host_threads = 0;         // threads the host kernel ran on
};

// One layer's share of an optimizer step. Byte figures are per parameter.
struct LayerCost {
  int layer = 0;
  std::int64_t params = 0;
  double state_bytes = 0;  // streamed each way: 8 for float32 moments, 12 with float32 masters
  double grad_bytes = 0;   // the gradient sent GPU to host for a host step (its dtype's size)
  double param_bytes = 0;  // the parameter sent host to GPU after a host step
  // Its states are the same wherever it steps but for a float32 parameter's master (See Note
  // [Float32 masters follow the split] in optim/adam_placement.cpp), and its step fits the GPU:
  // measured steps may move it between the GPU and the host (See Note [Measured split] in
  // policies/split_search.h).
  bool movable = false;
};

struct StepCosts {
  StepRates rates;
  std::vector<LayerCost> layers;
};

// How a measured step was taken: a step in backward hides part of its link time under backward's
// compute, and a redone one runs twice, so their times compare only with steps taken the same way
// (See Note [Measured split] in policies/split_search.h).
enum class StepKind : std::uint8_t {
  kAfterBackward,     // every layer stepped after backward (or by step())
  kInBackward,        // stepped in backward, and the step held
  kPartlyInBackward,  // held, with a share of the layers left for after backward by choice
  kRedone,            // taken in backward, then taken back and stepped again
};

// One measured optimizer step, for a policy that wants step times (See Note [Measured split] in
// policies/split_search.h): the seconds from the last step's end to this one's on the compute
// stream, the seconds the host kernel ran in it (0 with no layer stepped on the host, or where
// the optimizer gives none: See Note [Host rate in the step] in policies/hybrid.cpp), and how the
// step was taken.
struct StepTimes {
  double seconds = 0;
  double host_kernel_seconds = 0;
  StepKind kind = StepKind::kAfterBackward;
};

// One line: "link 53.1/54.0 GB/s host to GPU/GPU to host (40.2 each way both at once; 31.9/46.6
// while host Adam runs), host Adam 1.90 G params/s on 16 threads while the link copies (4.10
// alone), host memory 118.0 GB/s, GPU Adam 40.0 G params/s".
std::string describe(const StepRates& rates);

}  // namespace strata::rt
