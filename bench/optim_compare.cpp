// bench/optim_compare.cpp: strata's optimizer step and its peers in alternation, and how its cost
// grows. Where strata_optim_bench runs one approach after another (Google Benchmark), this runs
// the approaches of each comparison in rounds, A B A B ... (the order reversed every other round),
// each step with its own reference sampled right before it: raw pinned link passes for offloaded
// steps (See Note [Adjacent floor] in bench/link_rig.h), a 2 GiB device-to-device copy for resident
// ones. tools/gpu/summarize_compare.py turns the samples into median, min and max, a verdict per
// comparison (PASS / FAIL / WITHIN NOISE: only a difference larger than the spread of the rounds
// is a verdict), fits and SVG plots.
//
// Parts (--parts=a,b,...; all by default):
//   resident    strata keep_on_gpu against at::_fused_adamw_, everything on the GPU (full model);
//               the fraction of HBM bandwidth each reaches.
//   streamed    layer_prefetch K=1 against the LibTorch per-layer pipeline with 2 GPU slots and
//               against torch's fused AdamW on the CPU over the whole model (torch.optim.AdamW(
//               fused=True) on CPU tensors); K=2 against the pipeline with 3 slots.
//   bulk        bulk (reload_all, step, offload_all) against the PyTorch .to() round trip, with
//               offload_all giving the GPU memory back to the driver (the default) and keeping it
//               cached; offload_all + reload_all alone, with expandable and with fixed segments;
//               the GPU tier's mapping and unmapping time in each sample.
//   bytes       layer_prefetch K=1 over 2, 4, 8, 16, 32 layers of the full model's layer (0.77 to
//               12.3 GB of moments each way).
//   layers      layer_prefetch K=1 over 128e6 parameters in 8, 32, 128, 512 layers of one tensor.
//   tensors     layer_prefetch K=1 and the LibTorch pipeline over 100 layers of 100 tensors of
//               4 KiB .. 1 MiB (10^4 tensors) and over the same layers as one tensor each.
//   mixed       bfloat16 parameters with float32 masters and moments (bench/compare_mixed.cpp):
//               strata keep_on_gpu against PyTorch's fused AdamW over float32 masters;
//               layer_prefetch K=1 and K=2 streaming masters and moments against PyTorch's
//               per-layer pipeline with pinned states at 2 and 3 slots, each step judged against
//               its link floor and a floor over its own pinned buffers.
//   first_step  from nothing to the end of the first step, and the host memory it took (RSS,
//               pinned reserved and held), for strata layer_prefetch K=1, the LibTorch pipeline
//               and torch's CPU AdamW, at 2 .. 32 layers.
// Every approach's result is checked against a host AdamW after its rounds (bench/optim_common.h),
// so a fast but wrong step fails the run.
//
// Run (needs a GPU; without one it writes a JSON that says so and exits 0):
//   build/bin/strata_optim_compare --out=compare.json [--rounds=7] [--parts=resident,streamed]
//   python3 tools/gpu/summarize_compare.py compare.json --svg-dir=DIR
//
// Each part is a file of its own (bench/compare_parts.h) over the rounds and results of
// bench/compare_rounds.h; this file reads the flags, measures the link once and runs the parts.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/strings.h"
#include "bench/compare_parts.h"
#include "bench/compare_rounds.h"
#include "bench/optim_common.h"

#ifdef STRATA_BENCH_TORCH
#include <ATen/Parallel.h>
#endif

namespace {

using namespace strata::bench;  // NOLINT: the benchmark's whole vocabulary
using strata::str_cat;

std::string flag_value(std::string_view arg, std::string_view name) {
  if (arg.substr(0, name.size()) == name) return std::string(arg.substr(name.size()));
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  std::string out = "optim_compare.json";
  int rounds = 7;
  std::set<std::string> parts = {"resident", "streamed", "bulk",       "bytes",
                                 "layers",   "tensors",  "first_step", "mixed"};
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (std::string v = flag_value(arg, "--out="); !v.empty()) {
      out = v;
    } else if (std::string v = flag_value(arg, "--rounds="); !v.empty()) {
      rounds = std::atoi(v.c_str());
      if (rounds < 1) {
        std::fprintf(stderr, "--rounds must be at least 1, got %s\n", v.c_str());
        return 2;
      }
    } else if (std::string v = flag_value(arg, "--parts="); !v.empty()) {
      std::set<std::string> chosen;
      std::stringstream ss(v);
      for (std::string p; std::getline(ss, p, ',');) {
        if (parts.count(p) == 0) {
          std::fprintf(stderr,
                       "unknown part '%s' (resident, streamed, bulk, bytes, layers, "
                       "tensors, first_step, mixed)\n",
                       p.c_str());
          return 2;
        }
        chosen.insert(p);
      }
      parts = chosen;
    } else {
      std::fprintf(stderr,
                   "usage: strata_optim_compare [--out=FILE.json] [--rounds=N] "
                   "[--parts=resident,streamed,bulk,bytes,layers,tensors,first_step,mixed]\n");
      return 2;
    }
  }
  g_results.context["gpu"] = strata::alloc::cuda_device_name(0);
  g_results.context["rounds"] = std::to_string(rounds);
  g_results.context["warmup_steps"] = std::to_string(kWarmupSteps);
  g_results.context["cpu_threads"] = std::to_string(std::thread::hardware_concurrency());
  g_results.context["hyper"] = "AdamW lr=1e-3 betas=(0.9,0.999) eps=1e-8 wd=0.01";
  g_results.context["method"] =
      "approaches of a comparison in rounds (order reversed every other round), each step "
      "after its own reference sample: raw pinned link passes (16 x 256 MiB per direction) for "
      "offloaded steps, a 2 GiB device-to-device copy for resident ones";
  if (!have_gpu()) {
    g_results.context["skipped"] = "no GPU";
    std::printf("no GPU: nothing measured\n");
    return write_json(out).ok() ? 0 : 1;
  }
#ifdef STRATA_HAS_CUDA
#ifdef STRATA_BENCH_TORCH
  at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
#endif
  absl::StatusOr<Bandwidths> bw = measure_bandwidths();
  if (!bw.ok()) {
    std::fprintf(stderr, "measuring the link: %s\n", bw.status().ToString().c_str());
    return 1;
  }
  g_results.context["start_hbm_gbps"] = str_cat(bw->hbm_gbps);
  g_results.context["start_link_both_per_direction_gbps"] = str_cat(bw->both_per_direction_gbps);
  const std::vector<std::pair<std::string, void (*)(int)>> all = {
      {"resident", part_resident},     {"streamed", part_streamed}, {"bulk", part_bulk},
      {"bytes", part_bytes},           {"layers", part_layers},     {"tensors", part_tensors},
      {"first_step", part_first_step}, {"mixed", part_mixed}};
  for (const auto& [name, run] : all) {
    if (parts.count(name) == 0) continue;
    std::printf("== %s\n", name.c_str());
    std::fflush(stdout);
    const Clock::time_point t0 = Clock::now();
    run(name == "first_step" ? std::min(rounds, 3) : rounds);
    g_results.context[str_cat("seconds_", name)] = str_cat(seconds_between(t0, Clock::now()));
    if (absl::Status s = write_json(out); !s.ok()) fail("writing the results", s);
  }
  release_device_sources();
  delete g_link;
  g_link = nullptr;
#endif
  return g_results.failed ? 1 : 0;
}
