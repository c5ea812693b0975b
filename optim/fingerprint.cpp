#include "optim/fingerprint.h"

#include <cstring>

namespace strata::optim {
namespace {

template <typename Int>
void add_fingerprint(const void* data, std::int64_t numel, std::int64_t out[2]) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::int64_t sum = 0;
  std::uint64_t mixed = 0;
  for (std::int64_t i = 0; i < numel; ++i) {
    Int v;
    std::memcpy(&v, p + i * static_cast<std::int64_t>(sizeof(Int)), sizeof(Int));
    sum += v;
    mixed += static_cast<std::uint64_t>(static_cast<std::int64_t>(v)) * fingerprint_weight(i);
  }
  out[0] = static_cast<std::int64_t>(static_cast<std::uint64_t>(out[0]) +
                                     static_cast<std::uint64_t>(sum));
  out[1] = static_cast<std::int64_t>(static_cast<std::uint64_t>(out[1]) + mixed);
}

}  // namespace

void fingerprint_cpu(const void* data, std::int64_t numel, int elem_bytes, std::int64_t out[2]) {
  if (elem_bytes == 2) {
    add_fingerprint<std::int16_t>(data, numel, out);
  } else {
    add_fingerprint<std::int32_t>(data, numel, out);
  }
}

}  // namespace strata::optim
