// bench/step_rates_main.cpp: strata_step_rates measures the rates that bound an optimizer step
// split between the GPU and the host on this machine (See Note [Measuring the step's rates] in
// optim/step_rates.h) and prints what the hybrid cost model (See Note [Hybrid cost model] in
// policies/step_cost_model.h) predicts from them for a model of equal layers: the streamed step
// (every layer's states over the link), the best split, and a few forced splits; in float32 and in
// bfloat16 with float32 masters.
//
//   strata_step_rates [--threads=16] [--layers=24] [--params=939524096] [--adam_params=67108864]
//                     [--json=rates.json]
//                     [--state_dtype=int8]   (the Adam kernels' rates with moments stored so)
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/status.h"
#include "optim/state_decl.h"
#include "optim/step_rates.h"
#include "policies/builtin.h"
#include "policies/step_cost_model.h"
#include "runtime/runtime.h"

namespace strata {
namespace {

struct Args {
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  int layers = 24;
  std::int64_t params = 939524096;  // the users' script: 24 blocks of 4096 x 4096 x 2 + biases
  std::int64_t adam_params = 0;     // the host kernel's run (0: MeasureOptions' default)
  std::string json;
  optim::StateType moments = optim::StateType::kF32;
};

bool take(std::string_view arg, std::string_view name, std::string* value) {
  if (arg.substr(0, name.size()) != name) return false;
  *value = std::string(arg.substr(name.size()));
  return true;
}

struct Precision {
  const char* name;
  double state_bytes, grad_bytes, param_bytes;
};

std::string prediction_json(const policy::StepPrediction& p) {
  char line[300];
  std::snprintf(line, sizeof(line),
                "{\"ms\": %.3f, \"link_ms\": %.3f, \"host_ms\": %.3f, \"gpu_ms\": %.3f, "
                "\"bound\": \"%s\", \"host_params\": %lld}",
                p.seconds * 1e3, p.link_s * 1e3, p.host_s * 1e3, p.gpu_s * 1e3, p.bound.c_str(),
                static_cast<long long>(p.host_params));
  return line;
}

int run(const Args& args) {
  rt::RuntimeOptions options;
  options.policy = "keep_on_gpu";
  absl::StatusOr<std::unique_ptr<rt::Runtime>> runtime =
      rt::Runtime::create(std::move(options), policy::builtin_policies());
  if (!runtime.ok()) {
    std::fprintf(stderr, "strata_step_rates: %s\n", runtime.status().ToString().c_str());
    return 1;
  }
  ThreadPool pool(args.threads);
  optim::MeasureOptions measure{.moments = args.moments};
  if (args.adam_params > 0) measure.adam_params = args.adam_params;
  absl::StatusOr<rt::StepRates> rates = optim::measure_step_rates(**runtime, pool, measure);
  if (!rates.ok()) {
    std::fprintf(stderr, "strata_step_rates: %s\n", rates.status().ToString().c_str());
    return 1;
  }
  std::printf("device: %s\nrates: %s\n", (*runtime)->device().name().c_str(),
              rt::describe(*rates).c_str());
  std::string json = "{\"device\": \"" + (*runtime)->device().name() + "\", \"rates\": {";
  char field[400];
  std::snprintf(field, sizeof(field),
                "\"link_h2d_gbps\": %.2f, \"link_d2h_gbps\": %.2f, \"link_both_gbps\": %.2f, "
                "\"host_params_per_s\": %.4g, \"link_h2d_loaded_gbps\": %.2f, "
                "\"link_d2h_loaded_gbps\": %.2f, \"host_params_per_s_alone\": %.4g, ",
                rates->link_h2d_gbps, rates->link_d2h_gbps, rates->link_both_gbps,
                rates->host_params_per_s, rates->link_h2d_loaded_gbps, rates->link_d2h_loaded_gbps,
                rates->host_params_per_s_alone);
  json += field;
  std::snprintf(field, sizeof(field),
                "\"host_memory_gbps\": %.2f, \"gpu_params_per_s\": %.4g, \"host_threads\": %d}, "
                "\"layers\": %d, \"params\": %lld, \"models\": [",
                rates->host_memory_gbps, rates->gpu_params_per_s, rates->host_threads, args.layers,
                static_cast<long long>(args.params));
  json += field;
  // A float32 parameter stepped on the host keeps a float32 master there (as peers do), so both
  // precisions move their parameter's dtype each way on the host path.
  const Precision precisions[] = {{"float32", 8, 4, 4}, {"bfloat16 + float32 masters", 12, 2, 2}};
  bool first_model = true;
  for (const Precision& p : precisions) {
    std::vector<policy::LayerCost> layers;
    for (int l = 0; l < args.layers; ++l) {
      layers.push_back({.layer = l,
                        .params = args.params / args.layers,
                        .state_bytes = p.state_bytes,
                        .grad_bytes = p.grad_bytes,
                        .param_bytes = p.param_bytes});
    }
    std::printf("\n%s, %d layers of %lld parameters:\n", p.name, args.layers,
                static_cast<long long>(args.params / args.layers));
    json += std::string(first_model ? "" : ", ") + "{\"precision\": \"" + p.name + "\", ";
    first_model = false;
    absl::StatusOr<policy::HybridSplit> best = policy::choose_split(*rates, layers, std::nullopt);
    if (!best.ok()) {
      std::fprintf(stderr, "strata_step_rates: %s\n", best.status().ToString().c_str());
      return 1;
    }
    std::printf("  %s\n", policy::describe(*best).c_str());
    json += "\"streamed\": " + prediction_json(best->all_gpu) +
            ", \"best\": " + prediction_json(best->predicted) + ", \"forced\": [";
    bool first = true;
    for (double f : {0.0, 0.25, 0.5, 0.75}) {
      absl::StatusOr<policy::HybridSplit> forced = policy::choose_split(*rates, layers, f);
      if (!forced.ok()) return 1;
      std::printf("  gpu_fraction %.2f: %s\n", f, policy::describe(*forced).c_str());
      std::snprintf(field, sizeof(field),
                    "%s{\"gpu_fraction\": %.2f, \"prediction\": ", first ? "" : ", ", f);
      json += field + prediction_json(forced->predicted) + "}";
      first = false;
    }
    json += "]}";
  }
  json += "]}\n";
  if (!args.json.empty()) {
    std::FILE* f = std::fopen(args.json.c_str(), "w");
    if (f == nullptr || std::fputs(json.c_str(), f) < 0 || std::fclose(f) != 0) {
      std::fprintf(stderr, "strata_step_rates: cannot write %s\n", args.json.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  strata::Args args;
  for (int i = 1; i < argc; ++i) {
    std::string value;
    const std::string_view arg = argv[i];
    if (strata::take(arg, "--threads=", &value)) {
      args.threads = std::atoi(value.c_str());
    } else if (strata::take(arg, "--layers=", &value)) {
      args.layers = std::atoi(value.c_str());
    } else if (strata::take(arg, "--params=", &value)) {
      args.params = std::atoll(value.c_str());
    } else if (strata::take(arg, "--adam_params=", &value)) {
      args.adam_params = std::atoll(value.c_str());
    } else if (strata::take(arg, "--json=", &value)) {
      args.json = value;
    } else if (strata::take(arg, "--state_dtype=", &value)) {
      absl::StatusOr<strata::optim::StateType> t = strata::optim::parse_state_dtype(value);
      if (!t.ok()) {
        std::fprintf(stderr, "strata_step_rates: %s\n", std::string(t.status().message()).c_str());
        return 2;
      }
      args.moments = *t;
    } else {
      std::fprintf(stderr,
                   "usage: strata_step_rates [--threads=N] [--layers=N] [--params=N] "
                   "[--adam_params=N] [--json=path] [--state_dtype=float32|bfloat16|int8]\n");
      return 2;
    }
  }
  if (args.threads < 1 || args.layers < 1 || args.params < args.layers) {
    std::fprintf(stderr, "strata_step_rates: threads, layers and params must be positive\n");
    return 2;
  }
  return strata::run(args);
}
