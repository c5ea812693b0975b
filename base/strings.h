// base/strings.h: str_cat / str_append for messages.
//
// Debian's Abseil (20220623) is built with its own absl::string_view rather than std::string_view,
// and absl::StrCat formats no pointers; error messages here mix std::string_view, absl::string_view
// (from Status::message()), numbers and addresses, so strata keeps this small formatter.
//
// Example:
//   std::string m = strata::str_cat("tier ", tier_name(t), ": ", ptr, " is not live, ", 3, " B");
//   strata::str_append(&m, "; cause: ", status.message());
#pragma once

#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

#include "absl/base/config.h"
#include "absl/strings/string_view.h"

namespace strata {
namespace strings_internal {

inline void append_piece(std::string& out, std::string_view s) { out.append(s); }
inline void append_piece(std::string& out, const std::string& s) { out.append(s); }
inline void append_piece(std::string& out, const char* s) {
  out.append(s != nullptr ? s : "(null)");
}
#if !defined(ABSL_USES_STD_STRING_VIEW)
inline void append_piece(std::string& out, absl::string_view s) { out.append(s.data(), s.size()); }
#endif
inline void append_piece(std::string& out, char c) { out.push_back(c); }
inline void append_piece(std::string& out, bool b) { out.append(b ? "true" : "false"); }
template <typename T>
requires(std::is_integral_v<T>) void append_piece(std::string& out, T v) {
  out.append(std::to_string(v));
}
inline void append_piece(std::string& out, double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  out.append(buf);
}
inline void append_piece(std::string& out, const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  out.append(buf);
}

}  // namespace strings_internal

template <typename... Args>
void str_append(std::string* out, const Args&... args) {
  (strings_internal::append_piece(*out, args), ...);
}

template <typename... Args>
std::string str_cat(const Args&... args) {
  std::string out;
  str_append(&out, args...);
  return out;
}

}  // namespace strata
