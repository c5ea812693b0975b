// bench/host_undo_main.cpp: strata_host_undo times a host step taken in backward, whose states
// must be kept for a redo (See Note [Undo in the host kernel] in optim/kept_states.h), three
// ways on one layer whose states are far larger than the host's caches:
//   - the kernel alone, keeping nothing (a host step after backward);
//   - a copy of every state to the undo buffer over the threads, then the kernel (as strata
//     kept them before the kernel kept them itself);
//   - the kernel keeping them itself (StepTensor::keep).
// Each line gives the median of --repeats steps in ms and in G parameters/s, and the host memory
// each way should move a parameter: the kernel reads gradient, master and moments and writes the
// parameter, master and moments; the separate copy reads the states again and writes them; the
// kernel that keeps them writes them only.
//
//   strata_host_undo [--numel=67108864] [--param_dtype=bfloat16|float32] [--threads=N]
//                    [--repeats=7]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/thread_pool.h"
#include "optim/kept_states.h"
#include "optim/step_rule.h"

namespace strata::optim {
namespace {

struct Args {
  std::int64_t numel = std::int64_t{1} << 26;
  bool bf16 = true;
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  int repeats = 7;
};

bool parse(int argc, char** argv, Args& a) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    auto value = [&](std::string_view flag) -> const char* {
      return arg.substr(0, flag.size()) == flag ? argv[i] + flag.size() : nullptr;
    };
    if (const char* v = value("--numel=")) {
      a.numel = std::atoll(v);
    } else if (const char* v = value("--param_dtype=")) {
      a.bf16 = std::string_view(v) == "bfloat16";
      if (!a.bf16 && std::string_view(v) != "float32") return false;
    } else if (const char* v = value("--threads=")) {
      a.threads = std::atoi(v);
    } else if (const char* v = value("--repeats=")) {
      a.repeats = std::atoi(v);
    } else {
      return false;
    }
  }
  return a.numel > 0 && a.threads > 0 && a.repeats > 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int run(const Args& a) {
  const std::size_t n = static_cast<std::size_t>(a.numel);
  // Adam over a bfloat16 parameter with a float32 master, or a float32 parameter that is its own
  // master (a host-stepped layer's two cases): moments and master float32.
  std::vector<float> master(n), m(n), v(n), grad32(a.bf16 ? 0 : n);
  std::vector<std::uint16_t> param16(a.bf16 ? n : 0), grad16(a.bf16 ? n : 0);
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (std::size_t i = 0; i < n; ++i) {
    master[i] = d(rng);
    m[i] = 0.01f * d(rng);
    v[i] = 1e-4f * std::abs(d(rng));
    if (a.bf16) {
      param16[i] = float_to_bf16(master[i]);
      grad16[i] = float_to_bf16(0.1f * d(rng));
    } else {
      grad32[i] = 0.1f * d(rng);
    }
  }
  std::vector<float> undo(3 * n, 0.0f);  // touched, as the optimizer's buffer is after a step
  StepTensor t;
  t.numel = a.numel;
  t.states = {m.data(), v.data(), master.data(), nullptr};
  t.master = master.data();
  t.param = a.bf16 ? static_cast<void*>(param16.data()) : static_cast<void*>(master.data());
  t.grad = a.bf16 ? static_cast<const void*>(grad16.data()) : grad32.data();
  t.param_type = t.grad_type = a.bf16 ? ElemType::kBF16 : ElemType::kF32;
  KeptStates keep;
  for (int k = 0; k < 3; ++k) {
    keep.states[keep.count++] = {t.states[k], undo.data() + k * n, StateLayout::kF32};
  }
  const AdamHyper hyper{.lr = 1e-4, .weight_decay = 0.01};
  ThreadPool pool(a.threads);
  const std::shared_ptr<const StepRule> rule = adam_rule();

  auto copy_then_step = [&] {
    // As Adam::put_back_host_states copies: over the pool, in ranges of at least 4 MiB.
    for (int k = 0; k < 3; ++k) {
      auto* dst = reinterpret_cast<char*>(undo.data() + k * n);
      const auto* src = static_cast<const char*>(t.states[k]);
      parallel_ranges(&pool, static_cast<std::int64_t>(n * sizeof(float)), std::int64_t{4} << 20,
                      64, [&](std::int64_t b, std::int64_t e) {
                        std::memcpy(dst + b, src + b, static_cast<std::size_t>(e - b));
                      });
    }
    rule->step_host(&t, 1, hyper, 1.0f, &pool);
  };
  auto plain = [&] { rule->step_host(&t, 1, hyper, 1.0f, &pool); };
  auto kept = [&] {
    StepTensor k = t;
    k.keep = &keep;
    rule->step_host(&k, 1, hyper, 1.0f, &pool);
  };

  const double kernel_bytes = a.bf16 ? 2 + 12 + 12 + 2 : 4 + 12 + 12;
  struct Way {
    const char* name;
    std::function<void()> step;
    double bytes;  // host memory a parameter
  };
  const std::vector<Way> ways = {{"kernel alone (nothing kept)", plain, kernel_bytes},
                                 {"copy, then the kernel", copy_then_step, kernel_bytes + 24},
                                 {"the kernel keeping them", kept, kernel_bytes + 12}};
  std::printf("strata_host_undo: %lld parameters (%s), %d threads, median of %d\n",
              static_cast<long long>(a.numel), a.bf16 ? "bfloat16 + float32 master" : "float32",
              a.threads, a.repeats);
  std::vector<std::vector<double>> ms(ways.size());
  for (int r = 0; r < a.repeats + 1; ++r) {  // interleaved; the first round warms up
    for (std::size_t w = 0; w < ways.size(); ++w) {
      const auto start = std::chrono::steady_clock::now();
      ways[w].step();
      const std::chrono::duration<double, std::milli> took =
          std::chrono::steady_clock::now() - start;
      if (r > 0) ms[w].push_back(took.count());
    }
  }
  const double base = median(ms[0]);
  for (std::size_t w = 0; w < ways.size(); ++w) {
    const double med = median(ms[w]);
    std::printf(
        "  %-30s %9.2f ms  %6.3f G params/s  %5.2fx alone  %2.0f B a parameter, %6.1f GB/s\n",
        ways[w].name, med, a.numel / med / 1e6, med / base, ways[w].bytes,
        ways[w].bytes * a.numel / med / 1e6);
  }
  return 0;
}

}  // namespace
}  // namespace strata::optim

int main(int argc, char** argv) {
  strata::optim::Args a;
  if (!strata::optim::parse(argc, argv, a)) {
    std::fprintf(stderr,
                 "usage: strata_host_undo [--numel=N] [--param_dtype=bfloat16|float32] "
                 "[--threads=N] [--repeats=N]\n");
    return 2;
  }
  return strata::optim::run(a);
}
