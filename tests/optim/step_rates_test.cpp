// measure_step_rates on the simulated device (See Note [Measuring the step's rates] in
// optim/step_rates.h): every rate the cost model reads is positive, the link's rates beside the
// host kernel among them; the host kernel's buffer shrinks to what the pinned tier has room for;
// options it cannot measure with are refused.
#include "optim/step_rates.h"

#include <limits>
#include <memory>

#include "gtest/gtest.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

namespace strata::optim {
namespace {

std::unique_ptr<rt::Runtime> simulated_runtime() {
  rt::RuntimeOptions options;
  options.policy = "keep_on_gpu";
  options.device = rt::DeviceKind::kSimulated;
  absl::StatusOr<std::unique_ptr<rt::Runtime>> runtime =
      rt::Runtime::create(std::move(options), policy::builtin_policies());
  EXPECT_TRUE(runtime.ok()) << runtime.status();
  return runtime.ok() ? std::move(*runtime) : nullptr;
}

MeasureOptions small() {
  return {.link_bytes = 1 << 20,
          .adam_params = 1 << 16,
          .memory_bytes = 1 << 20,
          .repeats = 1,
          .loaded_seconds = 0.002};
}

TEST(StepRatesTest, EveryModelledRateIsPositive) {
  std::unique_ptr<rt::Runtime> runtime = simulated_runtime();
  ASSERT_NE(runtime, nullptr);
  ThreadPool pool(2);
  absl::StatusOr<rt::StepRates> r = measure_step_rates(*runtime, pool, small());
  ASSERT_TRUE(r.ok()) << r.status();
  for (double rate : {r->link_h2d_gbps, r->link_d2h_gbps, r->link_both_gbps, r->host_params_per_s,
                      r->link_h2d_loaded_gbps, r->link_d2h_loaded_gbps}) {
    EXPECT_GT(rate, 0);
  }
  EXPECT_EQ(r->host_threads, 2);
  // Nothing is left behind in the pinned tier.
  EXPECT_EQ(runtime->allocator().stats(rt::Tier::kPinnedHost).allocated_bytes.current, 0);
}

TEST(StepRatesTest, TheHostKernelsBufferShrinksToThePinnedTiersRoom) {
  std::unique_ptr<rt::Runtime> runtime = simulated_runtime();
  ASSERT_NE(runtime, nullptr);
  // 2^24 parameters would take 256 MiB of pinned memory; the tier has 40 MiB: 2^21 (32 MiB) fit
  // beside the link's 2 MiB.
  ASSERT_TRUE(runtime->allocator().set_budget(rt::Tier::kPinnedHost, 40 << 20).ok());
  ThreadPool pool(2);
  MeasureOptions o = small();
  o.adam_params = 1 << 24;
  absl::StatusOr<rt::StepRates> r = measure_step_rates(*runtime, pool, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->host_params_per_s, 0);

  // Not even 2^20 parameters (16 MiB) fit: the tier's error.
  ASSERT_TRUE(runtime->allocator().set_budget(rt::Tier::kPinnedHost, 12 << 20).ok());
  r = measure_step_rates(*runtime, pool, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
}

TEST(StepRatesTest, RefusesOptionsItCannotMeasureWith) {
  std::unique_ptr<rt::Runtime> runtime = simulated_runtime();
  ASSERT_NE(runtime, nullptr);
  ThreadPool pool(1);
  using Change = void (*)(MeasureOptions&);
  const Change changes[] = {
      [](MeasureOptions& o) { o.repeats = 0; }, [](MeasureOptions& o) { o.adam_params = 0; },
      [](MeasureOptions& o) { o.loaded_seconds = -1; },
      [](MeasureOptions& o) { o.loaded_seconds = std::numeric_limits<double>::infinity(); }};
  for (Change bad : changes) {
    MeasureOptions o = small();
    bad(o);
    absl::StatusOr<rt::StepRates> r = measure_step_rates(*runtime, pool, o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  }
}

}  // namespace
}  // namespace strata::optim
