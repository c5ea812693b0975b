// bench/compare_parts.h: the parts of strata_optim_compare, one comparison (or one family of
// curves) a file, each run by bench/optim_compare.cpp in `rounds` rounds over the machinery of
// bench/compare_rounds.h (what each part compares: bench/optim_compare.cpp). A part records its
// series, comparisons and curves in g_results and reports failures through fail(); it returns
// nothing. CUDA only; the parts that compare with LibTorch peers alone fail without LibTorch.
//
// Example:
//   part_resident(/*rounds=*/7);
//   STRATA_RETURN_IF_ERROR(write_json("compare.json"));
//   return g_results.failed ? 1 : 0;
#pragma once

#include "bench/bench_util.h"
#include "bench/compare_rounds.h"

namespace strata::bench {

#ifdef STRATA_HAS_CUDA
// bench/compare_resident.cpp: strata keep_on_gpu against at::_fused_adamw_, all on the GPU.
void part_resident(int rounds);

// bench/compare_curves.cpp: layer_prefetch K=1 against offloaded bytes (2 .. 32 layers of the full
// model), against layers (128e6 parameters in 8 .. 512 layers), and over 10^4 small tensors
// against the same layers as one tensor each (with the LibTorch pipeline).
void part_bytes(int rounds);
void part_layers(int rounds);
void part_tensors(int rounds);

// bench/compare_first_step.cpp: time from nothing to the end of the first step and the host
// memory it took, in `rounds` rounds over 2 .. 32 layers of the full model.
void part_first_step(int rounds);

#ifdef STRATA_BENCH_TORCH
// bench/compare_streamed.cpp: layer_prefetch K=1 and K=2 against the LibTorch per-layer pipeline
// with 2 and 3 slots, and K=1 against torch's fused AdamW on the CPU.
void part_streamed(int rounds);

// bench/compare_bulk.cpp: bulk against the PyTorch .to() round trip, and offload_all +
// reload_all alone, with the GPU memory given back to the driver and kept cached.
void part_bulk(int rounds);

// bench/compare_mixed.cpp: the bfloat16 step with float32 masters, resident and streamed, against
// PyTorch's best ways.
void part_mixed(int rounds);
#else
// Built without LibTorch, these parts have no peers to compare with.
inline void part_streamed(int /*rounds*/) { fail_without_torch("streamed"); }
inline void part_bulk(int /*rounds*/) { fail_without_torch("bulk"); }
inline void part_mixed(int /*rounds*/) { fail_without_torch("mixed"); }
#endif  // STRATA_BENCH_TORCH
#endif  // STRATA_HAS_CUDA

}  // namespace strata::bench
