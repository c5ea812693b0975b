// libFuzzer target over the allocator and the runtime's registry: the input is decoded into a
// sequence of operations (allocate and free in every tier with sizes and alignments from the input,
// register, write, read, migrate, unregister, stage a step under the chosen policy, phase
// switches), run on the simulated device under ASan + UBSan and checked against a model:
// allocations never overlap and are aligned, freed pointers come back as errors, every tensor reads
// back exactly the bytes the model holds, refusals (out of memory, bad input) change nothing, and
// at the end nothing is live. A broken promise aborts, which libFuzzer reports with the input.
//
//   make fuzz                         # the kept regression inputs, then 60 seconds of fuzzing
//   build-fuzz/bin/registry_fuzzer -runs=0 tests/fuzz/regressions     # the regressions only
//   cd build-fuzz && bin/registry_fuzzer corpus -max_total_time=600    # longer
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "allocator/tiered_allocator.h"
#include "base/strings.h"
#include "base/units.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

namespace strata {
namespace {

using alloc::Tier;
using rt::Role;
using rt::TensorHandle;

[[noreturn]] void broken(const std::string& what) {
  std::fprintf(stderr, "registry_fuzzer: broken promise: %s\n", what.c_str());
  std::abort();
}

void expect(bool ok, const std::string& what) {
  if (!ok) broken(what);
}

Tier tier_from(FuzzedDataProvider& in) {
  return alloc::kAllTiers[in.ConsumeIntegralInRange<int>(0, alloc::kNumTiers - 1)];
}

// Bytes from a seed (SplitMix64): cheap to make, different for every seed.
std::vector<unsigned char> pattern(std::size_t n, std::uint64_t seed) {
  std::vector<unsigned char> out(n);
  for (std::size_t i = 0; i < n; i += 8) {
    std::uint64_t z = (seed += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(out.data() + i, &z, std::min<std::size_t>(8, n - i));
  }
  return out;
}

struct Block {
  Tier tier;
  std::size_t bytes;
};

struct Tensor {
  TensorHandle handle;
  std::vector<unsigned char> bytes;
};

void run(FuzzedDataProvider& in) {
  static const char* const kPolicies[] = {"keep_on_gpu", "bulk", "layer_prefetch"};
  rt::RuntimeOptions options;
  options.policy = kPolicies[in.ConsumeIntegralInRange<int>(0, 2)];
  options.policy_config.prefetch_depth = in.ConsumeIntegralInRange<int>(0, 2);
  options.policy_config.offload_after_step = in.ConsumeBool();
  options.device = rt::DeviceKind::kSimulated;
  options.allocator.track_allocations = true;
  options.allocator.simulated_device.capacity = 64 * kMiB;
  for (Tier t : alloc::kAllTiers) {
    options.allocator.budgets[alloc::tier_index(t)] =
        in.ConsumeIntegralInRange<std::size_t>(2, 32) * kMiB;
  }
  absl::StatusOr<std::unique_ptr<rt::Runtime>> made =
      rt::Runtime::create(std::move(options), policy::builtin_policies());
  expect(made.ok(), "a valid configuration is refused");
  rt::Runtime& runtime = **made;
  alloc::TieredAllocator& allocator = runtime.allocator();

  std::map<std::uintptr_t, Block> blocks;  // the allocator model: start -> block
  std::map<std::string, Tensor> tensors;   // the registry model: name -> expected bytes
  std::vector<std::uintptr_t> freed;       // pointers freed since (a second free must fail)

  auto check_tensor = [&](const std::string& name, const Tensor& t) {
    std::vector<unsigned char> got(t.bytes.size());
    absl::Status s = runtime.read(t.handle, got.data());
    expect(s.ok(), str_cat("read '", name, "': ", s.ToString()));
    expect(got == t.bytes, str_cat("'", name, "' does not read back its bytes"));
  };

  for (int op = 0; op < 200 && in.remaining_bytes() > 0; ++op) {
    switch (in.ConsumeIntegralInRange<int>(0, 9)) {
      case 0: {  // allocate
        const Tier tier = tier_from(in);
        const std::size_t bytes = in.ConsumeIntegralInRange<std::size_t>(0, 3 * kMiB);
        const std::size_t alignment = std::size_t{1} << in.ConsumeIntegralInRange<int>(0, 13);
        absl::StatusOr<void*> p = allocator.allocate(tier, bytes, {.alignment = alignment});
        if (!p.ok()) break;  // too big, size 0, over budget: refusals are fine
        const auto start = reinterpret_cast<std::uintptr_t>(*p);
        expect(bytes > 0, "size 0 was accepted");
        expect(start % alignment == 0, "a block is not aligned as asked");
        auto next = blocks.lower_bound(start);
        expect(next == blocks.end() || start + bytes <= next->first, "blocks overlap");
        if (next != blocks.begin()) {
          auto prev = std::prev(next);
          expect(prev->first + prev->second.bytes <= start, "blocks overlap");
        }
        blocks[start] = {tier, bytes};
        std::erase(freed, start);
        break;
      }
      case 1: {  // free a live block, or a freed one again (must be refused)
        if (!blocks.empty() && in.ConsumeBool()) {
          auto it = blocks.begin();
          std::advance(it, in.ConsumeIntegralInRange<std::size_t>(0, blocks.size() - 1));
          absl::Status s =
              allocator.deallocate(it->second.tier, reinterpret_cast<void*>(it->first));
          expect(s.ok(), str_cat("freeing a live block: ", s.ToString()));
          freed.push_back(it->first);
          blocks.erase(it);
        } else if (!freed.empty()) {
          void* p = reinterpret_cast<void*>(
              freed[in.ConsumeIntegralInRange<std::size_t>(0, freed.size() - 1)]);
          // The runtime may have been handed the same address since (a tensor's storage).
          bool live = false;
          for (Tier t : alloc::kAllTiers) live = live || allocator.pool(t).requested_size(p);
          if (!live) {
            expect(!allocator.deallocate(tier_from(in), p).ok(), "a double free was accepted");
          }
        }
        break;
      }
      case 2:
      case 3: {  // register
        const std::string name = str_cat("t", in.ConsumeIntegralInRange<int>(0, 15));
        rt::TensorSpec spec;
        spec.name = name;
        spec.layer = in.ConsumeIntegralInRange<int>(0, 3);
        spec.role = static_cast<Role>(in.ConsumeIntegralInRange<int>(0, rt::kNumRoles - 1));
        spec.dtype = rt::DType::kUInt8;
        spec.shape = {in.ConsumeIntegralInRange<std::int64_t>(0, 300000)};
        spec.home = in.ConsumeBool() ? Tier::kGpu : Tier::kPinnedHost;
        std::vector<unsigned char> bytes =
            pattern(static_cast<std::size_t>(spec.shape[0]), in.ConsumeIntegral<std::uint64_t>());
        absl::StatusOr<TensorHandle> h = runtime.register_tensor(spec, bytes.data());
        if (tensors.count(name) > 0) {
          expect(!h.ok() && h.status().code() == absl::StatusCode::kAlreadyExists,
                 "a name registered twice");
        } else if (h.ok()) {
          tensors[name] = {*h, std::move(bytes)};
        }
        break;
      }
      case 4: {  // unregister (an unknown handle must be refused)
        if (tensors.empty()) {
          expect(!runtime.unregister(TensorHandle{999999}).ok(), "an unknown handle unregistered");
          break;
        }
        auto it = tensors.begin();
        std::advance(it, in.ConsumeIntegralInRange<std::size_t>(0, tensors.size() - 1));
        absl::Status s = runtime.unregister(it->second.handle);
        expect(s.ok(), str_cat("unregister: ", s.ToString()));
        expect(!runtime.unregister(it->second.handle).ok(), "unregistered twice");
        tensors.erase(it);
        break;
      }
      case 5: {  // migrate, then read everything back
        if (tensors.empty()) break;
        auto it = tensors.begin();
        std::advance(it, in.ConsumeIntegralInRange<std::size_t>(0, tensors.size() - 1));
        (void)runtime.migrate(it->second.handle, tier_from(in));  // may be refused (full, staged)
        if (in.ConsumeBool()) expect(runtime.wait_all().ok(), "wait_all");
        for (const auto& [name, t] : tensors) check_tensor(name, t);
        break;
      }
      case 6: {  // write new bytes
        if (tensors.empty()) break;
        auto it = tensors.begin();
        std::advance(it, in.ConsumeIntegralInRange<std::size_t>(0, tensors.size() - 1));
        std::vector<unsigned char> bytes =
            pattern(it->second.bytes.size(), in.ConsumeIntegral<std::uint64_t>());
        absl::Status s = runtime.write(it->second.handle, bytes.data());
        if (s.ok()) it->second.bytes = std::move(bytes);
        break;
      }
      case 7: {  // one optimizer pass that only reads, through the policy's hooks
        if (!runtime.begin_step().ok()) break;
        if (runtime.begin_optimizer_step().ok()) {
          for (int layer : runtime.optimizer_layer_order()) {
            absl::StatusOr<std::vector<void*>> p = runtime.acquire_layer(
                layer, rt::RoleSet::all(), Tier::kGpu, runtime.compute_stream());
            if (!p.ok()) continue;
            expect(runtime.release_layer(layer, rt::RoleSet::all(), runtime.compute_stream()).ok(),
                   "release_layer after acquire_layer");
          }
          (void)runtime.end_optimizer_step();
        }
        (void)runtime.end_step();
        for (const auto& [name, t] : tensors) check_tensor(name, t);
        break;
      }
      case 8: {  // phase switches
        (void)(in.ConsumeBool() ? runtime.offload_all() : runtime.reload_all());
        for (const auto& [name, t] : tensors) check_tensor(name, t);
        break;
      }
      case 9: {  // trim
        (void)allocator.trim(tier_from(in));
        break;
      }
    }
  }

  // Everything back: then nothing may be live.
  for (const auto& [name, t] : tensors) check_tensor(name, t);
  for (const auto& [name, t] : tensors) {
    absl::Status s = runtime.unregister(t.handle);
    expect(s.ok(), str_cat("final unregister '", name, "': ", s.ToString()));
  }
  for (const auto& [start, b] : blocks) {
    expect(allocator.deallocate(b.tier, reinterpret_cast<void*>(start)).ok(), "final free");
  }
  expect(runtime.wait_all().ok(), "final wait_all");
  expect(allocator.leak_report().empty(), str_cat("leak: ", allocator.format_leak_report()));
}

}  // namespace
}  // namespace strata

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  strata::run(in);
  return 0;
}
