// bench/runtime_rig.cpp: the runtime benchmarks' shared rig (bench/runtime_rig.h).
#include "bench/runtime_rig.h"

#include <utility>

#include "base/status.h"
#include "base/strings.h"
#include "policies/builtin.h"

namespace strata::bench {
namespace {

using alloc::Tier;

constexpr std::uint64_t kPatternSeed = 0x5354'5241'5441'0001;  // "STRATA" 1
constexpr std::uint64_t kTagBase = 0x7461'6700'0000'0000;      // "tag"

#ifdef STRATA_HAS_CUDA
LinkRig* g_raw_rig = nullptr;
#endif

}  // namespace

const std::vector<std::uint64_t>& payload_pattern() {
  static const std::vector<std::uint64_t>* const words = [] {
    auto* w = new std::vector<std::uint64_t>(kPieceBytes / sizeof(std::uint64_t));
    SplitMix64 rng(kPatternSeed);
    for (std::uint64_t& x : *w) x = rng.next();
    return w;
  }();
  return *words;
}

std::uint64_t payload_tag(int tensor_index) {
  return kTagBase + static_cast<std::uint64_t>(tensor_index);
}

absl::Status verify_payload(rt::Runtime& runtime, rt::TensorHandle tensor, int tensor_index) {
  STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, runtime.info(tensor));
  const std::size_t words = info.bytes / sizeof(std::uint64_t);
  std::vector<std::uint64_t> got(words);
  STRATA_RETURN_IF_ERROR(runtime.read(tensor, got.data()));
  const std::vector<std::uint64_t>& want = payload_pattern();
  for (std::size_t i = 0; i < words; ++i) {
    const std::uint64_t expected = i == 0 ? payload_tag(tensor_index) : want[i];
    if (got[i] != expected) {
      return absl::DataLossError(str_cat("tensor ", info.spec.name, " on ",
                                         alloc::tier_name(info.tier), ": word ", i, " of ", words,
                                         " differs from what was written"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<rt::Runtime>> make_bulk_runtime(rt::DeviceKind device) {
  rt::RuntimeOptions options;
  options.policy = "bulk";
  options.policy_config.roles = rt::RoleSet::all();
  options.device = device;
  return rt::Runtime::create(std::move(options), policy::builtin_policies());
}

absl::StatusOr<std::vector<rt::TensorHandle>> register_filled(rt::Runtime& runtime,
                                                              std::string_view prefix, int count,
                                                              std::size_t bytes, Tier home) {
  STRATA_CHECK(bytes <= kPieceBytes && bytes % sizeof(std::uint64_t) == 0,
               "payloads are prefixes of the pattern: ", bytes, " B");
  std::vector<std::uint64_t> payload = payload_pattern();
  std::vector<rt::TensorHandle> handles;
  handles.reserve(count);
  for (int i = 0; i < count; ++i) {
    const rt::TensorSpec spec{.name = str_cat(prefix, i),
                              .layer = i / 2,
                              .role = rt::Role::kOptimizerState,
                              .dtype = rt::DType::kFloat32,
                              .shape = {static_cast<std::int64_t>(bytes / sizeof(float))},
                              .home = home,
                              .state = i % 2 == 0 ? "exp_avg" : "exp_avg_sq"};
    // Registered as zeros, then written once: timing copies of zeros is not allowed here.
    STRATA_ASSIGN_OR_RETURN(rt::TensorHandle h, runtime.register_tensor(spec, nullptr));
    handles.push_back(h);
    payload[0] = payload_tag(i);
    STRATA_RETURN_IF_ERROR(runtime.write(h, payload.data()));
    STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, runtime.info(h));
    if (info.tier != home || info.in_flight) {
      return absl::FailedPreconditionError(
          str_cat("policy ", runtime.policy().name(), " placed ", spec.name, " on ",
                  alloc::tier_name(info.tier), info.in_flight ? " (in flight)" : "",
                  ", not on its home tier ", alloc::tier_name(home)));
    }
  }
  return handles;
}

Snapshot snapshot(rt::Runtime& runtime) {
  Snapshot s;
  s.gpu_segment_allocs = runtime.allocator().stats(Tier::kGpu).num_segment_allocs;
  s.pinned_segment_allocs = runtime.allocator().stats(Tier::kPinnedHost).num_segment_allocs;
  s.runtime = runtime.stats();
  return s;
}

void report_engine(benchmark::State& state, const Deltas& d) {
  if (d.h2d_busy_ms > 0) {
    state.counters["engine_h2d_gbps"] =
        gb_per_s(static_cast<double>(d.timed_bytes_h2d), d.h2d_busy_ms / 1e3);
  }
  if (d.d2h_busy_ms > 0) {
    state.counters["engine_d2h_gbps"] =
        gb_per_s(static_cast<double>(d.timed_bytes_d2h), d.d2h_busy_ms / 1e3);
  }
}

absl::Status queue_moves(rt::Runtime& runtime, const std::vector<Move>& moves) {
  for (const Move& m : moves) STRATA_RETURN_IF_ERROR(runtime.migrate(m.tensor, m.dst));
  return absl::OkStatus();
}

absl::Status check_placement(rt::Runtime& runtime, const std::vector<Move>& moves) {
  for (const Move& m : moves) {
    STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, runtime.info(m.tensor));
    if (info.tier != m.dst || info.in_flight) {
      return absl::InternalError(str_cat(info.spec.name, " is on ", alloc::tier_name(info.tier),
                                         info.in_flight ? " (in flight)" : "",
                                         " after wait_all, not on ", alloc::tier_name(m.dst)));
    }
  }
  return absl::OkStatus();
}

#ifdef STRATA_HAS_CUDA
absl::StatusOr<LinkRig*> raw_rig() {
  if (g_raw_rig != nullptr) return g_raw_rig;
  auto* rig = new LinkRig;
  if (absl::Status s = init_link_rig(*rig, /*seed=*/0x5eed); !s.ok()) {
    delete rig;
    return s;
  }
  g_raw_rig = rig;
  return rig;
}

absl::StatusOr<LinkTiming> run_raw(LinkRig& rig, Direction direction) {
  return run_link(rig, direction != Direction::kD2H, direction != Direction::kH2D);
}
#endif  // STRATA_HAS_CUDA

void release_raw_rig() {
#ifdef STRATA_HAS_CUDA
  delete g_raw_rig;
  g_raw_rig = nullptr;
#endif
}

}  // namespace strata::bench
