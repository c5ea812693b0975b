#include "policies/step_cost_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <utility>

#include "base/status.h"
#include "base/strings.h"

namespace strata::policy {
namespace {

constexpr double kBytesPerGb = 1e9;

absl::Status check_rate(const char* name, double rate, bool zero_allowed) {
  bool ok = std::isfinite(rate) && (zero_allowed ? rate >= 0 : rate > 0);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(str_cat("hybrid cost model: ", name, " must be ",
                                            zero_allowed ? "0 or more" : "positive",
                                            " and finite, got ", rate));
}

absl::Status check_bytes(const LayerCost& l, const char* name, double bytes) {
  if (std::isfinite(bytes) && bytes >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(str_cat("hybrid cost model: layer ", l.layer, "'s ", name,
                                            " must be 0 or more and finite, got ", bytes));
}

// Link bytes a parameter saves when its layer is stepped on the host.
double host_savings(const LayerCost& l) { return 2 * l.state_bytes - l.grad_bytes - l.param_bytes; }

// Seconds the link takes for h2d and d2h bytes with no host work (See Note [Hybrid cost model]):
// overlapped while both directions copy, the rest alone.
double link_seconds(const StepRates& r, double h2d, double d2h) {
  const double both = std::min(h2d, d2h);
  const double alone = std::max(h2d, d2h) - both;
  const double alone_gbps = h2d > d2h ? r.link_h2d_gbps : r.link_d2h_gbps;
  double s = both / (r.link_both_gbps * kBytesPerGb);
  if (alone > 0) s += alone / (alone_gbps * kBytesPerGb);
  return s;
}

// The same while the host kernel runs for `host_s` seconds: each direction at its loaded rate
// until then, the rest as link_seconds has it.
double link_seconds_beside_host(const StepRates& r, double h2d, double d2h, double host_s) {
  if (host_s <= 0) return link_seconds(r, h2d, d2h);
  const double h2d_rate = r.link_h2d_loaded_gbps * kBytesPerGb;
  const double d2h_rate = r.link_d2h_loaded_gbps * kBytesPerGb;
  const double h2d_left = std::max(0.0, h2d - h2d_rate * host_s);
  const double d2h_left = std::max(0.0, d2h - d2h_rate * host_s);
  if (h2d_left == 0 && d2h_left == 0) return std::max(h2d / h2d_rate, d2h / d2h_rate);
  return host_s + link_seconds(r, h2d_left, d2h_left);
}

}  // namespace

std::vector<std::size_t> host_order(const std::vector<LayerCost>& layers) {
  std::vector<std::size_t> order(layers.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    double sa = host_savings(layers[a]);
    double sb = host_savings(layers[b]);
    if (sa != sb) return sa > sb;
    if (layers[a].layer != layers[b].layer) return layers[a].layer > layers[b].layer;
    return a < b;
  });
  return order;
}

absl::Status validate_cost_inputs(const StepRates& rates, const std::vector<LayerCost>& layers) {
  STRATA_RETURN_IF_ERROR(check_rate("link_h2d_gbps", rates.link_h2d_gbps, false));
  STRATA_RETURN_IF_ERROR(check_rate("link_d2h_gbps", rates.link_d2h_gbps, false));
  STRATA_RETURN_IF_ERROR(check_rate("link_both_gbps", rates.link_both_gbps, false));
  STRATA_RETURN_IF_ERROR(check_rate("host_params_per_s", rates.host_params_per_s, false));
  STRATA_RETURN_IF_ERROR(check_rate("link_h2d_loaded_gbps", rates.link_h2d_loaded_gbps, false));
  STRATA_RETURN_IF_ERROR(check_rate("link_d2h_loaded_gbps", rates.link_d2h_loaded_gbps, false));
  STRATA_RETURN_IF_ERROR(check_rate("gpu_params_per_s", rates.gpu_params_per_s, true));
  for (const LayerCost& l : layers) {
    if (l.params < 0) {
      return absl::InvalidArgumentError(str_cat("hybrid cost model: layer ", l.layer,
                                                " has a negative parameter count, ", l.params));
    }
    STRATA_RETURN_IF_ERROR(check_bytes(l, "state_bytes", l.state_bytes));
    STRATA_RETURN_IF_ERROR(check_bytes(l, "grad_bytes", l.grad_bytes));
    STRATA_RETURN_IF_ERROR(check_bytes(l, "param_bytes", l.param_bytes));
  }
  return absl::OkStatus();
}

StepPrediction predict(const StepRates& rates, const std::vector<LayerCost>& layers,
                       const std::vector<bool>& on_host) {
  STRATA_CHECK(on_host.size() == layers.size(), "on_host has ", on_host.size(), " entries for ",
               layers.size(), " layers");
  StepPrediction p;
  double h2d = 0;
  double d2h = 0;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const LayerCost& l = layers[i];
    double n = static_cast<double>(l.params);
    if (on_host[i]) {
      h2d += n * l.param_bytes;
      d2h += n * l.grad_bytes;
      p.host_params += l.params;
    } else {
      h2d += n * l.state_bytes;
      d2h += n * l.state_bytes;
      p.gpu_params += l.params;
    }
  }
  p.host_s = static_cast<double>(p.host_params) / rates.host_params_per_s;
  p.link_s = link_seconds_beside_host(rates, h2d, d2h, p.host_s);
  p.gpu_s =
      rates.gpu_params_per_s > 0 ? static_cast<double>(p.gpu_params) / rates.gpu_params_per_s : 0.0;
  p.seconds = p.link_s;
  p.bound = "link";
  const std::pair<double, const char*> others[] = {{p.host_s, "host"}, {p.gpu_s, "gpu"}};
  for (const auto& [seconds, name] : others) {
    if (seconds > p.seconds) {
      p.seconds = seconds;
      p.bound = name;
    }
  }
  return p;
}

absl::StatusOr<HybridSplit> choose_split(const StepRates& rates,
                                         const std::vector<LayerCost>& layers,
                                         std::optional<double> forced_fraction) {
  if (forced_fraction.has_value() &&
      !(*forced_fraction >= 0.0 && *forced_fraction <= 1.0)) {  // NaN fails both
    return absl::InvalidArgumentError(
        str_cat("hybrid cost model: the forced fraction of parameters stepped on the GPU must be "
                "in [0, 1], got ",
                *forced_fraction));
  }
  STRATA_RETURN_IF_ERROR(validate_cost_inputs(rates, layers));

  HybridSplit split;
  split.on_host.assign(layers.size(), false);
  split.all_gpu = predict(rates, layers, split.on_host);
  split.predicted = split.all_gpu;
  std::int64_t total = split.all_gpu.gpu_params;
  if (layers.empty()) return split;

  // Every prefix of the order, from none on the host to all; the first of the best is kept, so
  // equal predictions go to fewer host layers. Each prefix is predicted from scratch (quadratic in
  // the layers, once at setup) so that `predicted` is exactly what predict gives for `on_host`.
  const std::vector<std::size_t> order = host_order(layers);
  const double target =
      forced_fraction.has_value() ? (1.0 - *forced_fraction) * static_cast<double>(total) : 0.0;
  std::vector<bool> prefix(layers.size(), false);
  std::size_t best_k = 0;
  double best_score = forced_fraction.has_value() ? target : split.all_gpu.seconds;
  std::int64_t host_params = 0;
  for (std::size_t k = 1; k <= order.size(); ++k) {
    prefix[order[k - 1]] = true;
    host_params += layers[order[k - 1]].params;
    double score = forced_fraction.has_value() ? std::abs(static_cast<double>(host_params) - target)
                                               : predict(rates, layers, prefix).seconds;
    if (score < best_score) {
      best_score = score;
      best_k = k;
    }
  }
  for (std::size_t k = 0; k < best_k; ++k) split.on_host[order[k]] = true;
  split.predicted = predict(rates, layers, split.on_host);
  split.gpu_fraction =
      total > 0 ? static_cast<double>(split.predicted.gpu_params) / static_cast<double>(total)
                : 1.0;
  return split;
}

std::string describe(const HybridSplit& split) {
  const int host_layers =
      static_cast<int>(std::count(split.on_host.begin(), split.on_host.end(), true));
  char line[256];
  std::snprintf(line, sizeof(line),
                "hybrid: %d of %zu layers (%.1f%% of parameters) stepped on the host; "
                "predicted %.1f ms (bound: %s) against %.1f ms streamed",
                host_layers, split.on_host.size(), 100.0 * (1.0 - split.gpu_fraction),
                split.predicted.seconds * 1e3, split.predicted.bound.c_str(),
                split.all_gpu.seconds * 1e3);
  std::string out(line);
  if (split.all_gpu.seconds > 0) {
    std::snprintf(line, sizeof(line), " (%.2fx)", split.predicted.seconds / split.all_gpu.seconds);
    out += line;
  }
  return out;
}

}  // namespace strata::policy
