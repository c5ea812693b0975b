// bench/compare_rounds.h: the machinery of strata_optim_compare (bench/optim_compare.cpp): the
// samples and series it records, its JSON, the comparisons and curves the summary judges
// (tools/gpu/summarize_compare.py), and the rounds that run a comparison's approaches in
// alternation, each step after its own reference sample. The parts that use it:
// bench/compare_parts.h.
//
// Example:
//   std::vector<Approach> approaches = {strata_streamed("k1", "layer_prefetch K=1", *rig), peer};
//   STRATA_RETURN_IF_ERROR(interleave("streamed", approaches, /*rounds=*/7));
//   add_comparison("K=1 / peer", "faster", "k1", peer.id, 1.0);
//   STRATA_RETURN_IF_ERROR(write_json("compare.json"));
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/optim_common.h"

namespace strata::bench {

// One timed step and the reference sampled right before it.
struct Sample {
  double ms = 0;
  double floor_ms = 0;  // the step's bytes at the sampled reference rate (0: none)
  double ref_gbps = 0;  // link per direction (concurrent), H2D+D2H (sequential) or HBM
  std::map<std::string, double> extra;
};

struct Series {
  std::string label;
  std::vector<Sample> samples;
  std::map<std::string, double> info;
  std::string error;
};

// What the JSON carries: series by id, the comparisons the summary judges, the curves it fits.
struct Results {
  std::map<std::string, std::string> context;
  std::map<std::string, Series> series;
  std::vector<std::string> comparisons;  // JSON objects
  std::vector<std::string> curves;       // JSON objects
  bool failed = false;
};
extern Results g_results;

// The results as JSON (context, series, comparisons, curves).
absl::Status write_json(const std::string& path);

// A comparison the summary judges. kind "faster": a's ms over b's, round by round (paired), PASS
// when every round's ratio is below `goal` (1: a faster), FAIL when every one is above it;
// "floor": a's ms over its floor, PASS when every round is at most `goal`; "fraction": a's floor
// over its ms (the fraction of the reference reached), PASS when every round reaches `goal`.
// `floor` names the sample field "floor" divides by: floor_ms, or one of the sample's extras.
void add_comparison(std::string_view name, std::string_view kind, std::string_view a,
                    std::string_view b, double goal, std::string_view floor = "floor_ms");

// A curve: the series `ids` at x values `xs`, y = "ms" or "ms_over_floor"; the summary fits a
// line (with x in moment bytes, its slope is compared with the link's).
void add_curve(std::string_view name, std::string_view x_label, const std::vector<std::string>& ids,
               const std::vector<double>& xs, std::string_view y, std::string_view note);

// Prints the failure and marks the run failed (the binary exits non-zero).
void fail(std::string_view where, const absl::Status& s);
// fail(part): built without LibTorch, so the part has no peers to compare with.
void fail_without_torch(std::string_view part);
// A failed result check: recorded in the series (the summary judges nothing of it) and fail().
void check(std::string_view id, const absl::Status& s);

#ifdef STRATA_HAS_CUDA
// One approach in a set of rounds: its series id and a timed step (with its reference sample).
struct Approach {
  std::string id;
  std::string label;
  std::function<absl::StatusOr<Sample>()> step;
};

// kWarmupSteps untimed steps of each approach, then `rounds` rounds of one timed step each, the
// order reversed every other round so no approach always follows the same one.
absl::Status interleave(std::string_view part, std::vector<Approach>& approaches, int rounds);

// A step timed from an idle device to the device idle again, after a fresh link sample of
// `kind`; the floor moves `bytes_each_way`.
absl::StatusOr<Sample> offloaded_sample(LinkFloor::Kind kind, double bytes_each_way,
                                        const std::function<absl::Status()>& step);

// The floor counts `bytes_each_way` in each direction: a step that moved less (a layer kept
// resident) or more (another role) is judged against the wrong floor, and is an error.
absl::Status check_moved(const rt::RuntimeStats& before, const rt::RuntimeStats& after,
                         double bytes_each_way);

// A streamed strata step with what the runtime says about it: how long the host took to queue it
// (host_ms: Adam::step returning; the rest of ms is the device finishing), its host waits and the
// compute stream's waits for copies.
Approach strata_streamed(std::string id, std::string label, StrataRig& r);

// The rig (strata's or a peer's), or nullptr after fail(what).
template <typename R>
std::unique_ptr<R> must(absl::StatusOr<std::unique_ptr<R>> made, std::string_view what) {
  if (!made.ok()) {
    fail(what, made.status());
    return nullptr;
  }
  return std::move(*made);
}

// Frees what LibTorch cached, so the next part starts with the GPU and pinned memory free.
void empty_caches();
#endif  // STRATA_HAS_CUDA

}  // namespace strata::bench
