// libFuzzer target over Adam::load: checkpoints are files users download and share. Each input is
// loaded into one Adam (three parameters in two groups, one with amsgrad, two steps taken) on the
// simulated device, under ASan + UBSan, and checked:
//   - never a crash (ASan, UBSan, libFuzzer's own checks);
//   - never an allocation larger than the input justifies (every allocation while load runs is
//     tracked; the largest may be twice the input, as a vector grows, plus a read piece);
//   - never a partial load: a load that fails leaves every state's bytes, every step counter and
//     every hyperparameter as they were; one that succeeds is undone before the next input.
// A broken promise aborts, which libFuzzer reports with the input.
//
//   make fuzz                                            # regressions, then fuzzing (both targets)
//   build-fuzz/bin/adam_load_fuzzer -runs=0 tests/fuzz/adam_load_regressions   # regressions only
//   STRATA_WRITE_SEEDS=DIR build-fuzz/bin/adam_load_fuzzer -runs=0 DIR  # writes the seed inputs
#include <sanitizer/allocator_interface.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "base/strings.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

namespace {

// Every allocation while load runs is seen through the sanitizer allocator's hook (the fuzzer
// always runs under ASan).
std::atomic<bool> tracking{false};
std::atomic<std::size_t> largest{0};

void on_malloc(const volatile void*, std::size_t n) {
  if (!tracking.load(std::memory_order_relaxed)) return;
  std::size_t seen = largest.load(std::memory_order_relaxed);
  while (n > seen && !largest.compare_exchange_weak(seen, n)) {
  }
}
void on_free(const volatile void*) {}

}  // namespace

namespace strata {
namespace {

[[noreturn]] void broken(const std::string& what) {
  std::fprintf(stderr, "adam_load_fuzzer: broken promise: %s\n", what.c_str());
  std::abort();
}

struct Snapshot {
  std::vector<std::int64_t> steps;
  std::vector<std::vector<double>> hypers;
  std::vector<std::vector<unsigned char>> states;
  bool operator==(const Snapshot&) const = default;
};

struct Fixture {
  std::unique_ptr<rt::Runtime> runtime;
  std::unique_ptr<optim::Adam> adam;
  std::vector<rt::TensorHandle> states;
  std::string good;  // a valid checkpoint of the fixture

  Snapshot snapshot() const {
    Snapshot s;
    for (std::size_t g = 0; g < adam->num_groups(); ++g) {
      s.steps.push_back(adam->step_count(g));
      const optim::AdamHyper& h = adam->hyper(g);
      s.hypers.push_back({h.lr, h.beta1, h.beta2, h.eps, h.weight_decay,
                          static_cast<double>(h.decoupled), static_cast<double>(h.amsgrad),
                          static_cast<double>(h.maximize)});
    }
    for (rt::TensorHandle h : states) {
      std::vector<unsigned char> bytes(runtime->info(h)->bytes);
      if (!runtime->read(h, bytes.data()).ok()) broken("reading a state");
      s.states.push_back(std::move(bytes));
    }
    return s;
  }
};

Fixture* make_fixture() {
  auto* f = new Fixture;
  rt::RuntimeOptions options;
  options.policy = "keep_on_gpu";
  options.device = rt::DeviceKind::kSimulated;
  options.allocator.simulated_device.capacity = std::size_t{64} << 20;
  f->runtime = *rt::Runtime::create(std::move(options), policy::builtin_policies());
  const std::size_t numel[3] = {7, 33, 100};
  optim::AdamOptions o;
  o.groups.resize(2);
  o.groups[0].hyper = {.lr = 1e-2f, .weight_decay = 0.1f};
  o.groups[1].hyper = {.lr = 3e-3f, .beta1 = 0.8f, .amsgrad = true};
  for (int i = 0; i < 3; ++i) {
    std::vector<float> values(numel[i]);
    for (std::size_t k = 0; k < values.size(); ++k) values[k] = 0.01f * (k % 13) - 0.05f * i;
    auto spec = [&](std::string name, rt::Role role) {
      return rt::TensorSpec{
          std::move(name), i, role, rt::DType::kFloat32, {static_cast<std::int64_t>(numel[i])}};
    };
    const rt::TensorHandle p =
        *f->runtime->register_tensor(spec(str_cat("w", i), rt::Role::kParameter), values.data());
    const rt::TensorHandle g = *f->runtime->register_tensor(
        spec(str_cat("w", i, ".grad"), rt::Role::kGradient), values.data());
    o.groups[i < 2 ? 0 : 1].params.push_back({p, g});
  }
  f->adam = *optim::Adam::create(*f->runtime, o);
  for (int step = 0; step < 2; ++step) {
    if (!f->adam->step().ok()) broken("the fixture's step");
  }
  for (const auto& group : o.groups) {
    for (auto [p, g] : group.params) {
      const std::vector<rt::TensorHandle> states = *f->adam->state(p);
      f->states.insert(f->states.end(), states.begin(), states.end());
    }
  }
  std::ostringstream out;
  if (!f->adam->save(out).ok()) broken("saving the fixture");
  f->good = out.str();
  return f;
}

Fixture& fixture() {
  static Fixture* f = make_fixture();
  return *f;
}

// The seed inputs: the fixture's checkpoint and ways it goes wrong.
void write_seeds(const std::string& dir) {
  const std::string& good = fixture().good;
  auto put = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
  };
  auto with_u32_at = [&](std::size_t at, std::uint32_t v) {
    std::string s = good;
    std::memcpy(s.data() + at, &v, 4);
    return s;
  };
  put("good", good);
  put("truncated-in-the-states", good.substr(0, good.size() / 2));
  put("trailing-bytes", good + "and more");
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x40;
  put("bad-checksum", flipped);
  const std::size_t count_at = 14 + 4 + 2 * (8 + 23);  // magic, groups, two groups
  put("count-that-lies", with_u32_at(count_at, 6));
  put("huge-count", with_u32_at(count_at, 0xFFFFFFFFu));
  put("huge-name-length", with_u32_at(count_at + 4, 0x7FFFFFFFu));
  put("huge-group-count", with_u32_at(14, 0xFFFFFFFFu));
}

}  // namespace
}  // namespace strata

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  __sanitizer_install_malloc_and_free_hooks(on_malloc, on_free);
  strata::fixture();
  if (const char* dir = std::getenv("STRATA_WRITE_SEEDS")) strata::write_seeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using strata::broken;
  strata::Fixture& f = strata::fixture();
  const strata::Snapshot before = f.snapshot();
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  largest.store(0);
  tracking.store(true);
  const absl::Status s = f.adam->load(in);
  tracking.store(false);
  const std::size_t justified = 2 * size + 2 * 64 * 1024 + 4096;
  if (largest.load() > justified) {
    broken(strata::str_cat("an allocation of ", largest.load(), " bytes for an input of ", size,
                           " bytes"));
  }
  if (!s.ok()) {
    if (!(f.snapshot() == before))
      broken(strata::str_cat("a failed load changed things: ", s.ToString()));
    return 0;
  }
  // A checkpoint that loads: back to the fixture's own before the next input.
  std::istringstream good(f.good);
  if (!f.adam->load(good).ok()) broken("reloading the fixture's checkpoint");
  return 0;
}
