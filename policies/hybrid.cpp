// policies/hybrid.cpp: the hybrid policy's step placement: LayerPrefetch with some layers' steps
// on the host, chosen by the cost model (policies/layer_prefetch.h, policies/step_cost_model.h).
#include <algorithm>
#include <cstdio>
#include <optional>
#include <utility>

#include "base/status.h"
#include "base/strings.h"
#include "policies/layer_prefetch.h"
#include "policies/step_cost_model.h"

namespace strata::policy {
namespace internal {
namespace {

// How the steps a search counted were taken, for its line (See Note [Measured split]).
const char* kind_words(std::optional<rt::StepKind> kind) {
  switch (kind.value_or(rt::StepKind::kAfterBackward)) {
    case rt::StepKind::kInBackward:
      return "in backward";
    case rt::StepKind::kPartlyInBackward:
      return "partly in backward";
    default:
      return "after backward";
  }
}

}  // namespace

// Note [Hybrid placement]
// ~~~~~~~~~~~~~~~~~~~~~~~
// hybrid is layer_prefetch with some layers' steps on the host (See Note [Step placement] in
// runtime/policy.h): the cost model picks them from the optimizer's costs and the measured rates
// (See Note [Hybrid cost model] in step_cost_model.h), or hybrid_fraction forces the share. A
// host-stepped layer's states rest in pinned memory and never stream or settle on the GPU: it
// takes no ring slot and no turn, so the ring and the resident layers are laid out over the
// layers stepped on the GPU only. The split is chosen over every layer as if each streamed;
// resident layers, taken in ascending order from what is left, cost the link nothing, so with a
// budget the split is a bound, not the best. Only optimizer states move: parameters and
// gradients stay on the GPU, where the host step's copies read and write them. Unless the split is
// forced, measured steps then move the layers the optimizer marks movable (See Note [Measured
// split] in split_search.h); a layer that moves to the host leaves the main pool, and the ring and
// the resident layers are laid out again over the layers stepped on the GPU (and once more at the
// next step, when a float32 layer that left the host has given up its master: See Note [Float32
// masters follow the split] in optim/adam_placement.cpp).
absl::StatusOr<std::string> LayerPrefetch::on_place_steps(rt::PolicyContext& rt,
                                                          const rt::StepCosts& costs) {
  if (!hybrid_) return std::string();
  STRATA_ASSIGN_OR_RETURN(HybridSplit split,
                          choose_split(costs.rates, costs.layers, config().hybrid_fraction));
  host_layers_.clear();
  split_ = Split();
  split_.costs = costs;
  int start = 0;
  for (std::size_t i : host_order(costs.layers)) {
    const rt::LayerCost& c = costs.layers[i];
    if (split.on_host[i]) host_layers_.push_back(c.layer);
    if (c.movable) {
      split_.movable.push_back(c.layer);
      start += split.on_host[i] ? 1 : 0;
    } else if (split.on_host[i]) {
      split_.fixed_host.push_back(c.layer);
    }
  }
  std::sort(host_layers_.begin(), host_layers_.end());
  settled_ = false;
  std::string line = describe(split);
  if (config().hybrid_fraction) {
    str_append(&line, " (hybrid_fraction ", *config().hybrid_fraction, " forced)");
  } else if (!split_.movable.empty()) {
    // See Note [Measured split] in split_search.h.
    split_.search.emplace(static_cast<int>(split_.movable.size()), start, SplitSearchOptions{});
    str_append(&line, "; measured steps refine it (", split_.movable.size(), " layers may move, ",
               split_.search->stride(), " at a time)");
  }
  return line;
}

std::vector<int> LayerPrefetch::host_layers_for(int k) const {
  std::vector<int> host = split_.fixed_host;
  host.insert(host.end(), split_.movable.begin(), split_.movable.begin() + k);
  std::sort(host.begin(), host.end());
  return host;
}

double LayerPrefetch::predicted_seconds(int k) const {
  const std::vector<rt::LayerCost>& layers = split_.costs.layers;
  const std::vector<int> host = host_layers_for(k);
  std::vector<bool> on_host(layers.size());
  for (std::size_t i = 0; i < layers.size(); ++i) {
    on_host[i] = std::binary_search(host.begin(), host.end(), layers[i].layer);
  }
  return predict(split_.costs.rates, layers, on_host).seconds;
}

// Note [Host rate in the step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The cost model's host Adam rate is measured at setup, beside the link's copies over a buffer
// larger than the host's caches (See Note [Measuring the step's rates] in optim/step_rates.h).
// Inside a step the host kernel does other work around it (the streamed layers' copies share host
// memory with it, and it steps layer by layer as their gradients arrive), and where it runs slower
// than at setup the model is optimistic for a host split by about the ratio of the two rates, and
// chooses more host layers than is fastest. The first measured step whose host layers all stepped
// after backward gives the rate in the step (a step in backward also copies their undo, and one
// redone runs the kernel twice; the optimizer hands no host time for those): the host layers'
// parameters over the seconds the host kernel ran. If the search has measured no split yet, the
// model takes that rate in place of the setup's, once, and chooses again over the layers that may
// move; if its choice differs, the search starts there instead (the samples of the split it had
// were few, and a move costs one more step). The predictions beside the measured splits in the
// search's line are then the refit model's, and the line names both rates.
std::optional<int> LayerPrefetch::refit_host_rate(const rt::StepTimes& times) {
  std::int64_t host_params = 0;
  for (const rt::LayerCost& c : split_.costs.layers) {
    if (on_host(c.layer)) host_params += c.params;
  }
  if (host_params == 0 || !(times.host_kernel_seconds > 0)) return std::nullopt;
  split_.setup_host_params_per_s = split_.costs.rates.host_params_per_s;
  split_.costs.rates.host_params_per_s =
      static_cast<double>(host_params) / times.host_kernel_seconds;
  int best = 0;
  double best_seconds = predicted_seconds(0);
  for (int k = 1; k <= static_cast<int>(split_.movable.size()); ++k) {
    const double s = predicted_seconds(k);
    if (s < best_seconds) {
      best = k;
      best_seconds = s;
    }
  }
  return best;
}

absl::StatusOr<std::string> LayerPrefetch::on_step_measured(rt::PolicyContext& rt,
                                                            const rt::StepTimes& times) {
  if (!wants_step_times()) return std::string();
  const int before = split_.search->current();
  std::optional<int> refit;
  if (split_.setup_host_params_per_s == 0 && split_.search->measured().empty()) {
    refit = refit_host_rate(times);  // See Note [Host rate in the step]
  }
  if (refit.has_value() && *refit != before) {
    split_.search.emplace(static_cast<int>(split_.movable.size()), *refit, SplitSearchOptions{});
  } else {
    split_.search->add(times.seconds, times.kind);
  }
  ++split_.steps;
  split_.moved_last = false;
  if (split_.search->current() != before) {
    split_.before_move = host_layers_;
    absl::Status moved = move_steps(rt, host_layers_for(split_.search->current()));
    if (!moved.ok()) {
      split_.search.reset();  // it stops with the split it had (move_steps put it back)
      return absl::Status(
          moved.code(), str_cat("hybrid: moving steps for the measured split: ", moved.message()));
    }
    split_.moved_last = true;
  }
  return split_.search->done() ? describe_search() : std::string();
}

absl::Status LayerPrefetch::on_move_refused(rt::PolicyContext& rt) {
  split_.search.reset();
  if (!std::exchange(split_.moved_last, false)) return absl::OkStatus();
  return move_steps(rt, split_.before_move);
}

std::string LayerPrefetch::describe_search() const {
  const SplitSearch& search = *split_.search;
  const std::vector<rt::LayerCost>& layers = split_.costs.layers;
  std::int64_t host_params = 0;
  std::int64_t total = 0;
  for (const rt::LayerCost& c : layers) {
    total += c.params;
    if (on_host(c.layer)) host_params += c.params;
  }
  char share[32];
  std::snprintf(share, sizeof(share), "%.1f%%",
                total > 0 ? 100.0 * static_cast<double>(host_params) / total : 0.0);
  std::string line =
      str_cat("hybrid: measured steps chose ", host_layers_.size(), " of ", layers.size(),
              " layers (", share, " of parameters) on the host after ", split_.steps,
              " steps; movable layers on the host: ms from one step's end to the next, over "
              "steps taken ",
              kind_words(search.kind()), " (the cost model's optimizer step):");
  for (const auto& [k, seconds] : search.measured()) {
    char item[64];
    std::snprintf(item, sizeof(item), " %d: %.1f (%.1f)", k, seconds * 1e3,
                  predicted_seconds(k) * 1e3);
    line += item;
  }
  if (split_.setup_host_params_per_s > 0) {
    // See Note [Host rate in the step].
    char rates[160];
    std::snprintf(rates, sizeof(rates),
                  "; the model's host Adam: %.2f G params/s, measured in the first step (%.2f at "
                  "setup)",
                  split_.costs.rates.host_params_per_s / 1e9, split_.setup_host_params_per_s / 1e9);
    line += rates;
  }
  return line;
}

absl::Status LayerPrefetch::move_steps(rt::PolicyContext& rt, const std::vector<int>& host) {
  // A layer going to the host leaves the GPU's main pool: a host step reads its states where they
  // rest, in pinned memory (See Note [Hybrid placement]).
  for (int layer : host) {
    if (on_host(layer)) continue;
    for (rt::TensorHandle h : rt.layer_tensors(layer, config().roles)) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, rt.info(h));
      if (info.bytes == 0 || !resident(info)) continue;
      STRATA_RETURN_IF_ERROR(rt.migrate(h, placement(info.spec)));
    }
  }
  // One host wait, between steps and during the search only: the last step's write-backs arrive
  // home, so that settle may move layers now stepped on the GPU to its main pool.
  STRATA_RETURN_IF_ERROR(rt.wait_all());
  const std::vector<int> before = std::exchange(host_layers_, host);
  parameter_layers_.reset();
  settled_ = false;
  absl::Status settled = settle(rt);
  if (settled.ok()) return absl::OkStatus();
  // The layers step where they did (the next step's settle lays them out again).
  host_layers_ = before;
  settled_ = false;
  return settled;
}

}  // namespace internal

}  // namespace strata::policy
