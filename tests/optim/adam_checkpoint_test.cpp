// D3 of RELIABILITY.md: strata's Adam's checkpoints, on the simulated device. Optimizer state saved
// from whichever tier holds it loads into a fresh runtime (whose policy places it) bitwise equal,
// with exact step counters, and training goes on identically, across policies and the hybrid's
// splits; corrupt, truncated or foreign files are refused and change nothing; a checkpoint from
// before float32 masters were left out still loads.
#include <torch/torch.h>

#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "base/status.h"
#include "optim/adam.h"
#include "policies/builtin.h"
#include "tests/optim/adam_test_model.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::optim {
namespace {

using namespace adam_testing;  // NOLINT(build/namespaces): the shared model

// states_of without the masters of float32 parameters (every parameter here), after checking
// that each is its parameter's value (See Note [Float32 masters follow the split] in
// optim/adam_placement.cpp).
std::map<std::string, std::vector<unsigned char>> states_but_masters(rt::Runtime& runtime) {
  std::map<std::string, std::vector<unsigned char>> out = states_of(runtime);
  std::erase_if(out, [&](const auto& entry) {
    const std::string& name = entry.first;
    if (!name.ends_with(".master")) return false;
    const std::string param = name.substr(0, name.size() - std::string(".master").size());
    EXPECT_TRUE(out.count(param) == 1 && out.at(param) == entry.second) << name;
    return true;
  });
  return out;
}

TEST(D3Test, CheckpointRoundTripFromEveryTier) {
  const auto init = initial_values();
  struct Case {
    std::string from;
    rt::PolicyConfig from_config;
    bool offload_before_save;
    std::string to;
    rt::PolicyConfig to_config = {};
  };
  // Every layer stepped on the host: float32 parameters with masters there, which checkpoints
  // leave out (See Note [Float32 masters follow the split] in optim/adam_placement.cpp).
  const rt::PolicyConfig on_host{.prefetch_depth = 1, .hybrid_fraction = 0.0};
  const std::vector<Case> cases = {
      {"keep_on_gpu", {}, false, "layer_prefetch"},                     // states on the GPU
      {"layer_prefetch", {.prefetch_depth = 1}, false, "keep_on_gpu"},  // states pinned
      {"bulk", {.roles = RoleSet::optimizer_states()}, true, "bulk"},   // offloaded to pinned
      {"hybrid", on_host, false, "layer_prefetch", {.prefetch_depth = 1}},
      {"layer_prefetch", {.prefetch_depth = 1}, false, "hybrid", on_host},
  };
  for (const Case& c : cases) {
    auto [a, a_dev] = make_runtime(c.from, c.from_config);
    Model ma = register_model(*a, init);
    auto adam_a = *Adam::create(*a, options_for(ma, true, true));
    run_steps(*a, *adam_a, ma, 30);
    if (c.offload_before_save) {
      ASSERT_TRUE(a->offload_all().ok());
    }
    const Tier saved_from = a->info(*a->find("l0.w.exp_avg"))->tier;
    if (c.from == "hybrid") {
      EXPECT_TRUE(a->find("l0.w.master").ok()) << "a master to leave out";
    }
    std::stringstream file;
    ASSERT_TRUE(adam_a->save(file).ok());
    const std::int64_t gpu_peak = a->allocator().stats(Tier::kGpu).allocated_bytes.peak;

    // A fresh runtime: the parameters come from the model checkpoint (here: copied over).
    auto [b, b_dev] = make_runtime(c.to, c.to_config);
    std::vector<std::vector<float>> params;
    for (int l = 0; l < kLayers; ++l) {
      std::vector<unsigned char> raw = read_all(*a, ma.params[l]);
      params.emplace_back(reinterpret_cast<float*>(raw.data()),
                          reinterpret_cast<float*>(raw.data()) + kNumel[l]);
    }
    Model mb = register_model(*b, params);
    auto adam_b = *Adam::create(*b, options_for(mb, true, true));
    absl::Status loaded = adam_b->load(file);
    ASSERT_TRUE(loaded.ok()) << loaded;
    if (c.to == "hybrid") {
      EXPECT_TRUE(b->find("l0.w.master").ok()) << "a master to take";
    }
    EXPECT_EQ(adam_b->step_count(0), 30);
    EXPECT_EQ(adam_b->step_count(1), 30);
    EXPECT_EQ(states_but_masters(*b), states_but_masters(*a)) << c.from << " -> " << c.to;
    if (saved_from != Tier::kGpu) {
      EXPECT_EQ(a->allocator().stats(Tier::kGpu).allocated_bytes.peak, gpu_peak)
          << "saving from " << alloc::tier_name(saved_from) << " must not bring states to the GPU";
    }
    if (c.offload_before_save) {
      ASSERT_TRUE(a->reload_all().ok());
    }
    run_steps(*a, *adam_a, ma, 20);
    run_steps(*b, *adam_b, mb, 20);
    EXPECT_EQ(states_but_masters(*b), states_but_masters(*a))
        << "training diverged after " << c.from << " -> " << c.to;
  }
}

TEST(D3Test, CorruptTruncatedOrForeignCheckpointsAreRefusedAndChangeNothing) {
  const auto init = initial_values();
  auto [a, a_dev] = make_runtime("keep_on_gpu");
  Model ma = register_model(*a, init);
  auto adam = *Adam::create(*a, options_for(ma, true, false));
  run_steps(*a, *adam, ma, 3);
  std::stringstream file;
  ASSERT_TRUE(adam->save(file).ok());
  const std::string good = file.str();
  const auto before = states_of(*a);
  auto load = [&](const std::string& bytes) {
    std::stringstream in(bytes);
    return adam->load(in);
  };
  std::string corrupt = good;
  corrupt[corrupt.size() / 2] ^= 0x40;
  EXPECT_EQ(load(corrupt).message(), "Adam checkpoint: checksum mismatch (corrupt)");
  EXPECT_EQ(load(good.substr(0, good.size() - 9)).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(load("not a checkpoint").code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(states_of(*a), before);
  EXPECT_EQ(adam->step_count(0), 3);
  // Another model's checkpoint: layer 3 has 4096 floats here, 4095 there.
  auto [c, c_dev] = make_runtime("keep_on_gpu");
  Model mc;
  for (int l = 0; l < kLayers; ++l) {
    const std::size_t n = l == 3 ? 4095 : kNumel[l];
    mc.params.push_back(*c->register_tensor(spec(str_cat("l", l, ".w"), l, Role::kParameter, n)));
    mc.grads.push_back(
        *c->register_tensor(spec(str_cat("l", l, ".w.grad"), l, Role::kGradient, n)));
  }
  auto other = *Adam::create(*c, options_for(mc, true, false));
  std::stringstream in(good);
  EXPECT_EQ(other->load(in).message(),
            "Adam checkpoint: state 'l3.w.exp_avg' has 16384 bytes; here it has 16380");
  EXPECT_EQ(other->step_count(0), 0);
}

// A checkpoint saved before float32 masters were left out (See Note [Float32 masters follow the
// split] in optim/adam_placement.cpp) holds one for each float32 parameter stepped on the host:
// it still loads, each master read and dropped, the master taken from the parameter. Such a
// master twice, or in place of a state, is refused and changes nothing.
TEST(D3Test, ACheckpointThatHoldsFloat32MastersStillLoads) {
  const auto init = initial_values();
  auto [a, a_dev] = make_runtime("layer_prefetch", {.prefetch_depth = 1});
  Model ma = register_model(*a, init);
  auto adam = *Adam::create(*a, options_for(ma, true, true));
  run_steps(*a, *adam, ma, 5);
  std::stringstream file;
  ASSERT_TRUE(adam->save(file).ok());
  const std::string saved = file.str();
  // The tensors come last: u32 count, then each {u32 name length, name, u64 bytes, bytes}; the
  // FNV-1a of everything before it closes the file.
  const std::size_t first = saved.find("l0.w.exp_avg") - sizeof(std::uint32_t);
  const std::size_t count_at = first - sizeof(std::uint32_t);
  auto entry = [](const std::string& name, const std::vector<float>& v) {
    std::string out;
    const auto len = static_cast<std::uint32_t>(name.size());
    const std::uint64_t bytes = v.size() * sizeof(float);
    out.append(reinterpret_cast<const char*>(&len), sizeof(len)).append(name);
    out.append(reinterpret_cast<const char*>(&bytes), sizeof(bytes));
    return out.append(reinterpret_cast<const char*>(v.data()), bytes);
  };
  auto with = [&](const std::vector<std::string>& extra, int more, std::size_t drop_first) {
    std::string body = saved.substr(0, saved.size() - sizeof(std::uint64_t));
    std::uint32_t count = 0;
    std::memcpy(&count, body.data() + count_at, sizeof(count));
    count += more;
    std::memcpy(body.data() + count_at, &count, sizeof(count));
    std::string entries;
    for (const std::string& e : extra) entries += e;
    body = body.substr(0, first) + entries + body.substr(first + drop_first);
    std::uint64_t h = 1469598103934665603ull;
    for (unsigned char c : body) h = (h ^ c) * 1099511628211ull;
    return body.append(reinterpret_cast<const char*>(&h), sizeof(h));
  };
  const std::vector<float> stale(kNumel[0], 123.0f);  // not the parameter: dropped
  const std::string master = entry("l0.w.master", stale);
  const auto before = states_of(*a);
  auto load = [&](const std::string& bytes) {
    std::stringstream in(bytes);
    return adam->load(in);
  };
  // The first tensor's entry, to take out for the refused case.
  const std::size_t first_bytes = 4 + 12 + 8 + kNumel[0] * sizeof(float);
  EXPECT_EQ(load(with({master, master}, 2, 0)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(load(with({master}, 0, first_bytes)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(states_of(*a), before);
  const absl::Status loaded = load(with({master}, 1, 0));
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ(states_of(*a), before);
}

}  // namespace
}  // namespace strata::optim
