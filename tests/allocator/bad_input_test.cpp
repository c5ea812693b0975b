// Bad inputs to the allocator, each with its exact error and a check that nothing changed
// (stats, pool invariants, and the next good call still works). Runs per tier where it applies.
#include <cstdint>
#include <limits>
#include <string>

#include "allocator/tiered_allocator.h"
#include "gtest/gtest.h"
#include "tests/allocator/test_util.h"
#include "tests/census.h"

namespace strata::alloc {
namespace {

using strata::testing::expect_refused;
using testing::same_levels;

class BadInputTest : public ::testing::TestWithParam<Tier> {
 protected:
  void SetUp() override {
    AllocatorOptions options;
    options.device = DeviceBackend::kSimulated;
    options.simulated_device.capacity = 256 * kMiB;
    options.budgets = {64 * kMiB, 64 * kMiB, 64 * kMiB};
    auto created = TieredAllocator::create(std::move(options));
    ASSERT_TRUE(created.ok()) << created.status();
    allocator_ = std::move(*created);
    // Some state for the bad calls to leave alone.
    live_ = *allocator_->allocate(tier(), 3 * kMiB);
    absl::StatusOr<void*> freed = allocator_->allocate(tier(), 5000);
    ASSERT_TRUE(freed.ok());
    freed_ = *freed;
    ASSERT_TRUE(allocator_->deallocate(tier(), freed_).ok());
    before_ = allocator_->stats(tier());
  }

  void TearDown() override {
    // Nothing changed, and the allocator still works.
    EXPECT_TRUE(same_levels(before_, allocator_->stats(tier())));
    for (Tier t : kAllTiers) EXPECT_TRUE(allocator_->pool(t).validate().ok());
    absl::StatusOr<void*> p = allocator_->allocate(tier(), 1000);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(allocator_->deallocate(tier(), *p).ok());
    ASSERT_TRUE(allocator_->deallocate(tier(), live_).ok());
  }

  Tier tier() const { return GetParam(); }

  std::unique_ptr<TieredAllocator> allocator_;
  void* live_ = nullptr;
  void* freed_ = nullptr;
  TierStats before_;
};

TEST_P(BadInputTest, SizeZero) {
  expect_refused("allocate size 0", allocator_->allocate(tier(), 0).status(),
                 absl::StatusCode::kInvalidArgument,
                 str_cat("allocate in tier ", tier_name(tier()),
                         ": size 0; strata hands out no empty blocks (a zero-size tensor needs no "
                         "storage)"));
}

TEST_P(BadInputTest, SizeMax) {
  expect_refused("allocate SIZE_MAX",
                 allocator_->allocate(tier(), std::numeric_limits<std::size_t>::max()).status(),
                 absl::StatusCode::kInvalidArgument,
                 str_cat("allocate in tier ", tier_name(tier()),
                         ": size 18446744073709551615 bytes is above the largest allocation "
                         "(1125899906842624 bytes, 1 PiB)"));
}

TEST_P(BadInputTest, SizeWhoseRoundingOverflows) {
  expect_refused(
      "allocate a size whose rounding overflows",
      allocator_->allocate(tier(), std::numeric_limits<std::size_t>::max() - 100).status(),
      absl::StatusCode::kInvalidArgument,
      str_cat("allocate in tier ", tier_name(tier()),
              ": size 18446744073709551515 bytes is above the largest allocation "
              "(1125899906842624 bytes, 1 PiB)"));
}

TEST_P(BadInputTest, SizeProductOverflow) {
  // count * element size overflows: callers compute sizes with checked_mul, which says so.
  strata::testing::census_checks().insert("a size product that overflows");
  EXPECT_FALSE(checked_mul(std::size_t{1} << 40, std::size_t{1} << 30).has_value());
  EXPECT_EQ(checked_mul(std::size_t{1} << 20, 4), std::size_t{4} << 20);
}

TEST_P(BadInputTest, AboveBudget) {
  const TierStats s = allocator_->stats(tier());
  expect_refused(
      "allocate above the budget", allocator_->allocate(tier(), 65 * kMiB).status(),
      absl::StatusCode::kResourceExhausted,
      str_cat("out of memory in tier ", tier_name(tier()),
              ": tried to allocate 65.00 MiB (68157440 bytes asked); reserved ",
              format_bytes(s.reserved_bytes.current), ", allocated ",
              format_bytes(s.allocated_bytes.current), ", budget 64.00 MiB, largest free block ",
              format_bytes(s.largest_free_block),
              allocator_->pool(tier()).expandable()
                  ? "; mapping 66.00 MiB more would pass the budget"
                  : "; a new segment of 66.00 MiB would pass the budget"));
}

TEST_P(BadInputTest, AlignmentZero) {
  expect_refused("allocate with alignment 0",
                 allocator_->allocate(tier(), 100, {.alignment = 0}).status(),
                 absl::StatusCode::kInvalidArgument,
                 str_cat("allocate in tier ", tier_name(tier()),
                         ": alignment 0 is not a power of two between 1 and 512"));
}

TEST_P(BadInputTest, AlignmentNotPowerOfTwo) {
  expect_refused("allocate with an alignment not a power of two",
                 allocator_->allocate(tier(), 100, {.alignment = 384}).status(),
                 absl::StatusCode::kInvalidArgument,
                 str_cat("allocate in tier ", tier_name(tier()),
                         ": alignment 384 is not a power of two between 1 and 512"));
}

TEST_P(BadInputTest, AlignmentTooLarge) {
  expect_refused("allocate with an alignment above the largest",
                 allocator_->allocate(tier(), 100, {.alignment = 4096}).status(),
                 absl::StatusCode::kInvalidArgument,
                 str_cat("allocate in tier ", tier_name(tier()),
                         ": alignment 4096 is not a power of two between 1 and 512"));
}

TEST_P(BadInputTest, ForeignPointer) {
  int on_stack = 0;
  expect_refused("free a foreign pointer", allocator_->deallocate(tier(), &on_stack),
                 absl::StatusCode::kInvalidArgument,
                 str_cat("deallocate in tier ", tier_name(tier()), ": ",
                         static_cast<const void*>(&on_stack), " was not allocated by this tier"));
}

TEST_P(BadInputTest, NullPointer) {
  expect_refused("free a null pointer", allocator_->deallocate(tier(), nullptr),
                 absl::StatusCode::kInvalidArgument,
                 str_cat("deallocate in tier ", tier_name(tier()), ": ",
                         static_cast<const void*>(nullptr), " was not allocated by this tier"));
}

TEST_P(BadInputTest, DoubleFree) {
  expect_refused("free twice", allocator_->deallocate(tier(), freed_),
                 absl::StatusCode::kFailedPrecondition,
                 str_cat("deallocate in tier ", tier_name(tier()), ": ",
                         static_cast<const void*>(freed_), " is not live (double free?)"));
}

TEST_P(BadInputTest, InteriorPointer) {
  void* interior = static_cast<std::byte*>(live_) + 4096;
  expect_refused(
      "free an interior pointer", allocator_->deallocate(tier(), interior),
      absl::StatusCode::kInvalidArgument,
      str_cat("deallocate in tier ", tier_name(tier()), ": ", static_cast<const void*>(interior),
              " is an interior pointer, 4096 bytes into the live block at ",
              static_cast<const void*>(live_)));
}

TEST_P(BadInputTest, FreeIntoTheWrongTier) {
  const Tier other = tier() == Tier::kGpu ? Tier::kPageableHost : Tier::kGpu;
  expect_refused(
      "free into the wrong tier", allocator_->deallocate(other, live_),
      absl::StatusCode::kInvalidArgument,
      str_cat("deallocate in tier ", tier_name(other), ": ", static_cast<const void*>(live_),
              " belongs to tier ", tier_name(tier()), ", not ", tier_name(other)));
}

TEST_P(BadInputTest, RecordStreamOnAFreedBlock) {
  expect_refused("record_stream on a freed block",
                 allocator_->record_stream(tier(), freed_, nullptr),
                 absl::StatusCode::kInvalidArgument,
                 str_cat("record_stream in tier ", tier_name(tier()), ": ",
                         static_cast<const void*>(freed_), " is not a live block"));
}

TEST_P(BadInputTest, MarkLastUseOnAFreedBlock) {
  expect_refused("mark_last_use on a freed block",
                 allocator_->mark_last_use(tier(), freed_, nullptr),
                 absl::StatusCode::kInvalidArgument,
                 str_cat("mark_last_use in tier ", tier_name(tier()), ": ",
                         static_cast<const void*>(freed_), " is not a live block"));
}

TEST_P(BadInputTest, BudgetZero) {
  expect_refused("a budget of 0", allocator_->set_budget(tier(), 0),
                 absl::StatusCode::kInvalidArgument,
                 str_cat("budget of tier ", tier_name(tier()), " must be > 0"));
}

INSTANTIATE_TEST_SUITE_P(AllTiers, BadInputTest,
                         ::testing::Values(Tier::kGpu, Tier::kPinnedHost, Tier::kPageableHost),
                         [](const ::testing::TestParamInfo<Tier>& info) {
                           return std::string(tier_name(info.param));
                         });

TEST(BadConfigTest, InitialReservationAboveBudget) {
  AllocatorOptions options;
  options.device = DeviceBackend::kSimulated;
  options.budgets[tier_index(Tier::kPinnedHost)] = 16 * kMiB;
  options.initial_reservation[tier_index(Tier::kPinnedHost)] = 32 * kMiB;
  expect_refused(
      "an initial reservation above the budget",
      TieredAllocator::create(std::move(options)).status(), absl::StatusCode::kInvalidArgument,
      "initial reservation of tier pinned_host (32.00 MiB) is above its budget (16.00 MiB)");
}

TEST(BadConfigTest, BudgetZeroAtCreation) {
  AllocatorOptions options;
  options.device = DeviceBackend::kSimulated;
  options.budgets[tier_index(Tier::kGpu)] = 0;
  expect_refused("a budget of 0 at creation", TieredAllocator::create(std::move(options)).status(),
                 absl::StatusCode::kInvalidArgument,
                 "budget of tier gpu is 0; use kNoBudget for none");
}

TEST(BadConfigTest, UnknownTierName) {
  expect_refused("an unknown tier name", parse_tier("hbm").status(),
                 absl::StatusCode::kInvalidArgument,
                 "unknown tier 'hbm'; valid tiers: gpu, pinned_host, pageable_host");
}

TEST(BadConfigTest, ByteSizes) {
  EXPECT_EQ(*parse_bytes("8GiB"), 8 * kGiB);
  EXPECT_EQ(*parse_bytes(" 1.5 KiB "), 1536u);
  EXPECT_EQ(*parse_bytes("2GB"), 2000000000u);
  expect_refused("a byte size with an unknown unit", parse_bytes("8 parsecs").status(),
                 absl::StatusCode::kInvalidArgument,
                 "unknown byte unit 'parsecs' in '8 parsecs': use B, KiB, MiB, GiB, TiB, KB, MB, "
                 "GB or TB");
  expect_refused("a negative byte size", parse_bytes("-1GiB").status(),
                 absl::StatusCode::kInvalidArgument,
                 "cannot parse a byte size from '-1GiB': expected e.g. 4096, 64KiB, 8GiB");
  expect_refused("a byte size that overflows", parse_bytes("99999999999TiB").status(),
                 absl::StatusCode::kInvalidArgument,
                 "byte size '99999999999TiB' does not fit in 64 bits");
}

// The census binary (tests/reliability) prints how many distinct checks all suites tried.

}  // namespace

}  // namespace strata::alloc
