// base/host_memory.h: how much host memory this process holds, from Linux's /proc: its resident
// set now and at its peak, and a way to start a new peak, so that a run can report the host memory
// it took (strata-train, the benchmarks, the soak test).
//
// Example:
//   const bool fresh = strata::reset_peak_resident();
//   run();
//   std::int64_t peak = strata::peak_resident_bytes();  // since the reset when `fresh`
#pragma once

#include <cstdint>

namespace strata {

// Bytes of this process resident in RAM now (VmRSS); -1 where /proc does not say.
std::int64_t resident_bytes();

// The largest resident set since the process started or since the last successful
// reset_peak_resident() (VmHWM); -1 where /proc does not say.
std::int64_t peak_resident_bytes();

// Starts a new peak at the current resident set (writes "5" to /proc/self/clear_refs); false
// where the kernel does not allow it, and the peak then still covers everything before.
bool reset_peak_resident();

}  // namespace strata
