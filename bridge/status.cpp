#include "bridge/status.h"

#include <string>

namespace strata::bridge {

void throw_status(const absl::Status& status) {
  // An OK status here is a bug in the caller.
  TORCH_INTERNAL_ASSERT(!status.ok(), "strata::bridge::throw_status called with an OK status");
  const std::string message =
      str_cat(absl::StatusCodeToString(status.code()), ": ", status.message());
  // The c10 subclasses become ValueError / torch.OutOfMemoryError / NotImplementedError in Python.
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      C10_THROW_ERROR(ValueError, message);
    case absl::StatusCode::kResourceExhausted:
      C10_THROW_ERROR(OutOfMemoryError, message);
    case absl::StatusCode::kUnimplemented:
      C10_THROW_ERROR(NotImplementedError, message);
    default:
      C10_THROW_ERROR(Error, message);
  }
}

}  // namespace strata::bridge
