// base/status.h: error propagation and invariant checks shared by every strata layer.
//
// Debian's Abseil (20220623) has neither absl/log nor a RETURN_IF_ERROR macro, so strata keeps its
// own three small macros. Library code returns absl::Status / absl::StatusOr; bugs abort through
// STRATA_CHECK with a message.
//
// Example:
//   absl::StatusOr<void*> grow(Pool& pool, std::size_t bytes) {
//     STRATA_RETURN_IF_ERROR(pool.reserve(bytes));
//     STRATA_ASSIGN_OR_RETURN(void* segment, pool.upstream().allocate(bytes));
//     STRATA_CHECK(segment != nullptr, "upstream returned null for ", bytes, " bytes");
//     return segment;
//   }
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/strings.h"

namespace strata {

// Prints "file:line: CHECK failed: cond: message" to stderr and aborts. Never returns.
[[noreturn]] void check_failed(const char* file, int line, const char* condition,
                               const std::string& message);

}  // namespace strata

#define STRATA_CONCAT_INNER_(a, b) a##b
#define STRATA_CONCAT_(a, b) STRATA_CONCAT_INNER_(a, b)

#define STRATA_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status strata_status_ = (expr);          \
    if (!strata_status_.ok()) return strata_status_; \
  } while (false)

#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_CONCAT_(strata_statusor_, __LINE__), lhs, expr)

#define STRATA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

#define STRATA_CHECK(condition, ...)                                                          \
  do {                                                                                        \
    if (!(condition)) {                                                                       \
      ::strata::check_failed(__FILE__, __LINE__, #condition, ::strata::str_cat(__VA_ARGS__)); \
    }                                                                                         \
  } while (false)
