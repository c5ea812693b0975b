// Leak tests: after many alloc/free cycles every tier is back to zero live bytes with an empty
// leak report; a block left live on purpose shows up with its owner tag.
#include <random>
#include <string>
#include <vector>

#include "allocator/tiered_allocator.h"
#include "gtest/gtest.h"
#include "tests/allocator/test_util.h"

namespace strata::alloc {
namespace {

std::unique_ptr<TieredAllocator> make_tracking_allocator() {
  AllocatorOptions options;
  options.device = DeviceBackend::kSimulated;
  options.simulated_device.capacity = kGiB;
  options.track_allocations = true;
  auto created = TieredAllocator::create(std::move(options));
  STRATA_CHECK(created.ok(), created.status().message());
  return std::move(*created);
}

TEST(LeakTest, ManyCyclesLeaveNothingLive) {
  auto allocator = make_tracking_allocator();
  std::mt19937_64 rng(testing::test_seed(42));
  for (int cycle = 0; cycle < 200; ++cycle) {
    std::vector<std::pair<Tier, void*>> live;
    for (int i = 0; i < 50; ++i) {
      const Tier tier = kAllTiers[rng() % kNumTiers];
      const std::size_t bytes = 1 + rng() % (4 * kMiB);
      absl::StatusOr<void*> p =
          allocator->allocate(tier, bytes, {.owner = str_cat("cycle", cycle, ".", i)});
      ASSERT_TRUE(p.ok()) << p.status();
      live.emplace_back(tier, *p);
    }
    std::shuffle(live.begin(), live.end(), rng);
    for (auto [tier, p] : live) ASSERT_TRUE(allocator->deallocate(tier, p).ok());
  }
  for (Tier tier : kAllTiers) {
    TierStats s = allocator->stats(tier);
    EXPECT_EQ(s.allocated_bytes.current, 0) << tier_name(tier);
    EXPECT_EQ(s.requested_bytes.current, 0) << tier_name(tier);
    EXPECT_EQ(s.active_blocks.current, 0) << tier_name(tier);
    EXPECT_GT(s.allocated_bytes.peak, 0) << tier_name(tier);
    EXPECT_TRUE(allocator->pool(tier).validate().ok());
  }
  EXPECT_TRUE(allocator->leak_report().empty());
  EXPECT_EQ(allocator->format_leak_report(), "leak report: no live allocations\n");
  // Everything freed: trimming returns every byte to the upstreams.
  ASSERT_TRUE(allocator->trim_all().ok());
  for (Tier tier : kAllTiers) EXPECT_EQ(allocator->stats(tier).reserved_bytes.current, 0);
}

TEST(LeakTest, ABlockLeftLiveAppearsWithItsOwner) {
  auto allocator = make_tracking_allocator();
  absl::StatusOr<void*> kept =
      allocator->allocate(Tier::kPinnedHost, 3000, {.owner = "layer7.exp_avg_sq"});
  ASSERT_TRUE(kept.ok());
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<void*> p = allocator->allocate(Tier::kGpu, 1 << 20, {.owner = "temp"});
    ASSERT_TRUE(p.ok());
    ASSERT_TRUE(allocator->deallocate(Tier::kGpu, *p).ok());
  }
  std::vector<LiveAllocation> report = allocator->leak_report();
  ASSERT_EQ(report.size(), 1u);
  EXPECT_EQ(report[0].tier, Tier::kPinnedHost);
  EXPECT_EQ(report[0].ptr, *kept);
  EXPECT_EQ(report[0].requested, 3000u);
  EXPECT_EQ(report[0].size, 3072u);
  EXPECT_EQ(report[0].owner, "layer7.exp_avg_sq");
  const std::string text = allocator->format_leak_report();
  EXPECT_NE(text.find("leak report: 1 live allocation(s), 3.00 KiB"), std::string::npos) << text;
  EXPECT_NE(text.find("pinned_host"), std::string::npos) << text;
  EXPECT_NE(text.find("owner=layer7.exp_avg_sq"), std::string::npos) << text;
  ASSERT_TRUE(allocator->deallocate(Tier::kPinnedHost, *kept).ok());
  EXPECT_TRUE(allocator->leak_report().empty());
}

TEST(LeakTest, WithoutTrackingTheReportStillListsLiveBlocks) {
  AllocatorOptions options;
  options.device = DeviceBackend::kSimulated;
  auto allocator = TieredAllocator::create(std::move(options));
  ASSERT_TRUE(allocator.ok());
  absl::StatusOr<void*> p = (*allocator)->allocate(Tier::kGpu, 100, {.owner = "ignored"});
  ASSERT_TRUE(p.ok());
  std::vector<LiveAllocation> report = (*allocator)->leak_report();
  ASSERT_EQ(report.size(), 1u);
  EXPECT_EQ(report[0].owner, "");
  EXPECT_NE((*allocator)->format_leak_report().find("owner=<tracking off>"), std::string::npos);
  ASSERT_TRUE((*allocator)->deallocate(Tier::kGpu, *p).ok());
}

}  // namespace
}  // namespace strata::alloc
