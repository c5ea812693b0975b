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
  for (std::size_t i = 0; i < body; i += 4 * kVector) {
    if (body - i >= 4 * kVector) {  // a cache line at a time
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + kVector));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 2 * kVector));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 3 * kVector));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + kVector), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 2 * kVector), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 3 * kVector), e);
    } else {
      for (std::size_t j = i; j < body; j += kVector) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + j),
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + j)));
      }
      break;
    }
  }
  std::memcpy(d + body, s + body, bytes - body);
  _mm_sfence();
#else
  std::memcpy(d, s, bytes);
#endif
}

}  // namespace strata
