// bench/compare_rounds.cpp: strata_optim_compare's rounds and results (bench/compare_rounds.h).
#include "bench/compare_rounds.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <utility>

#include "base/status.h"
#include "base/strings.h"
#include "bench/optim_torch.h"

#ifdef STRATA_BENCH_TORCH
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace strata::bench {

Results g_results;

namespace {

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out + "\"";
}

std::string json_number(double x) {
  if (!std::isfinite(x)) return "null";
  std::ostringstream o;
  o.precision(10);
  o << x;
  return o.str();
}

std::string json_map(const std::map<std::string, double>& m) {
  std::string out = "{";
  for (const auto& [k, v] : m) {
    strata::str_append(&out, out.size() > 1 ? ", " : "", json_string(k), ": ", json_number(v));
  }
  return out + "}";
}

}  // namespace

absl::Status write_json(const std::string& path) {
  std::string out = "{\n  \"context\": {";
  bool first = true;
  for (const auto& [k, v] : g_results.context) {
    strata::str_append(&out, first ? "\n" : ",\n", "    ", json_string(k), ": ", json_string(v));
    first = false;
  }
  out += "\n  },\n  \"series\": {";
  first = true;
  for (const auto& [id, s] : g_results.series) {
    strata::str_append(&out, first ? "\n" : ",\n", "    ", json_string(id),
                       ": {\"label\": ", json_string(s.label),
                       ", \"error\": ", json_string(s.error), ", \"info\": ", json_map(s.info),
                       ", \"samples\": [");
    for (std::size_t i = 0; i < s.samples.size(); ++i) {
      const Sample& x = s.samples[i];
      std::map<std::string, double> fields = x.extra;
      fields["ms"] = x.ms;
      fields["floor_ms"] = x.floor_ms;
      fields["ref_gbps"] = x.ref_gbps;
      strata::str_append(&out, i == 0 ? "" : ", ", json_map(fields));
    }
    out += "]}";
    first = false;
  }
  out += "\n  },\n  \"comparisons\": [";
  for (std::size_t i = 0; i < g_results.comparisons.size(); ++i) {
    strata::str_append(&out, i == 0 ? "\n    " : ",\n    ", g_results.comparisons[i]);
  }
  out += "\n  ],\n  \"curves\": [";
  for (std::size_t i = 0; i < g_results.curves.size(); ++i) {
    strata::str_append(&out, i == 0 ? "\n    " : ",\n    ", g_results.curves[i]);
  }
  out += "\n  ]\n}\n";
  std::ofstream f(path);
  f << out;
  if (!f) return absl::InternalError(str_cat("writing ", path, " failed"));
  return absl::OkStatus();
}

void add_comparison(std::string_view name, std::string_view kind, std::string_view a,
                    std::string_view b, double goal, std::string_view floor) {
  g_results.comparisons.push_back(
      str_cat("{\"name\": ", json_string(name), ", \"kind\": ", json_string(kind),
              ", \"a\": ", json_string(a), ", \"b\": ", json_string(b),
              ", \"goal\": ", json_number(goal), ", \"floor\": ", json_string(floor), "}"));
}

void add_curve(std::string_view name, std::string_view x_label, const std::vector<std::string>& ids,
               const std::vector<double>& xs, std::string_view y, std::string_view note) {
  std::string points = "[";
  for (std::size_t i = 0; i < ids.size(); ++i) {
    strata::str_append(&points, i == 0 ? "" : ", ", "{\"x\": ", json_number(xs[i]),
                       ", \"series\": ", json_string(ids[i]), "}");
  }
  points += "]";
  g_results.curves.push_back(str_cat("{\"name\": ", json_string(name),
                                     ", \"x_label\": ", json_string(x_label),
                                     ", \"y\": ", json_string(y), ", \"note\": ", json_string(note),
                                     ", \"points\": ", points, "}"));
}

void fail(std::string_view where, const absl::Status& s) {
  std::fprintf(stderr, "FAILED %.*s: %s\n", static_cast<int>(where.size()), where.data(),
               s.ToString().c_str());
  g_results.failed = true;
}

void fail_without_torch(std::string_view part) {
  fail(part, absl::UnimplementedError("built without LibTorch: no peers to compare with"));
}

#ifdef STRATA_HAS_CUDA

absl::Status interleave(std::string_view part, std::vector<Approach>& approaches, int rounds) {
  for (Approach& a : approaches) {
    g_results.series[a.id].label = a.label;
    for (int i = 0; i < kWarmupSteps; ++i) {
      absl::StatusOr<Sample> w = a.step();
      if (!w.ok())
        return absl::Status(w.status().code(), str_cat(a.id, " warm-up: ", w.status().message()));
    }
  }
  for (int r = 0; r < rounds; ++r) {
    std::string line = str_cat(part, " round ", r + 1, "/", rounds, ":");
    for (std::size_t i = 0; i < approaches.size(); ++i) {
      Approach& a = approaches[r % 2 == 0 ? i : approaches.size() - 1 - i];
      absl::StatusOr<Sample> s = a.step();
      if (!s.ok())
        return absl::Status(s.status().code(), str_cat(a.id, ": ", s.status().message()));
      g_results.series[a.id].samples.push_back(*s);
      char buf[96];
      std::snprintf(buf, sizeof(buf), " %s %.2f ms", a.id.c_str(), s->ms);
      line += buf;
      if (s->floor_ms > 0) {
        std::snprintf(buf, sizeof(buf), " (%.3f x)", s->ms / s->floor_ms);
        line += buf;
      }
    }
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

absl::StatusOr<Sample> offloaded_sample(LinkFloor::Kind kind, double bytes_each_way,
                                        const std::function<absl::Status()>& step) {
  LinkFloor link(kind);
  STRATA_RETURN_IF_ERROR(link.sample());
  STRATA_ASSIGN_OR_RETURN(double ms, time_to_idle(step));
  Sample s;
  s.ms = ms;
  s.floor_ms = link.floor_ms(bytes_each_way);
  s.ref_gbps = kind == LinkFloor::kConcurrent
                   ? link.per_direction_gbps()
                   : 2.0 / (1.0 / link.h2d_gbps() + 1.0 / link.d2h_gbps());
  return s;
}

absl::Status check_moved(const rt::RuntimeStats& before, const rt::RuntimeStats& after,
                         double bytes_each_way) {
  const double h2d = static_cast<double>(after.migrated_bytes_h2d - before.migrated_bytes_h2d);
  const double d2h = static_cast<double>(after.migrated_bytes_d2h - before.migrated_bytes_d2h);
  if (h2d == bytes_each_way && d2h == bytes_each_way) return absl::OkStatus();
  return absl::InternalError(str_cat("moved ", h2d, " bytes to the GPU and ", d2h,
                                     " back; the floor counts ", bytes_each_way, " each way"));
}

Approach strata_streamed(std::string id, std::string label, StrataRig& r) {
  return {std::move(id), std::move(label), [&r]() -> absl::StatusOr<Sample> {
            const rt::RuntimeStats before = r.runtime->stats();
            double host_ms = 0;
            STRATA_ASSIGN_OR_RETURN(
                Sample s, offloaded_sample(LinkFloor::kConcurrent, r.model.moment_bytes(),
                                           [&]() -> absl::Status {
                                             const Clock::time_point t0 = Clock::now();
                                             absl::Status step = r.adam->step();
                                             host_ms = seconds_between(t0, Clock::now()) * 1e3;
                                             return step;
                                           }));
            const rt::RuntimeStats after = r.runtime->stats();
            STRATA_RETURN_IF_ERROR(check_moved(before, after, r.model.moment_bytes()));
            s.extra["host_ms"] = host_ms;
            s.extra["host_syncs"] = static_cast<double>(after.host_syncs - before.host_syncs);
            s.extra["prefetch_waits"] =
                static_cast<double>(after.prefetch_waits - before.prefetch_waits);
            s.extra["prefetch_stall_ms"] =
                static_cast<double>(after.prefetch_stall_ns - before.prefetch_stall_ns) / 1e6;
            return s;
          }};
}

void empty_caches() {
  (void)cudaDeviceSynchronize();
#ifdef STRATA_BENCH_TORCH
  if (torch_used()) {
    c10::cuda::CUDACachingAllocator::emptyCache();
    at::getHostAllocator(at::kCUDA)->empty_cache();
  }
#endif
}

#endif  // STRATA_HAS_CUDA

void check(std::string_view id, const absl::Status& s) {
  if (s.ok()) return;
  g_results.series[std::string(id)].error = s.ToString();
  fail(str_cat(id, " result check"), s);
}

}  // namespace strata::bench
