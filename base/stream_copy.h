// base/stream_copy.h: a copy whose destination is not read again soon, written with non-temporal
// stores where the processor has them (x86-64), so that it costs host memory only the bytes it
// reads and the bytes it writes (the host kernel's undo of a step taken in backward).
//
// Example:
//   strata::stream_copy(undo + offset, state + offset, bytes);   // ordered before the return
//
// Note [Stream copies]
// ~~~~~~~~~~~~~~~~~~~~
// An ordinary store to a line the cache does not hold reads that line from memory first, so a
// copy into cold memory moves three bytes a byte copied: the source read, the destination read,
// the destination written. A non-temporal store writes a whole line without reading it and
// leaves it out of the caches, which suits a destination only a rare redo reads. The stores are
// weakly ordered: stream_copy ends with a store fence, so whatever the calling thread does next
// (releasing a lock, finishing a pool's part) publishes the copy as an ordinary store would.
// Elsewhere, and for the unaligned head and tail, it is memcpy.
#pragma once

#include <cstddef>

namespace strata {

// Copies `bytes` from `src` to `dst` (not overlapping), as memcpy does.
void stream_copy(void* dst, const void* src, std::size_t bytes);

}  // namespace strata
