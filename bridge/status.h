// bridge/status.h: where absl::Status meets C++ exceptions, at the LibTorch boundary.
//
// Library code returns absl::Status; LibTorch code throws c10::Error. bridge/ is the one place that
// converts, in both directions (docs/design.md, section 8):
//   - check / unwrap turn a failed Status into a c10::Error whose message is "CODE: message", the
//     runtime's message unchanged, so a LibTorch user (and Python, through the c10 error types)
//     sees what the library said. Codes with a c10 counterpart raise it: kInvalidArgument ->
//     c10::ValueError, kResourceExhausted -> c10::OutOfMemoryError, kUnimplemented ->
//     c10::NotImplementedError; the rest raise c10::Error. All derive from c10::Error.
//   - capture_exceptions runs LibTorch code on behalf of library code and turns whatever it throws
//     into absl::InternalError, so no exception crosses into code that does not expect one.
//
// Example:
//   rt::TensorHandle h = bridge::unwrap(runtime.register_tensor(spec, t.data_ptr()));
//   bridge::check(runtime.migrate(h, rt::Tier::kPinnedHost));
//   absl::Status s = bridge::capture_exceptions([&] { t.mul_(2); });  // never throws
#pragma once

#include <exception>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/strings.h"
#include "c10/util/Exception.h"

namespace strata::bridge {

// Throws the c10 error for a failed status; see the overview. Never returns.
[[noreturn]] void throw_status(const absl::Status& status);

// Throws (see throw_status) unless `status` is OK.
inline void check(const absl::Status& status) {
  if (!status.ok()) [[unlikely]] {
    throw_status(status);
  }
}

// The value, or the status thrown as a c10 error.
template <typename T>
T unwrap(absl::StatusOr<T> value) {
  check(value.status());
  return std::move(value).value();
}

namespace status_internal {

template <typename T>
struct IsStatusOr : std::false_type {};
template <typename T>
struct IsStatusOr<absl::StatusOr<T>> : std::true_type {};

// What capture_exceptions returns for a callback returning R.
template <typename R>
using Captured =
    std::conditional_t<std::is_void_v<R> || std::is_same_v<R, absl::Status>, absl::Status,
                       std::conditional_t<IsStatusOr<R>::value, R, absl::StatusOr<R>>>;

// The message without LibTorch's C++ backtrace, which belongs in a log, not in a Status.
inline absl::Status internal_error(const char* kind, const char* what) {
  return absl::InternalError(str_cat(kind, ": ", what));
}

}  // namespace status_internal

// Runs fn() and returns its outcome as a Status: OK (fn returns void), fn's own Status or
// StatusOr, or fn's value wrapped in a StatusOr. A thrown c10::Error becomes
// absl::InternalError("c10::Error: <message>"); any other std::exception "exception: <what()>".
template <typename F>
auto capture_exceptions(F&& fn) noexcept -> status_internal::Captured<std::invoke_result_t<F&&>> {
  using R = std::invoke_result_t<F&&>;
  try {
    if constexpr (std::is_void_v<R>) {
      std::forward<F>(fn)();
      return absl::OkStatus();
    } else {
      return std::forward<F>(fn)();
    }
  } catch (const c10::Error& e) {
    return status_internal::internal_error("c10::Error", e.what_without_backtrace());
  } catch (const std::exception& e) {
    return status_internal::internal_error("exception", e.what());
  } catch (...) {
    return absl::InternalError("unknown exception");
  }
}

}  // namespace strata::bridge
