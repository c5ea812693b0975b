// bench/replay_trace.h: the allocation traces the allocator benchmark replays through strata's GPU
// tier and PyTorch's caching allocator, and the replay itself.
//
// Two traces of one GPT-like model (24 layers, hidden 2048, fp16 activations):
//   fixed_replay_trace()      5 steps of 8192 tokens: the shapes never change;
//   variable_replay_trace()   20 steps whose tokens (batch x sequence) are drawn per step from
//                             1024 .. 8192 in multiples of 128, as with variable sequence lengths:
//                             activations of every size, freed in reverse in backward, with
//                             temporaries in between.
// The figure of merit is reserved bytes against peak allocated bytes.
//
// Example:
//   const ReplayTrace& trace = variable_replay_trace();
//   ReplayResult r = run_replay(trace, [&](std::size_t n) { return my_alloc(n); },
//                               [&](void* p) { return my_free(p); });
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>

#include "base/strings.h"
#include "base/units.h"
#include "bench/bench_util.h"

namespace strata::bench {

// The model: GPT-like, fp16 activations. Sizes, with T tokens (batch * sequence) and hidden h:
//   one T x h activation  T*h*2  = 32 MiB;  T x 3h = 96 MiB;  T x 4h = 128 MiB
//   parameters per layer  12*h*h*2 = 96 MiB (qkv 24, proj 8, fc1 32, fc2 32) plus 4 x 4 KiB
//   saved activations per layer: x, qkv, attention out, fc1 out, gelu out = 13*T*h*2 = 416 MiB
// Peak (start of backward): 24 x 416 MiB activations + 2.25 GiB parameters + gradient
// temporaries ~ 12.2 GiB (13.1 GB), under the ~20 GB the trace may use; trace_peak_bytes reports
// the exact figure.
constexpr int kReplayLayers = 24;
constexpr std::size_t kReplayHidden = 2048;
constexpr std::size_t kReplayTokens = 8192;
constexpr std::size_t kFp16Bytes = 2;
constexpr int kReplaySteps = 5;
// The variable-shape trace: the tokens of each step drawn from [kMinVariableTokens,
// kReplayTokens] in multiples of kVariableTokenStep, as a run with variable sequence lengths.
constexpr int kVariableSteps = 20;
constexpr std::size_t kMinVariableTokens = 1024;
constexpr std::size_t kVariableTokenStep = 128;
constexpr std::size_t kMinSmallBytes = 512;
constexpr std::size_t kMaxSmallBytes = 64 * kKiB;
constexpr std::uint64_t kReplaySeed = 0x5eed'a110c'8a7e;

struct TraceEvent {
  enum class Kind : std::uint8_t { kAlloc, kFree };
  Kind kind = Kind::kAlloc;
  std::uint32_t slot = 0;  // names the allocation; a kFree frees the pointer its kAlloc got
  std::size_t bytes = 0;
};

struct ReplayTrace {
  std::string name;                 // "fixed" or "variable"
  std::vector<std::size_t> tokens;  // per step
  std::vector<TraceEvent> setup;    // parameters, before step 1
  std::vector<std::vector<TraceEvent>> steps;
  std::vector<TraceEvent> teardown;  // frees the parameters
  std::uint32_t num_slots = 0;
  std::size_t peak_bytes = 0;  // largest sum of requested bytes live at once
  std::size_t allocs_per_step = 0;
};

class TraceBuilder {
 public:
  // Events go to `out` until the next call.
  void set_output(std::vector<TraceEvent>* out) { out_ = out; }

  std::uint32_t allocate(std::size_t bytes) {
    const auto slot = static_cast<std::uint32_t>(slot_bytes_.size());
    slot_bytes_.push_back(bytes);
    out_->push_back({TraceEvent::Kind::kAlloc, slot, bytes});
    live_bytes_ += bytes;
    peak_bytes_ = std::max(peak_bytes_, live_bytes_);
    return slot;
  }

  void release(std::uint32_t slot) {
    out_->push_back({TraceEvent::Kind::kFree, slot, slot_bytes_[slot]});
    live_bytes_ -= slot_bytes_[slot];
  }

  std::size_t bytes(std::uint32_t slot) const { return slot_bytes_[slot]; }
  std::uint32_t num_slots() const { return static_cast<std::uint32_t>(slot_bytes_.size()); }
  std::size_t peak_bytes() const { return peak_bytes_; }

 private:
  std::vector<TraceEvent>* out_ = nullptr;
  std::vector<std::size_t> slot_bytes_;
  std::size_t live_bytes_ = 0;
  std::size_t peak_bytes_ = 0;
};

// 512 B .. 64 KiB, a whole number of fp16 elements.
inline std::size_t small_bytes(SplitMix64& rng) {
  const std::size_t span = kMaxSmallBytes - kMinSmallBytes + 1;
  return (kMinSmallBytes + static_cast<std::size_t>(rng.next() % span)) & ~std::size_t{1};
}

// A trace of one step per entry of `tokens`, each sized by its tokens.
inline ReplayTrace build_replay_trace(std::string name, const std::vector<std::size_t>& tokens) {
  const std::size_t hh = kReplayHidden * kReplayHidden * kFp16Bytes;  // one h x h weight
  const std::size_t vec = kReplayHidden * kFp16Bytes;                 // a bias or layernorm weight
  const std::array<std::size_t, 8> param_bytes = {3 * hh, hh, 4 * hh, 4 * hh, vec, vec, vec, vec};

  ReplayTrace trace;
  trace.name = std::move(name);
  trace.tokens = tokens;
  TraceBuilder b;
  SplitMix64 rng(kReplaySeed);

  b.set_output(&trace.setup);
  std::vector<std::uint32_t> params;
  for (int layer = 0; layer < kReplayLayers; ++layer) {
    for (std::size_t bytes : param_bytes) params.push_back(b.allocate(bytes));
  }

  struct Saved {
    std::uint32_t x, mean, rstd, qkv, attn, fc1, gelu, small;
  };
  trace.steps.resize(tokens.size());
  for (std::size_t step = 0; step < tokens.size(); ++step) {
    b.set_output(&trace.steps[step]);
    const std::size_t th = tokens[step] * kReplayHidden * kFp16Bytes;  // one T x h activation
    const std::size_t row_stat = tokens[step] * sizeof(float);         // layernorm mean or rstd

    // Forward: saved activations stay live until backward reaches the layer; the temporaries
    // die inside it, leaving holes between saved blocks as a real forward pass does.
    std::vector<Saved> saved(kReplayLayers);
    for (Saved& s : saved) {
      s.x = b.allocate(th);
      s.mean = b.allocate(row_stat);
      s.rstd = b.allocate(row_stat);
      s.qkv = b.allocate(3 * th);
      const std::uint32_t workspace = b.allocate(kMiB);
      s.attn = b.allocate(th);
      b.release(workspace);
      const std::uint32_t small_a = b.allocate(small_bytes(rng));
      const std::uint32_t small_b = b.allocate(small_bytes(rng));
      s.fc1 = b.allocate(4 * th);
      const std::uint32_t gelu_temp = b.allocate(4 * th);
      s.gelu = b.allocate(4 * th);
      b.release(gelu_temp);
      b.release(small_a);
      s.small = b.allocate(small_bytes(rng));  // e.g. a dropout seed or mask summary
      b.release(small_b);
    }

    // Backward, last layer first. Parameter gradients are made on the step's first (only)
    // backward pass and live until the optimizer has used them.
    std::vector<std::uint32_t> grads;
    std::uint32_t dy = b.allocate(th);  // gradient of the loss w.r.t. the last layer's output
    for (int layer = kReplayLayers - 1; layer >= 0; --layer) {
      const Saved& s = saved[layer];
      const std::uint32_t g4 = b.allocate(4 * th);
      grads.push_back(b.allocate(4 * hh));  // fc2
      b.release(s.gelu);
      grads.push_back(b.allocate(4 * hh));  // fc1
      b.release(s.fc1);
      const std::uint32_t small = b.allocate(small_bytes(rng));
      const std::uint32_t g3 = b.allocate(3 * th);
      b.release(g4);
      grads.push_back(b.allocate(hh));  // proj
      b.release(s.attn);
      grads.push_back(b.allocate(3 * hh));  // qkv
      b.release(s.qkv);
      for (int i = 0; i < 4; ++i) grads.push_back(b.allocate(vec));  // biases, layernorms
      const std::uint32_t g1 = b.allocate(th);  // gradient w.r.t. the layer's input
      b.release(g3);
      b.release(s.mean);
      b.release(s.rstd);
      b.release(s.x);
      b.release(s.small);
      b.release(small);
      b.release(dy);
      dy = g1;
    }
    b.release(dy);

    // Optimizer: one temporary per parameter, then the gradients go (zero_grad(set_to_none)).
    for (std::uint32_t grad : grads) b.release(b.allocate(b.bytes(grad)));
    for (std::uint32_t grad : grads) b.release(grad);
  }

  b.set_output(&trace.teardown);
  for (std::uint32_t param : params) b.release(param);

  trace.num_slots = b.num_slots();
  trace.peak_bytes = b.peak_bytes();
  for (const TraceEvent& e : trace.steps.front()) {
    if (e.kind == TraceEvent::Kind::kAlloc) ++trace.allocs_per_step;
  }
  return trace;
}

// The training step of fixed shape, kReplaySteps times.
inline const ReplayTrace& fixed_replay_trace() {
  static const ReplayTrace* const trace = new ReplayTrace(
      build_replay_trace("fixed", std::vector<std::size_t>(kReplaySteps, kReplayTokens)));
  return *trace;
}

// kVariableSteps steps of token counts drawn with a fixed seed.
inline const ReplayTrace& variable_replay_trace() {
  static const ReplayTrace* const trace = [] {
    SplitMix64 rng(kReplaySeed ^ 0x7a11);
    const std::size_t choices = (kReplayTokens - kMinVariableTokens) / kVariableTokenStep + 1;
    std::vector<std::size_t> tokens;
    for (int i = 0; i < kVariableSteps; ++i) {
      tokens.push_back(kMinVariableTokens +
                       static_cast<std::size_t>(rng.next() % choices) * kVariableTokenStep);
    }
    return new ReplayTrace(build_replay_trace("variable", tokens));
  }();
  return *trace;
}

// variable_replay_trace() for "variable", fixed_replay_trace() for anything else.
inline const ReplayTrace& replay_trace_named(std::string_view name) {
  return name == "variable" ? variable_replay_trace() : fixed_replay_trace();
}

struct ReplayResult {
  std::string error;  // empty when the whole trace ran
  std::vector<double> step_seconds;
};

// Plays `trace` through `allocate` (bytes -> pointer, nullptr on failure) and `deallocate`
// (pointer -> success). Every block is freed on return, parameters included, so the allocator's
// reserved bytes are read afterwards: both allocators keep freed segments cached.
template <typename Allocate, typename Free>
ReplayResult run_replay(const ReplayTrace& trace, Allocate allocate, Free deallocate) {
  std::vector<void*> ptrs(trace.num_slots, nullptr);
  ReplayResult result;
  auto play = [&](const std::vector<TraceEvent>& events) {
    for (const TraceEvent& e : events) {
      if (e.kind == TraceEvent::Kind::kAlloc) {
        void* p = allocate(e.bytes);
        if (p == nullptr) {
          result.error = str_cat("allocation of ", strata::format_bytes(e.bytes), " failed");
          return false;
        }
        ptrs[e.slot] = p;
      } else {
        void* p = std::exchange(ptrs[e.slot], nullptr);
        if (!deallocate(p)) {
          result.error = str_cat("free of ", strata::format_bytes(e.bytes), " failed");
          return false;
        }
      }
    }
    return true;
  };

  bool ok = play(trace.setup);
  for (const std::vector<TraceEvent>& step : trace.steps) {
    if (!ok) break;
    const auto start = std::chrono::steady_clock::now();
    ok = play(step);
    result.step_seconds.push_back(seconds_between(start, std::chrono::steady_clock::now()));
  }
  if (ok) ok = play(trace.teardown);
  if (!ok) {
    // Leave the allocator empty for the benchmarks after this one.
    for (void* p : ptrs) {
      if (p != nullptr) (void)deallocate(p);
    }
  }
  return result;
}

// What each allocator says about its memory after the replay.
struct ReplayMemory {
  std::int64_t reserved_bytes = 0;  // at the end
  std::int64_t reserved_peak_bytes = 0;
  std::int64_t peak_allocated_bytes = 0;  // after the allocator's rounding
  std::int64_t upstream_allocs = 0;       // cudaMalloc (or simulated) calls
  // What mapping cost (strata's only; -1 where not known; See Note [Expandable segments] in
  // allocator/block_pool_expand.cpp).
  std::int64_t maps = -1;
  double upstream_alloc_ms = -1;
  double upstream_free_ms = -1;
};

inline void report_replay(benchmark::State& state, const ReplayTrace& trace,
                          const ReplayResult& result, const ReplayMemory& memory) {
  const auto trace_peak = static_cast<double>(trace.peak_bytes);
  const auto reserved_peak = static_cast<double>(memory.reserved_peak_bytes);
  const auto peak_allocated = static_cast<double>(memory.peak_allocated_bytes);
  state.counters["reserved_bytes"] = bytes_counter(static_cast<double>(memory.reserved_bytes));
  state.counters["reserved_peak_bytes"] = bytes_counter(reserved_peak);
  state.counters["peak_allocated_bytes"] = bytes_counter(peak_allocated);
  state.counters["trace_peak_bytes"] = bytes_counter(trace_peak);
  // Peak reserved rather than reserved at the end: the two agree unless an allocator released
  // segments on the way, and the peak is what the GPU had to hold.
  state.counters["reserved_over_peak_allocated"] =
      peak_allocated > 0 ? reserved_peak / peak_allocated : 0;
  state.counters["reserved_over_trace_peak"] = trace_peak > 0 ? reserved_peak / trace_peak : 0;
  state.counters["upstream_allocs"] = static_cast<double>(memory.upstream_allocs);
  state.counters["allocs_per_step"] = static_cast<double>(trace.allocs_per_step);
  if (memory.maps >= 0) state.counters["maps"] = static_cast<double>(memory.maps);
  if (memory.upstream_alloc_ms >= 0) state.counters["upstream_alloc_ms"] = memory.upstream_alloc_ms;
  if (memory.upstream_free_ms >= 0) state.counters["upstream_free_ms"] = memory.upstream_free_ms;

  // Step 1 pays for growing the pool; the later steps are the steady state.
  const std::vector<double>& steps = result.step_seconds;
  if (!steps.empty()) {
    double total = 0;
    for (double s : steps) total += s;
    state.counters["step_ms"] = total / static_cast<double>(steps.size()) * 1e3;
    state.counters["first_step_ms"] = steps.front() * 1e3;
    if (steps.size() > 1) {
      state.counters["steady_step_ms"] =
          (total - steps.front()) / static_cast<double>(steps.size() - 1) * 1e3;
    }
  }
}

}  // namespace strata::bench
