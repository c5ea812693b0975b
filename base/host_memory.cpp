// base/host_memory.cpp: the process's resident set from /proc/self/status (base/host_memory.h).
#include "base/host_memory.h"

#include <fstream>
#include <string>
#include <string_view>

namespace strata {
namespace {

// A "Name:   123 kB" line of /proc/self/status in bytes, or -1.
std::int64_t status_kib_field(std::string_view name) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.size() > name.size() && line.compare(0, name.size(), name) == 0 &&
        line[name.size()] == ':') {
      try {
        return static_cast<std::int64_t>(std::stoll(line.substr(name.size() + 1))) * 1024;
      } catch (...) {
        return -1;
      }
    }
  }
  return -1;
}

}  // namespace

std::int64_t resident_bytes() { return status_kib_field("VmRSS"); }

std::int64_t peak_resident_bytes() { return status_kib_field("VmHWM"); }

bool reset_peak_resident() {
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return false;
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

}  // namespace strata
