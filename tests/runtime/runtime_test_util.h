// tests/runtime/runtime_test_util.h: building runtimes and payloads for the runtime suites.
#pragma once

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/strings.h"
#include "gtest/gtest.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

namespace strata::rt::testing {

struct Made {
  std::unique_ptr<Runtime> rt;
  SimulatedDevice* device = nullptr;  // owned by rt
};

// A runtime on a simulated device; `deferred` queues device work until the host waits.
inline Made make_runtime(std::string policy, PolicyConfig config = {}, bool deferred = false,
                         std::size_t gpu_budget = alloc::kNoBudget) {
  RuntimeOptions options;
  options.policy = std::move(policy);
  options.policy_config = config;
  options.allocator.track_allocations = true;
  options.allocator.simulated_device.capacity = std::size_t{4} << 30;
  options.allocator.budgets[alloc::tier_index(Tier::kGpu)] = gpu_budget;
  auto device = std::make_unique<SimulatedDevice>();
  SimulatedDevice* raw = device.get();
  raw->set_deferred(deferred);
  options.device_override = std::move(device);
  absl::StatusOr<std::unique_ptr<Runtime>> rt =
      Runtime::create(std::move(options), policy::builtin_policies());
  EXPECT_TRUE(rt.ok()) << rt.status();
  return {rt.ok() ? std::move(*rt) : nullptr, raw};
}

// Bytes that exercise every float corner: NaN (quiet and signalling payloads), +-Inf, -0,
// denormals, plus random bits; any length (odd lengths cut through a float).
inline std::vector<unsigned char> special_payload(std::size_t bytes, std::uint64_t seed) {
  std::vector<unsigned char> out(bytes);
  std::mt19937_64 rng(seed);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::signaling_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            -0.0f,
                            std::numeric_limits<float>::denorm_min(),
                            -std::numeric_limits<float>::denorm_min(),
                            1e-40f};
  for (std::size_t i = 0; i < bytes; i += 4) {
    float f;
    if (rng() % 4 == 0) {
      f = specials[rng() % 8];
    } else {
      const std::uint32_t bits = static_cast<std::uint32_t>(rng());
      std::memcpy(&f, &bits, 4);
    }
    std::memcpy(out.data() + i, &f, std::min<std::size_t>(4, bytes - i));
  }
  return out;
}

inline TensorSpec spec(std::string name, int layer, Role role, std::size_t numel,
                       DType dtype = DType::kFloat32, Tier home = Tier::kGpu) {
  return TensorSpec{std::move(name), layer, role, dtype, {static_cast<std::int64_t>(numel)}, home};
}

// One optimizer step that touches nothing: every layer's states acquired on the GPU and released,
// in the policy's order, on the runtime's compute stream.
inline void empty_optimizer_step(Runtime& rt) {
  ASSERT_TRUE(rt.begin_optimizer_step().ok());
  for (int layer : rt.optimizer_layer_order()) {
    absl::StatusOr<std::vector<void*>> p =
        rt.acquire_layer(layer, RoleSet::optimizer_states(), Tier::kGpu, rt.compute_stream());
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(rt.release_layer(layer, RoleSet::optimizer_states(), rt.compute_stream()).ok());
  }
  ASSERT_TRUE(rt.end_optimizer_step().ok());
}

inline std::vector<unsigned char> read_all(Runtime& rt, TensorHandle h) {
  std::vector<unsigned char> out(rt.info(h)->bytes);
  absl::Status s = rt.read(h, out.data());
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// "G" main GPU pool, "S" staged on the GPU, "P" pinned, "H" pageable; "*" while in flight.
inline std::string where(Runtime& rt) {
  EXPECT_TRUE(rt.poll().ok());
  std::string out;
  for (TensorHandle h : rt.tensors()) {
    TensorInfo i = *rt.info(h);
    if (!out.empty()) out += ' ';
    const Tier t = i.in_flight ? i.destination : i.tier;
    const bool staged = i.in_flight ? i.destination_staged : i.staged;
    out += staged ? "S" : (t == Tier::kGpu ? "G" : (t == Tier::kPinnedHost ? "P" : "H"));
    if (i.in_flight) out += '*';
  }
  return out;
}

}  // namespace strata::rt::testing
