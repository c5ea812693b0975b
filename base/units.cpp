#include "base/units.h"

#include <cmath>
#include <cstdio>

#include <cctype>
#include <cstdlib>
#include "base/strings.h"

namespace strata {

std::optional<std::size_t> checked_mul(std::size_t a, std::size_t b) {
  std::size_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

std::optional<std::size_t> checked_round_up(std::size_t x, std::size_t multiple) {
  std::size_t out = 0;
  if (__builtin_add_overflow(x, multiple - 1, &out)) return std::nullopt;
  return out & ~(multiple - 1);
}

std::string format_bytes(std::size_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < kKiB) return str_cat(bytes, " B");
  double value = static_cast<double>(bytes) / 1024.0;
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f %s", value, kUnits[unit]);
  return buf;
}

absl::StatusOr<std::size_t> parse_bytes(std::string_view text) {
  auto strip = [](std::string_view v) {
    while (!v.empty() && std::isspace(static_cast<unsigned char>(v.front()))) v.remove_prefix(1);
    while (!v.empty() && std::isspace(static_cast<unsigned char>(v.back()))) v.remove_suffix(1);
    return v;
  };
  std::string_view s = strip(text);
  std::size_t split = 0;
  while (split < s.size() &&
         (std::isdigit(static_cast<unsigned char>(s[split])) || s[split] == '.')) {
    ++split;
  }
  const std::string digits(s.substr(0, split));
  char* end = nullptr;
  const double number = split == 0 ? -1.0 : std::strtod(digits.c_str(), &end);
  if (split == 0 || end != digits.c_str() + digits.size() || !(number >= 0)) {
    return absl::InvalidArgumentError(
        str_cat("cannot parse a byte size from '", text, "': expected e.g. 4096, 64KiB, 8GiB"));
  }
  std::string unit(strip(s.substr(split)));
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double scale = 0;
  if (unit.empty() || unit == "b")
    scale = 1;
  else if (unit == "kib" || unit == "k")
    scale = 1024.0;
  else if (unit == "mib" || unit == "m")
    scale = 1024.0 * 1024;
  else if (unit == "gib" || unit == "g")
    scale = 1024.0 * 1024 * 1024;
  else if (unit == "tib" || unit == "t")
    scale = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb")
    scale = 1e3;
  else if (unit == "mb")
    scale = 1e6;
  else if (unit == "gb")
    scale = 1e9;
  else if (unit == "tb")
    scale = 1e12;
  else {
    return absl::InvalidArgumentError(str_cat("unknown byte unit '", unit, "' in '", text,
                                              "': use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB"));
  }
  const double bytes = std::floor(number * scale);
  if (bytes >= 18446744073709551615.0) {
    return absl::InvalidArgumentError(str_cat("byte size '", text, "' does not fit in 64 bits"));
  }
  return static_cast<std::size_t>(bytes);
}

}  // namespace strata
