// base/units.h: byte-size constants, checked size arithmetic and human-readable sizes.
//
// Example:
//   auto bytes = strata::checked_mul(count, sizeof(float));   // std::nullopt on overflow
//   std::string s = strata::format_bytes(3 * strata::kMiB);     // "3.00 MiB"
//   absl::StatusOr<std::size_t> b = strata::parse_bytes("8GiB");
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace strata {

inline constexpr std::size_t kKiB = std::size_t{1} << 10;
inline constexpr std::size_t kMiB = std::size_t{1} << 20;
inline constexpr std::size_t kGiB = std::size_t{1} << 30;

// a * b, or std::nullopt when the product does not fit in std::size_t.
std::optional<std::size_t> checked_mul(std::size_t a, std::size_t b);

// x rounded up to a multiple of `multiple` (a power of two), or std::nullopt on overflow.
std::optional<std::size_t> checked_round_up(std::size_t x, std::size_t multiple);

constexpr bool is_power_of_two(std::size_t x) { return x != 0 && (x & (x - 1)) == 0; }

// "512 B", "1.50 KiB", "3.00 MiB", "12.00 GiB".
std::string format_bytes(std::size_t bytes);

// Parses "4096", "64KiB", "8GiB", "1.5GB" (KB/MB/GB are powers of ten, KiB/MiB/GiB of two).
absl::StatusOr<std::size_t> parse_bytes(std::string_view text);

}  // namespace strata
