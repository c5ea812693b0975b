// tests/reliability/fault_sites.h: the fault sites the reliability sweeps share
// (fault_sweep_test.cpp, fault_sweep_adam_test.cpp): allocations from one upstream, a kind of
// device call failing once, or a sticky device error.
//
// Example:
//   for (const Site& site : device_sites()) faults->fail_call(site.call, k);
#pragma once

#include <string>
#include <vector>

#include "tests/runtime/fault_injection.h"

namespace strata::rt::sweep {

// A site: allocations from one upstream (once or from the k-th on), a kind of device call, or a
// sticky device error starting at the k-th call of a kind.
struct Site {
  enum Kind { kAllocOnce, kAllocPersistent, kDeviceCall, kSticky };
  std::string name;
  Kind kind = kDeviceCall;
  int upstream = -1;
  DeviceCall call = DeviceCall::kCopy;
};

// Every kind of device call failing once, and sticky errors from a copy and from a host wait.
inline std::vector<Site> device_sites() {
  std::vector<Site> sites;
  for (int c = 0; c < kNumDeviceCalls; ++c) {
    const auto call = static_cast<DeviceCall>(c);
    sites.push_back({std::string(device_call_name(call)), Site::kDeviceCall, -1, call});
  }
  sites.push_back({"sticky error from a copy", Site::kSticky, -1, DeviceCall::kCopy});
  sites.push_back({"sticky error from a host wait", Site::kSticky, -1, DeviceCall::kHostWait});
  return sites;
}

}  // namespace strata::rt::sweep
