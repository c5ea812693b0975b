// optim/kept_states.h: the states a host kernel keeps before it overwrites them, for the redo of a
// step taken in backward (See Note [Undo in the host kernel]). Plain C++ (no Abseil) so .cu files
// may include it through step_tensor.h.
//
// Example:
//   KeptStates keep;
//   keep.states[0] = {.from = exp_avg, .to = undo, .layout = StateLayout::kF32};
//   keep.count = 1;
//   t.keep = &keep;                  // a StepTensor or an AdamTensor of a host kernel
//   rule->step_host(&t, 1, hyper, inv, &pool);   // undo holds exp_avg as it was
//
// Note [Undo in the host kernel]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A host step taken in backward is speculative (See Note [Host steps in backward] in
// adam_host_speculation.cpp): the states it overwrites must be kept until finish_step knows the
// step holds. They used to be copied whole into the undo buffer before the kernel ran: a pass of
// its own that read every state from host memory and wrote it again, before the kernel read them
// a second time, on the host memory that the link's copies and the kernel share (a hybrid step is
// bound by it: See Note [Host rate in the step] in policies/hybrid.cpp). Now the kernel keeps
// them: each thread copies a piece of kKeepPiece elements of every state to the undo buffer (See
// Note [Stream copies] in base/stream_copy.h) and then steps that piece, whose states the copy
// left in its caches. So the states are read from memory once, and the undo costs host memory only
// its writes. The arithmetic is untouched: the kernel steps each piece as it stepped the whole
// range, with the same element indices (compressed moments' rounding draws by index), and an int8
// piece starts on a block. Every rule's host kernel honours StepTensor::keep; kept_states_test
// checks it for each.
#pragma once

#include <array>
#include <cstdint>

namespace strata::optim {

inline constexpr int kMaxKeptStates = 4;  // kMaxStates in step_tensor.h
// Elements a piece: a multiple of an int8 block (state_codec.h's kStateBlock), and few enough that
// a piece's states stay in a core's caches between the copy and the kernel.
inline constexpr std::int64_t kKeepPiece = 16 * 1024;

// How a state of a parameter of numel elements lies in memory.
enum class StateLayout : std::uint8_t {
  kF32,         // numel float32 values
  kBF16,        // numel bfloat16 values
  kInt8Blocks,  // int8_state_bytes(numel): the codes, padded to whole blocks, then a scale a block
};

struct KeptState {
  const void* from = nullptr;  // the state the kernel steps
  void* to = nullptr;          // where its values before the step go, in the same layout
  StateLayout layout = StateLayout::kF32;
};

struct KeptStates {
  std::array<KeptState, kMaxKeptStates> states = {};
  int count = 0;
};

// Copies elements [lo, hi) of each kept state of a parameter of `numel` elements; an int8 state's
// range starts on a block, and ends on one or at numel (then its last block's padding is kept
// too), with the scales of the blocks it covers.
void keep_states(const KeptStates& keep, std::int64_t numel, std::int64_t lo, std::int64_t hi);

// Runs step(lo, hi) over [lo, hi): in pieces of kKeepPiece elements, each kept first, when `keep`
// is set; in one call otherwise.
template <typename Step>
void keep_then_step(const KeptStates* keep, std::int64_t numel, std::int64_t lo, std::int64_t hi,
                    Step&& step) {
  if (keep == nullptr) return step(lo, hi);
  for (std::int64_t piece = lo; piece < hi; piece += kKeepPiece) {
    const std::int64_t end = hi - piece > kKeepPiece ? piece + kKeepPiece : hi;
    keep_states(*keep, numel, piece, end);
    step(piece, end);
  }
}

}  // namespace strata::optim
