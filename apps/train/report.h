// apps/train/report.h: what strata-train prints and writes: progress lines, the summary table,
// the comparison across runs, the JSON file and the SVG chart.
//
// Example:
//   Report report{.options = options, .device = "simulated device (CPU)", .runs = {result}};
//   report.comparison = compare_runs(report.runs);
//   std::printf("%s", summary_table(report).c_str());
//   absl::Status s = write_file("out.json", to_json(report));
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "apps/train/train.h"

namespace strata::apps {

struct Comparison {
  // strata runs that trained, whose losses were compared bitwise
  std::vector<std::string> compared;
  // true when at least two strata runs trained and every step's loss is bitwise equal across them
  bool losses_identical = false;
  // largest |loss difference| at any step between a strata run and PyTorch's resident AdamW run;
  // negative when there is nothing to compare with
  double max_loss_diff_vs_torch = -1;
};

struct Report {
  TrainOptions options;
  std::string device;  // "NVIDIA H200", "simulated device (CPU)"
  bool compare = false;
  std::vector<RunResult> runs;
  Comparison comparison;
};

Comparison compare_runs(const std::vector<RunResult>& runs);

// Median over the steps after the first (which pays one-time costs); the only step if just one.
double median_step_ms(const RunResult& run);
double median_optimizer_ms(const RunResult& run);
std::int64_t peak_gpu_bytes(const RunResult& run);
// strata's own GPU memory (its GPU tier and staging ring) at its peak, setup included: what the GPU
// budget bounds.
std::int64_t peak_strata_gpu_bytes(const RunResult& run);

std::string progress_line(const RunResult& run, const StepRecord& step, int total_steps);
// "float32", "bfloat16", "float16"
std::string dtype_name(torch::Dtype dtype);
// What a phase switch freed and cost, against the link floor of its bytes where it was measured.
std::string phase_switch_line(const RunResult& run, const PhaseSwitchRecord& s);
// One row per run: status, final loss, median step and optimizer times, traffic, peak GPU memory.
std::string summary_table(const Report& report);
std::string to_json(const Report& report);
// Two panels, median step time and peak GPU memory, one bar per run; failed runs are marked.
std::string to_svg(const Report& report);

[[nodiscard]] absl::Status write_file(const std::string& path, std::string_view contents);

}  // namespace strata::apps
