// See Note [Undo in the host kernel] in optim/kept_states.h.
#include "optim/kept_states.h"

#include <cstddef>

#include "base/stream_copy.h"
#include "optim/state_codec.h"

namespace strata::optim {
namespace {

void copy_bytes(const KeptState& s, std::int64_t begin, std::int64_t end) {
  if (end <= begin) return;
  stream_copy(static_cast<char*>(s.to) + begin, static_cast<const char*>(s.from) + begin,
              static_cast<std::size_t>(end - begin));
}

}  // namespace

void keep_states(const KeptStates& keep, std::int64_t numel, std::int64_t lo, std::int64_t hi) {
  for (int k = 0; k < keep.count; ++k) {
    const KeptState& s = keep.states[k];
    switch (s.layout) {
      case StateLayout::kF32:
        copy_bytes(s, lo * 4, hi * 4);
        break;
      case StateLayout::kBF16:
        copy_bytes(s, lo * 2, hi * 2);
        break;
      case StateLayout::kInt8Blocks: {
        const std::int64_t blocks = state_blocks(numel);
        const std::int64_t first = lo / kStateBlock;
        const std::int64_t last = hi >= numel ? blocks : hi / kStateBlock;  // one past
        copy_bytes(s, first * kStateBlock, last * kStateBlock);             // the codes
        const std::int64_t scales = blocks * kStateBlock;
        copy_bytes(s, scales + first * 4, scales + last * 4);
        break;
      }
    }
  }
}

}  // namespace strata::optim
