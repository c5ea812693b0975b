#include "runtime/step_costs.h"

#include <cstdio>

namespace strata::rt {

std::string describe(const StepRates& r) {
  char line[400];
  int n = std::snprintf(line, sizeof(line),
                        "link %.1f/%.1f GB/s host to GPU/GPU to host (%.1f each way both at once; "
                        "%.1f/%.1f while host Adam runs), host Adam %.2f G params/s on %d threads "
                        "while the link copies (%.2f alone), host memory %.1f GB/s",
                        r.link_h2d_gbps, r.link_d2h_gbps, r.link_both_gbps, r.link_h2d_loaded_gbps,
                        r.link_d2h_loaded_gbps, r.host_params_per_s / 1e9, r.host_threads,
                        r.host_params_per_s_alone / 1e9, r.host_memory_gbps);
  std::string out(line, n > 0 ? static_cast<std::size_t>(n) : 0);
  if (r.gpu_params_per_s > 0) {
    std::snprintf(line, sizeof(line), ", GPU Adam %.1f G params/s", r.gpu_params_per_s / 1e9);
    out += line;
  }
  return out;
}

}  // namespace strata::rt
