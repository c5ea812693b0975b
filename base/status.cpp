#include "base/status.h"

#include <cstdio>
#include <cstdlib>

namespace strata {

void check_failed(const char* file, int line, const char* condition, const std::string& message) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s: %s\n", file, line, condition, message.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace strata
