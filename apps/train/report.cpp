#include "apps/train/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "base/strings.h"
#include "base/units.h"
#include "optim/state_decl.h"

namespace strata::apps {
namespace {

std::string fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  return buf;
}

// Shortest text that reads back as the same float.
std::string exact(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

// A byte count, or null where it is unknown (-1).
std::string json_bytes(std::int64_t v) { return v >= 0 ? std::to_string(v) : "null"; }

std::string json_quoted(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string xml_escaped(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

template <typename F>
double median_after_first(const RunResult& run, F field) {
  std::vector<double> v;
  for (std::size_t i = run.steps.size() > 1 ? 1 : 0; i < run.steps.size(); ++i) {
    v.push_back(field(run.steps[i]));
  }
  return median(v);
}

// The first line of an error, shortened for a table cell.
std::string short_error(const std::string& error, std::size_t width) {
  std::string line = error.substr(0, error.find('\n'));
  if (line.size() > width) line = line.substr(0, width - 3) + "...";
  return line;
}

const RunResult* find_run(const std::vector<RunResult>& runs, std::string_view name) {
  for (const RunResult& r : runs) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

}  // namespace

double median_step_ms(const RunResult& run) {
  return median_after_first(run, [](const StepRecord& s) { return s.step_ms; });
}
double median_optimizer_ms(const RunResult& run) {
  return median_after_first(run, [](const StepRecord& s) { return s.optimizer_ms; });
}
std::int64_t peak_gpu_bytes(const RunResult& run) {
  std::int64_t peak = 0;
  for (const StepRecord& s : run.steps) peak = std::max(peak, s.peak_gpu_bytes);
  return peak;
}
std::int64_t peak_strata_gpu_bytes(const RunResult& run) {
  std::int64_t peak = run.setup_gpu_bytes;
  for (const StepRecord& s : run.steps) peak = std::max(peak, s.strata_gpu_bytes);
  return peak;
}

Comparison compare_runs(const std::vector<RunResult>& runs) {
  Comparison c;
  const RunResult* first = nullptr;
  bool identical = true;
  for (const RunResult& r : runs) {
    if (!r.strata || !r.ok) continue;
    c.compared.push_back(r.name);
    if (first == nullptr) {
      first = &r;
      continue;
    }
    identical = identical && r.steps.size() == first->steps.size();
    for (std::size_t i = 0; identical && i < r.steps.size(); ++i) {
      identical = std::memcmp(&r.steps[i].loss, &first->steps[i].loss, sizeof(float)) == 0;
    }
  }
  c.losses_identical = c.compared.size() >= 2 && identical;
  const RunResult* torch = find_run(runs, baseline_name(TorchBaseline::kResident));
  if (torch != nullptr && torch->ok) {
    for (const RunResult& r : runs) {
      if (!r.strata || !r.ok) continue;
      for (std::size_t i = 0; i < r.steps.size() && i < torch->steps.size(); ++i) {
        const double d = std::fabs(static_cast<double>(r.steps[i].loss) - torch->steps[i].loss);
        c.max_loss_diff_vs_torch = std::max(c.max_loss_diff_vs_torch, d);
      }
    }
  }
  return c;
}

std::string progress_line(const RunResult& run, const StepRecord& s, int total_steps) {
  std::string line =
      str_cat("[", run.name, "] step ", s.step, "/", total_steps, "  loss ", fixed(s.loss, 4),
              "  step ", fixed(s.step_ms, 1), " ms  optim ", fixed(s.optimizer_ms, 1), " ms");
  if (s.grad_norm > 0) str_append(&line, "  norm ", fixed(s.grad_norm, 3));
  if (s.redone) str_append(&line, " (step redone)");
  if (s.loss_scale != 1.0f)
    str_append(&line, "  scale ", s.loss_scale, s.skipped ? " (skipped)" : "");
  if (run.strata || s.h2d_bytes + s.d2h_bytes > 0) {
    str_append(&line, "  H2D ", format_bytes(s.h2d_bytes), " D2H ", format_bytes(s.d2h_bytes));
  }
  if (run.strata) {
    str_append(&line, "  link ", fixed(s.h2d_gbps, 1), "/", fixed(s.d2h_gbps, 1), " GB/s",
               "  waited ", fixed(s.waited_ms, 2), " ms");
  }
  if (s.host_kernel_ms > 0) {
    str_append(&line, "  host queued/waited/kernel ", fixed(s.host_queued_ms, 1), "/",
               fixed(s.host_waited_ms, 1), "/", fixed(s.host_kernel_ms, 1), " ms");
  }
  if (s.peak_gpu_bytes > 0) str_append(&line, "  peak GPU ", format_bytes(s.peak_gpu_bytes));
  if (run.strata) {
    str_append(&line, "  frag gpu/pinned/pageable ", fixed(s.fragmentation[0], 3), "/",
               fixed(s.fragmentation[1], 3), "/", fixed(s.fragmentation[2], 3));
  }
  return line;
}

std::string dtype_name(torch::Dtype dtype) {
  return dtype == torch::kBFloat16 ? "bfloat16" : dtype == torch::kHalf ? "float16" : "float32";
}

std::string phase_switch_line(const RunResult& run, const PhaseSwitchRecord& s) {
  std::string line =
      str_cat("[", run.name, "] phase switch after step ", s.after_step, ": offload ",
              fixed(s.offload_ms, 1), " ms (", format_bytes(s.offloaded_bytes), ")");
  if (s.offload_floor_ms > 0) {
    str_append(&line, " = ", fixed(s.offload_ms / s.offload_floor_ms, 3), " x its link floor");
    if (s.cuda_free_ms > 0) {
      str_append(&line, ", ", fixed(s.offload_ms / (s.offload_floor_ms + s.cuda_free_ms), 3),
                 " x floor + frees (", fixed(s.cuda_free_ms, 1), " ms)");
    }
  }
  str_append(&line, ", reload ", fixed(s.reload_ms, 1), " ms (", format_bytes(s.reloaded_bytes),
             ")");
  if (s.reload_floor_ms > 0) {
    str_append(&line, " = ", fixed(s.reload_ms / s.reload_floor_ms, 3), " x");
    if (s.cuda_malloc_ms > 0) {
      str_append(&line, ", ", fixed(s.reload_ms / (s.reload_floor_ms + s.cuda_malloc_ms), 3),
                 " x floor + allocations (", fixed(s.cuda_malloc_ms, 1), " ms)");
    }
  }
  // The measure of a switch: both directions against their link floors, the time spent
  // taking GPU memory from the driver set aside (the frees are inside the offload's time: they
  // hide behind its copies on virtual memory).
  if (s.offload_floor_ms > 0 && s.reload_floor_ms > 0) {
    const double total = s.offload_ms + s.reload_ms;
    str_append(&line, "; the whole switch ", fixed(total, 1), " ms = ",
               fixed((total - s.cuda_malloc_ms) / (s.offload_floor_ms + s.reload_floor_ms), 3),
               " x its link floor, allocations aside");
  }
  str_append(&line, "; GPU memory ", format_bytes(s.gpu_bytes_before_offload), " -> ",
             format_bytes(s.gpu_reserved_after_offload_bytes));
  if (s.driver_freed_bytes >= 0) {
    str_append(&line, ", the driver saw ", format_bytes(s.driver_freed_bytes), " freed");
  }
  str_append(&line, "; rollout stand-in took ", format_bytes(s.rollout_stand_in_bytes));
  if (run.strata) str_append(&line, "; pinned allocations ", s.pinned_allocations);
  return line;
}

std::string summary_table(const Report& report) {
  char row[512];
  std::string out;
  std::snprintf(row, sizeof(row), "%-22s %-6s %12s %12s %12s %12s %12s %12s %12s\n", "run",
                "status", "final loss", "step ms", "optim ms", "H2D/step", "D2H/step", "peak GPU",
                "peak host");
  out += row;
  out += std::string(std::strlen(row) - 1, '-') + "\n";
  for (const RunResult& r : report.runs) {
    if (!r.ok) {
      std::snprintf(row, sizeof(row), "%-22s %-6s %s\n", r.name.c_str(), "FAILED",
                    short_error(r.error, 88).c_str());
      out += row;
      continue;
    }
    const StepRecord& last = r.steps.back();
    const std::string peak =
        peak_gpu_bytes(r) > 0 ? format_bytes(peak_gpu_bytes(r)) : std::string("n/a (CPU)");
    // The process's resident set at its peak during the run (other runs' leftovers included).
    const std::string host =
        r.peak_host_rss_bytes >= 0 ? format_bytes(r.peak_host_rss_bytes) : std::string("n/a");
    std::snprintf(row, sizeof(row), "%-22s %-6s %12s %12s %12s %12s %12s %12s %12s\n",
                  r.name.c_str(), "ok", fixed(last.loss, 6).c_str(),
                  fixed(median_step_ms(r), 2).c_str(), fixed(median_optimizer_ms(r), 2).c_str(),
                  format_bytes(last.h2d_bytes).c_str(), format_bytes(last.d2h_bytes).c_str(),
                  peak.c_str(), host.c_str());
    out += row;
  }
  if (report.options.phase_switch_every > 0) {
    str_append(&out, "\nphase switches every ", report.options.phase_switch_every,
               " steps (median over each run's switches):\n");
    for (const RunResult& r : report.runs) {
      if (!r.ok || r.phase_switches.empty()) continue;
      auto median = [&](auto field) {
        std::vector<double> v;
        for (const PhaseSwitchRecord& s : r.phase_switches) v.push_back(field(s));
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
      };
      const double off = median([](const PhaseSwitchRecord& s) { return s.offload_ms; });
      const double on = median([](const PhaseSwitchRecord& s) { return s.reload_ms; });
      const double left = median([](const PhaseSwitchRecord& s) {
        return static_cast<double>(s.gpu_reserved_after_offload_bytes);
      });
      char line[256];
      std::snprintf(line, sizeof(line),
                    "  %-22s offload %10s ms  reload %10s ms  GPU memory left %12s\n",
                    r.name.c_str(), fixed(off, 2).c_str(), fixed(on, 2).c_str(),
                    format_bytes(static_cast<std::int64_t>(left)).c_str());
      out += line;
    }
  }
  if (report.compare) {
    const Comparison& c = report.comparison;
    std::string names;
    for (const std::string& n : c.compared) str_append(&names, names.empty() ? "" : ", ", n);
    if (c.compared.size() < 2) {
      str_append(&out, "\nlosses not compared: ",
                 c.compared.empty() ? std::string("no strata policy trained")
                                    : str_cat("only one strata policy trained (", names, ")"),
                 "; a comparison needs two\n");
    } else {
      str_append(&out, "\nlosses identical across strata policies (", names,
                 "): ", c.losses_identical ? "yes, bitwise" : "NO", "\n");
    }
    if (c.max_loss_diff_vs_torch >= 0) {
      str_append(&out,
                 "largest loss difference from PyTorch's AdamW: ", exact(c.max_loss_diff_vs_torch),
                 "\n");
    }
  }
  return out;
}

namespace {

// The rates a placement was made from, as strata_step_rates writes them; null without one.
std::string rates_json(const std::optional<rt::StepRates>& r) {
  if (!r) return "null";
  return str_cat("{\"link_h2d_gbps\": ", exact(r->link_h2d_gbps),
                 ", \"link_d2h_gbps\": ", exact(r->link_d2h_gbps),
                 ", \"link_both_gbps\": ", exact(r->link_both_gbps),
                 ", \"host_params_per_s\": ", exact(r->host_params_per_s),
                 ", \"link_h2d_loaded_gbps\": ", exact(r->link_h2d_loaded_gbps),
                 ", \"link_d2h_loaded_gbps\": ", exact(r->link_d2h_loaded_gbps),
                 ", \"host_params_per_s_alone\": ", exact(r->host_params_per_s_alone),
                 ", \"host_memory_gbps\": ", exact(r->host_memory_gbps),
                 ", \"gpu_params_per_s\": ", exact(r->gpu_params_per_s),
                 ", \"host_threads\": ", r->host_threads, "}");
}

}  // namespace

// Written top to bottom as the document reads (longer than a screen on purpose).
std::string to_json(const Report& report) {
  const TrainOptions& o = report.options;
  const bool budget = o.gpu_budget != static_cast<std::size_t>(-1);
  std::string j = "{\n";
  str_append(&j, "  \"device\": ", json_quoted(report.device), ",\n");
  str_append(
      &j, "  \"config\": {\"vocab\": ", o.model.vocab, ", \"d_model\": ", o.model.d_model,
      ", \"heads\": ", o.model.heads, ", \"layers\": ", o.model.layers, ", \"seq\": ", o.model.seq,
      ", \"batch\": ", o.model.batch, ", \"steps\": ", o.steps, ", \"lr\": ", exact(o.lr),
      ", \"weight_decay\": ", exact(o.weight_decay), ", \"seed\": ", o.seed,
      ", \"gpu_budget_bytes\": ", budget ? std::to_string(o.gpu_budget) : std::string("null"),
      ", \"prefetch_depth\": ", o.prefetch_depth, ", \"roles\": ", json_quoted(o.roles.to_string()),
      ", \"phase_switch_every\": ", o.phase_switch_every,
      ", \"gpu_memory\": ", json_quoted(alloc::device_method_name(o.gpu_memory)),
      ", \"dtype\": ", json_quoted(dtype_name(o.dtype)),
      ", \"state_dtype\": ", json_quoted(optim::state_dtype_name(o.state_dtype)),
      ", \"optimizer\": ", json_quoted(o.rule->name()),
      ", \"text\": ", o.text != nullptr ? "true" : "false",
      ", \"clip_grad_norm\": ", exact(o.clip_grad_norm),
      ", \"overlap\": ", json_quoted(rt::overlap_name(o.overlap)),
      ", \"grad_accum\": ", o.grad_accum,
      ", \"step_stream\": ", json_quoted(o.step_on_own_stream ? "own" : "compute"),
      ", \"undo_on_gpu\": ", o.undo_on_gpu ? "true" : "false", ", \"step_end\": ",
      json_quoted(o.step_end == TrainOptions::StepEnd::kStream ? "stream" : "device"),
      ", \"parameter_bytes\": ", parameter_bytes(o.model), "},\n");
  j += "  \"runs\": [\n";
  for (std::size_t i = 0; i < report.runs.size(); ++i) {
    const RunResult& r = report.runs[i];
    str_append(&j, "    {\"name\": ", json_quoted(r.name),
               ", \"kind\": ", r.strata ? "\"strata\"" : "\"torch\"",
               ", \"ok\": ", r.ok ? "true" : "false",
               ", \"error\": ", r.ok ? std::string("null") : json_quoted(r.error),
               ", \"failed_at_setup\": ", r.failed_at_setup ? "true" : "false", ",\n");
    str_append(&j, "     \"median_step_ms\": ", exact(median_step_ms(r)),
               ", \"median_optimizer_ms\": ", exact(median_optimizer_ms(r)),
               ", \"peak_gpu_bytes\": ", peak_gpu_bytes(r),
               ", \"peak_strata_gpu_bytes\": ", peak_strata_gpu_bytes(r), ", \"final_loss\": ",
               r.steps.empty() ? std::string("null") : exact(r.steps.back().loss),
               ", \"host_rss_at_start_bytes\": ", json_bytes(r.host_rss_at_start_bytes),
               ", \"peak_host_rss_bytes\": ", json_bytes(r.peak_host_rss_bytes),
               ", \"drain_ms\": ", exact(r.drain_ms), ",\n");
    if (r.strata) {
      std::string host_layers;
      for (int l : r.host_layers) str_append(&host_layers, host_layers.empty() ? "" : ", ", l);
      str_append(
          &j, "     \"state_bytes\": ", r.state_bytes, ", \"staging_bytes\": ", r.staging_bytes,
          ", \"staged_peak_bytes\": ", r.staged_peak_bytes, ", \"host_syncs\": ", r.host_syncs,
          ", \"pinned_reserved_peak_bytes\": ", r.pinned_reserved_peak_bytes,
          ", \"undo_peak_bytes\": ", r.undo_peak_bytes,
          ",\n     \"placement\": ", json_quoted(r.placement), ", \"host_layers\": [", host_layers,
          "], \"host_threads\": ", r.host_threads, ", \"step_rates\": ", rates_json(r.step_rates),
          ",\n     \"leak_free\": ", r.leak_free ? "true" : "false",
          ", \"leak_report\": ", json_quoted(r.leak_report),
          ",\n     \"allocator\": ", r.allocator_json.empty() ? "null" : r.allocator_json, ",\n");
    }
    j += "     \"phase_switches\": [";
    for (std::size_t k = 0; k < r.phase_switches.size(); ++k) {
      const PhaseSwitchRecord& s = r.phase_switches[k];
      str_append(&j, k == 0 ? "\n" : ",\n", "       {\"after_step\": ", s.after_step,
                 ", \"offload_ms\": ", exact(s.offload_ms), ", \"reload_ms\": ", exact(s.reload_ms),
                 ", \"offloaded_bytes\": ", s.offloaded_bytes,
                 ", \"reloaded_bytes\": ", s.reloaded_bytes,
                 ", \"gpu_bytes_before_offload\": ", s.gpu_bytes_before_offload,
                 ", \"gpu_reserved_after_offload_bytes\": ", s.gpu_reserved_after_offload_bytes,
                 ", \"driver_freed_bytes\": ",
                 s.driver_freed_bytes >= 0 ? std::to_string(s.driver_freed_bytes) : "null",
                 ", \"rollout_stand_in_bytes\": ", s.rollout_stand_in_bytes,
                 ", \"pinned_allocations\": ", s.pinned_allocations,
                 ", \"link_h2d_gbps\": ", exact(s.link_h2d_gbps),
                 ", \"link_d2h_gbps\": ", exact(s.link_d2h_gbps),
                 ", \"offload_floor_ms\": ", exact(s.offload_floor_ms),
                 ", \"reload_floor_ms\": ", exact(s.reload_floor_ms),
                 ", \"cuda_malloc_ms\": ", exact(s.cuda_malloc_ms),
                 ", \"cuda_free_ms\": ", exact(s.cuda_free_ms), "}");
    }
    j += r.phase_switches.empty() ? "],\n" : "\n     ],\n";
    j += "     \"steps\": [";
    for (std::size_t k = 0; k < r.steps.size(); ++k) {
      const StepRecord& s = r.steps[k];
      str_append(&j, k == 0 ? "\n" : ",\n", "       {\"step\": ", s.step,
                 ", \"loss\": ", exact(s.loss), ", \"step_ms\": ", exact(s.step_ms),
                 ", \"optimizer_ms\": ", exact(s.optimizer_ms),
                 ", \"grad_norm\": ", exact(s.grad_norm), ", \"loss_scale\": ", exact(s.loss_scale),
                 ", \"skipped\": ", s.skipped ? "true" : "false",
                 ", \"redone\": ", s.redone ? "true" : "false", ", \"h2d_bytes\": ", s.h2d_bytes,
                 ", \"d2h_bytes\": ", s.d2h_bytes, ", \"h2d_gbps\": ", exact(s.h2d_gbps),
                 ", \"d2h_gbps\": ", exact(s.d2h_gbps), ", \"waited_ms\": ", exact(s.waited_ms),
                 ", \"host_queued_ms\": ", exact(s.host_queued_ms),
                 ", \"host_waited_ms\": ", exact(s.host_waited_ms),
                 ", \"host_kernel_ms\": ", exact(s.host_kernel_ms),
                 ", \"peak_gpu_bytes\": ", s.peak_gpu_bytes,
                 ", \"strata_gpu_bytes\": ", s.strata_gpu_bytes,
                 ", \"fragmentation\": {\"gpu\": ", exact(s.fragmentation[0]),
                 ", \"pinned_host\": ", exact(s.fragmentation[1]),
                 ", \"pageable_host\": ", exact(s.fragmentation[2]),
                 "}, \"host_rss_bytes\": ", json_bytes(s.host_rss_bytes), "}");
    }
    str_append(&j, r.steps.empty() ? "]" : "\n     ]", "}",
               i + 1 < report.runs.size() ? ",\n" : "\n");
  }
  j += "  ]";
  if (report.compare) {
    const Comparison& c = report.comparison;
    std::string names;
    for (const std::string& n : c.compared)
      str_append(&names, names.empty() ? "" : ", ", json_quoted(n));
    str_append(&j,
               ",\n  \"losses_identical_across_policies\": ", c.losses_identical ? "true" : "false",
               ",\n  \"policies_compared\": [", names, "],\n  \"max_loss_diff_vs_torch\": ",
               c.max_loss_diff_vs_torch >= 0 ? exact(c.max_loss_diff_vs_torch) : "null");
  }
  j += "\n}\n";
  return j;
}

// Drawn top to bottom as the chart reads (longer than a screen on purpose).
std::string to_svg(const Report& report) {
  constexpr int kWidth = 1000, kPanelWidth = 470, kLabelWidth = 170, kRowHeight = 34;
  constexpr int kTop = 108, kBarHeight = 20;
  const int rows = static_cast<int>(report.runs.size());
  const int height = kTop + rows * kRowHeight + 84;
  const TrainOptions& o = report.options;

  double max_ms = 0, max_bytes = 0;
  for (const RunResult& r : report.runs) {
    if (!r.ok) continue;
    max_ms = std::max(max_ms, median_step_ms(r));
    max_bytes = std::max(max_bytes, static_cast<double>(peak_gpu_bytes(r)));
  }
  const bool budget = o.gpu_budget != static_cast<std::size_t>(-1);
  if (budget) max_bytes = std::max(max_bytes, static_cast<double>(o.gpu_budget));

  auto color = [](const RunResult& r) -> std::string {
    if (!r.strata) return r.name == "torch_adamw_resident" ? "#9aa5b1" : "#c9a66b";
    if (r.name == "layer_prefetch") return "#2a7fd4";
    if (r.name == "bulk") return "#2fa37b";
    if (r.name == "keep_on_gpu") return "#7b61c9";
    return "#d4682a";
  };

  std::string s;
  str_append(&s, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"", kWidth, "\" height=\"",
             height, "\" viewBox=\"0 0 ", kWidth, " ", height,
             "\" font-family=\"Helvetica, Arial, sans-serif\">\n");
  str_append(&s, "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n");
  str_append(&s, "<text x=\"24\" y=\"34\" font-size=\"20\" font-weight=\"bold\" fill=\"#1f2933\">",
             "strata-train: ", o.model.layers, "-block GPT, d_model ", o.model.d_model, ", ",
             o.steps, " steps</text>\n");
  std::string subtitle = str_cat(xml_escaped(report.device), "; Adam states ",
                                 format_bytes(2 * parameter_bytes(o.model)));
  if (budget) str_append(&subtitle, "; strata GPU budget ", format_bytes(o.gpu_budget));
  if (o.roles.contains(rt::Role::kParameter)) {
    str_append(&subtitle, "; parameters and gradients stream too");
  }
  str_append(&s, "<text x=\"24\" y=\"58\" font-size=\"13\" fill=\"#52606d\">", subtitle,
             "</text>\n");

  // A bar is value_of(run) long; its first solid_of(run) is drawn solid, the rest light.
  auto panel = [&](int x0, const std::string& title, double max_value, auto value_of, auto solid_of,
                   auto label_of, bool draw_budget) {
    const int bar_x = x0 + kLabelWidth;
    const int bar_max = kPanelWidth - kLabelWidth - 80;
    str_append(&s, "<text x=\"", x0, "\" y=\"", kTop - 16,
               "\" font-size=\"14\" font-weight=\"bold\" fill=\"#323f4b\">", title, "</text>\n");
    str_append(&s, "<line x1=\"", bar_x, "\" y1=\"", kTop - 6, "\" x2=\"", bar_x, "\" y2=\"",
               kTop + rows * kRowHeight, "\" stroke=\"#cbd2d9\"/>\n");
    if (draw_budget && budget) {
      const int bx = bar_x + static_cast<int>(std::lround(o.gpu_budget / max_value * bar_max));
      str_append(&s, "<line x1=\"", bx, "\" y1=\"", kTop - 6, "\" x2=\"", bx, "\" y2=\"",
                 kTop + rows * kRowHeight, "\" stroke=\"#c62828\" stroke-dasharray=\"5,4\"/>\n");
      str_append(&s, "<text x=\"", bx, "\" y=\"", kTop + rows * kRowHeight + 16,
                 "\" font-size=\"11\" text-anchor=\"middle\" fill=\"#c62828\">GPU budget</text>\n");
    }
    for (int i = 0; i < rows; ++i) {
      const RunResult& r = report.runs[i];
      const int y = kTop + i * kRowHeight;
      str_append(&s, "<text x=\"", bar_x - 8, "\" y=\"", y + 15,
                 "\" font-size=\"12\" text-anchor=\"end\" fill=\"#1f2933\">", xml_escaped(r.name),
                 "</text>\n");
      const double v = r.ok ? value_of(r) : 0;
      if (!r.ok || v <= 0) {
        const std::string why =
            !r.ok ? (r.error.find("out of memory") != std::string::npos ? "failed: out of memory"
                                                                        : "failed")
                  : "n/a (runs on the CPU)";
        str_append(&s, "<text x=\"", bar_x + 6, "\" y=\"", y + 15, "\" font-size=\"12\" fill=\"",
                   !r.ok ? "#c62828" : "#7b8794",
                   "\" stroke=\"#ffffff\" stroke-width=\"3\" paint-order=\"stroke\">", why,
                   "</text>\n");
        continue;
      }
      const int w = std::max(1, static_cast<int>(std::lround(v / max_value * bar_max)));
      const int solid =
          std::clamp(static_cast<int>(std::lround(solid_of(r) / max_value * bar_max)), 0, w);
      if (solid < w) {
        str_append(&s, "<rect x=\"", bar_x, "\" y=\"", y, "\" width=\"", w, "\" height=\"",
                   kBarHeight, "\" rx=\"3\" fill=\"", color(r), "\" fill-opacity=\"0.35\"/>\n");
      }
      if (solid > 0) {
        str_append(&s, "<rect x=\"", bar_x, "\" y=\"", y, "\" width=\"", solid, "\" height=\"",
                   kBarHeight, "\" rx=\"3\" fill=\"", color(r), "\"/>\n");
      }
      // A white halo keeps the value readable where it crosses the budget line.
      str_append(&s, "<text x=\"", bar_x + w + 6, "\" y=\"", y + 15,
                 "\" font-size=\"12\" fill=\"#323f4b\" stroke=\"#ffffff\" stroke-width=\"3\" "
                 "paint-order=\"stroke\">",
                 label_of(v), "</text>\n");
    }
  };
  panel(
      24, "Median step time (ms, lower is better)", max_ms > 0 ? max_ms : 1,
      [](const RunResult& r) { return median_step_ms(r); },
      [](const RunResult& r) { return median_step_ms(r); },
      [](double v) { return fixed(v, v < 10 ? 2 : 1) + " ms"; }, false);
  panel(
      24 + kPanelWidth + 20, "Peak GPU memory (lower is better)", max_bytes > 0 ? max_bytes : 1,
      [](const RunResult& r) { return static_cast<double>(peak_gpu_bytes(r)); },
      [](const RunResult& r) {
        return static_cast<double>(r.strata ? peak_strata_gpu_bytes(r) : peak_gpu_bytes(r));
      },
      [](double v) { return format_bytes(static_cast<std::size_t>(v)); }, true);

  std::string note;
  if (report.device.find("simulated") == std::string::npos) {
    note =
        "Memory of strata runs: solid, model state in strata's GPU tier and staging ring (within "
        "the budget); light, PyTorch's own (activations, temporaries)";
  } else {
    note =
        "Memory of strata runs: model state in strata's GPU tier and staging ring (simulated "
        "device); PyTorch runs on the CPU here";
  }
  str_append(&s, "<text x=\"24\" y=\"", height - 36, "\" font-size=\"12\" fill=\"#52606d\">",
             xml_escaped(note), ".</text>\n");
  if (report.compare) {
    const Comparison& c = report.comparison;
    std::string line =
        c.compared.size() < 2
            ? std::string("Losses not compared: fewer than two strata policies trained")
            : str_cat("Losses identical across the strata policies that trained: ",
                      c.losses_identical ? "yes, bitwise" : "NO");
    if (c.max_loss_diff_vs_torch >= 0) {
      str_append(&line,
                 "; largest difference from PyTorch's AdamW: ", exact(c.max_loss_diff_vs_torch));
    }
    str_append(&s, "<text x=\"24\" y=\"", height - 16,
               "\" font-size=\"12\" font-weight=\"bold\" fill=\"",
               c.losses_identical ? "#1f7a4d" : "#c62828", "\">", xml_escaped(line), "</text>\n");
  }
  s += "</svg>\n";
  return s;
}

absl::Status write_file(const std::string& path, std::string_view contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::InvalidArgumentError(str_cat("cannot open '", path, "' for writing"));
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  out.close();
  if (!out) return absl::DataLossError(str_cat("writing '", path, "' failed"));
  return absl::OkStatus();
}

}  // namespace strata::apps
