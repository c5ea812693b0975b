// Bad inputs to the allocator, each with its exact error and a check that nothing changed
// (stats, pool invariants, and the next good call still works). Runs per tier where it applies.
#include <cstdint>
#include <limits>
#include <string>

#include "allocator/tiered_allocator.h"
#include "gtest/gtest.h"
#include "tests/allocator/test_util.h"

namespace strata::alloc {
namespace {

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
    ++cases_;
  }

  Tier tier() const { return GetParam(); }

  void expect_error(const absl::Status& status, absl::StatusCode code, const std::string& text) {
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_NE(std::string(status.message()).find(text), std::string::npos)
        << "message: " << status.message() << "\nexpected to contain: " << text;
  }

  std::unique_ptr<TieredAllocator> allocator_;
  void* live_ = nullptr;
  void* freed_ = nullptr;
  TierStats before_;
  static inline int cases_ = 0;

 public:
  static int cases() { return cases_; }
};

TEST_P(BadInputTest, SizeZero) {
  expect_error(allocator_->allocate(tier(), 0).status(), absl::StatusCode::kInvalidArgument,
               str_cat("allocate in tier ", tier_name(tier()), ": size 0"));
}

TEST_P(BadInputTest, SizeMax) {
  expect_error(allocator_->allocate(tier(), std::numeric_limits<std::size_t>::max()).status(),
               absl::StatusCode::kInvalidArgument,
               "size 18446744073709551615 bytes is above the largest allocation (1125899906842624 "
               "bytes, 1 PiB)");
}

TEST_P(BadInputTest, SizeWhoseRoundingOverflows) {
  expect_error(allocator_->allocate(tier(), std::numeric_limits<std::size_t>::max() - 100).status(),
               absl::StatusCode::kInvalidArgument, "is above the largest allocation");
}

TEST_P(BadInputTest, SizeProductOverflow) {
  // count * element size overflows: callers compute sizes with checked_mul, which says so.
  EXPECT_FALSE(checked_mul(std::size_t{1} << 40, std::size_t{1} << 30).has_value());
  EXPECT_EQ(checked_mul(std::size_t{1} << 20, 4), std::size_t{4} << 20);
}

TEST_P(BadInputTest, AboveBudget) {
  absl::Status s = allocator_->allocate(tier(), 65 * kMiB).status();
  expect_error(s, absl::StatusCode::kResourceExhausted,
               str_cat("out of memory in tier ", tier_name(tier()),
                       ": tried to allocate 65.00 MiB (68157440 bytes asked); reserved "));
  expect_error(s, absl::StatusCode::kResourceExhausted, "budget 64.00 MiB, largest free block");
}

TEST_P(BadInputTest, AlignmentZero) {
  expect_error(allocator_->allocate(tier(), 100, {.alignment = 0}).status(),
               absl::StatusCode::kInvalidArgument,
               "alignment 0 is not a power of two between 1 and 512");
}

TEST_P(BadInputTest, AlignmentNotPowerOfTwo) {
  expect_error(allocator_->allocate(tier(), 100, {.alignment = 384}).status(),
               absl::StatusCode::kInvalidArgument,
               "alignment 384 is not a power of two between 1 and 512");
}

TEST_P(BadInputTest, AlignmentTooLarge) {
  expect_error(allocator_->allocate(tier(), 100, {.alignment = 4096}).status(),
               absl::StatusCode::kInvalidArgument,
               "alignment 4096 is not a power of two between 1 and 512");
}

TEST_P(BadInputTest, ForeignPointer) {
  int on_stack = 0;
  expect_error(allocator_->deallocate(tier(), &on_stack), absl::StatusCode::kInvalidArgument,
               "was not allocated by this tier");
}

TEST_P(BadInputTest, NullPointer) {
  expect_error(allocator_->deallocate(tier(), nullptr), absl::StatusCode::kInvalidArgument,
               "was not allocated by this tier");
}

TEST_P(BadInputTest, DoubleFree) {
  expect_error(allocator_->deallocate(tier(), freed_), absl::StatusCode::kFailedPrecondition,
               "is not live (double free?)");
}

TEST_P(BadInputTest, InteriorPointer) {
  void* interior = static_cast<std::byte*>(live_) + 4096;
  expect_error(allocator_->deallocate(tier(), interior), absl::StatusCode::kInvalidArgument,
               "is an interior pointer, 4096 bytes into the live block at");
}

TEST_P(BadInputTest, FreeIntoTheWrongTier) {
  const Tier other = tier() == Tier::kGpu ? Tier::kPageableHost : Tier::kGpu;
  expect_error(allocator_->deallocate(other, live_), absl::StatusCode::kInvalidArgument,
               str_cat("belongs to tier ", tier_name(tier()), ", not ", tier_name(other)));
}

TEST_P(BadInputTest, RecordStreamOnAFreedBlock) {
  expect_error(allocator_->record_stream(tier(), freed_, nullptr),
               absl::StatusCode::kInvalidArgument, "is not a live block");
}

TEST_P(BadInputTest, BudgetZero) {
  expect_error(allocator_->set_budget(tier(), 0), absl::StatusCode::kInvalidArgument,
               "must be > 0");
}

INSTANTIATE_TEST_SUITE_P(AllTiers, BadInputTest,
                         ::testing::Values(Tier::kGpu, Tier::kPinnedHost, Tier::kPageableHost),
                         [](const ::testing::TestParamInfo<Tier>& info) {
                           return std::string(tier_name(info.param));
                         });

// The BadConfigTest cases below, one each.
constexpr int kBadConfigCases = 4;

TEST(BadConfigTest, InitialReservationAboveBudget) {
  AllocatorOptions options;
  options.device = DeviceBackend::kSimulated;
  options.budgets[tier_index(Tier::kPinnedHost)] = 16 * kMiB;
  options.initial_reservation[tier_index(Tier::kPinnedHost)] = 32 * kMiB;
  auto allocator = TieredAllocator::create(std::move(options));
  ASSERT_FALSE(allocator.ok());
  EXPECT_EQ(allocator.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(allocator.status().message(),
            "initial reservation of tier pinned_host (32.00 MiB) is above its budget (16.00 MiB)");
}

TEST(BadConfigTest, BudgetZeroAtCreation) {
  AllocatorOptions options;
  options.device = DeviceBackend::kSimulated;
  options.budgets[tier_index(Tier::kGpu)] = 0;
  auto allocator = TieredAllocator::create(std::move(options));
  ASSERT_FALSE(allocator.ok());
  EXPECT_EQ(allocator.status().message(), "budget of tier gpu is 0; use kNoBudget for none");
}

TEST(BadConfigTest, UnknownTierName) {
  absl::StatusOr<Tier> t = parse_tier("hbm");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(),
            "unknown tier 'hbm'; valid tiers: gpu, pinned_host, pageable_host");
}

TEST(BadConfigTest, ByteSizes) {
  EXPECT_EQ(*parse_bytes("8GiB"), 8 * kGiB);
  EXPECT_EQ(*parse_bytes(" 1.5 KiB "), 1536u);
  EXPECT_EQ(*parse_bytes("2GB"), 2000000000u);
  EXPECT_EQ(parse_bytes("8 parsecs").status().message(),
            "unknown byte unit 'parsecs' in '8 parsecs': use B, KiB, MiB, GiB, TiB, KB, MB, GB or "
            "TB");
  EXPECT_FALSE(parse_bytes("-1GiB").ok());
  EXPECT_FALSE(parse_bytes("99999999999TiB").ok());
}

// Printed last so the count shows in the log (RELIABILITY.md: the suites count their cases).
class CountPrinter : public ::testing::Environment {
 public:
  void TearDown() override {
    std::printf("allocator bad inputs tried: %d (per tier where it applies)\n",
                testing::allocator_bad_inputs_tried());
  }
};
const auto* const kPrinter = ::testing::AddGlobalTestEnvironment(new CountPrinter);

}  // namespace

// The census of tests/reliability adds these to its own.
int testing::allocator_bad_inputs_tried() { return BadInputTest::cases() + kBadConfigCases; }

}  // namespace strata::alloc
