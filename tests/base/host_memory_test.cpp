// base/host_memory.h: the resident set is read, a peak can be started anew, and memory the process
// touches shows in both.
#include "base/host_memory.h"

#include <cstring>
#include <memory>

#include "gtest/gtest.h"

namespace strata {
namespace {

TEST(HostMemoryTest, TouchedMemoryShowsInTheResidentSetAndItsPeak) {
  const std::int64_t before = resident_bytes();
  ASSERT_GT(before, 0) << "/proc/self/status has no VmRSS";
  ASSERT_GE(peak_resident_bytes(), before);
  const bool fresh = reset_peak_resident();
  constexpr std::size_t kBytes = std::size_t{64} << 20;
  {
    auto block = std::make_unique<char[]>(kBytes);
    std::memset(block.get(), 1, kBytes);  // touched: every page resident
    EXPECT_GE(resident_bytes(), before + static_cast<std::int64_t>(kBytes) * 9 / 10);
  }
  // Freed again, the peak keeps it.
  EXPECT_GE(peak_resident_bytes(), before + static_cast<std::int64_t>(kBytes) * 9 / 10);
  if (fresh) {
    // A new peak starts at the resident set of the moment.
    ASSERT_TRUE(reset_peak_resident());
    EXPECT_LT(peak_resident_bytes(), resident_bytes() + static_cast<std::int64_t>(kBytes) / 2);
  }
}

}  // namespace
}  // namespace strata
