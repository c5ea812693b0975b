// See Note [Stream copies] in base/stream_copy.h.
#include "base/stream_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace strata {

void stream_copy(void* dst, const void* src, std::size_t bytes) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
#if defined(__x86_64__)
  constexpr std::size_t kVector = 16;  // SSE2's streaming store: every x86-64 has it
  const std::size_t head =
      std::min(bytes, (kVector - reinterpret_cast<std::uintptr_t>(d) % kVector) % kVector);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  const std::size_t body = bytes / kVector * kVector;
  auto stream = [&](std::size_t at) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + at),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + at)));
  };
  std::size_t i = 0;
  for (; i + 4 * kVector <= body; i += 4 * kVector) {  // a cache line at a time
    stream(i);
    stream(i + kVector);
    stream(i + 2 * kVector);
    stream(i + 3 * kVector);
  }
  for (; i < body; i += kVector) stream(i);
  std::memcpy(d + body, s + body, bytes - body);
  _mm_sfence();
#else
  std::memcpy(d, s, bytes);
#endif
}

}  // namespace strata
