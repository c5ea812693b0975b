// bench/link_rig.h: raw pinned cudaMemcpyAsync in each direction and both at once, the reference
// the runtime and optimizer benchmarks divide by. CUDA only.
//
// Example:
//   LinkRig rig;
//   STRATA_RETURN_IF_ERROR(init_link_rig(rig, /*seed=*/1));
//   STRATA_ASSIGN_OR_RETURN(LinkTiming t, run_link(rig, /*h2d=*/true, /*d2h=*/true));
//   double gbps_each_way = kBytesPerDirection / t.span_ms / 1e6;
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "bench/bench_util.h"

namespace strata::bench {

inline constexpr std::size_t kPieceBytes = 256 * kMiB;
inline constexpr int kPieces = 16;
inline constexpr std::size_t kBytesPerDirection = kPieceBytes * kPieces;

}  // namespace strata::bench

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>

#include "allocator/cuda_status.h"

namespace strata::bench {

using alloc::cuda_status;  // See allocator/cuda_status.h

inline char* piece(void* base, int k) {
  return static_cast<char*>(base) + static_cast<std::size_t>(k) * kPieceBytes;
}

// Index 0: the H2D direction (host[0] -> gpu[0] on stream[0]); index 1: D2H (gpu[1] -> host[1]
// on stream[1]); so "both" never copies into a buffer the other direction reads. Freed by the
// destructor.
struct LinkRig {
  std::array<void*, 2> gpu{};
  std::array<void*, 2> host{};
  std::array<cudaStream_t, 2> stream{};
  std::array<cudaEvent_t, 2> start{};
  std::array<cudaEvent_t, 2> end{};

  LinkRig() = default;
  LinkRig(const LinkRig&) = delete;
  LinkRig& operator=(const LinkRig&) = delete;
  ~LinkRig() {
    for (int d = 0; d < 2; ++d) {
      if (stream[d] != nullptr) (void)cudaStreamSynchronize(stream[d]);
      if (start[d] != nullptr) (void)cudaEventDestroy(start[d]);
      if (end[d] != nullptr) (void)cudaEventDestroy(end[d]);
      if (stream[d] != nullptr) (void)cudaStreamDestroy(stream[d]);
      if (gpu[d] != nullptr) (void)cudaFree(gpu[d]);
      if (host[d] != nullptr) (void)cudaFreeHost(host[d]);
    }
  }
};

inline absl::Status init_link_rig(LinkRig& rig, std::uint64_t seed) {
  for (int d = 0; d < 2; ++d) {
    STRATA_RETURN_IF_ERROR(cuda_status(cudaMalloc(&rig.gpu[d], kBytesPerDirection), "cudaMalloc"));
    STRATA_RETURN_IF_ERROR(cuda_status(
        cudaHostAlloc(&rig.host[d], kBytesPerDirection, cudaHostAllocPortable), "cudaHostAlloc"));
    STRATA_RETURN_IF_ERROR(cuda_status(
        cudaStreamCreateWithFlags(&rig.stream[d], cudaStreamNonBlocking), "cudaStreamCreate"));
    STRATA_RETURN_IF_ERROR(cuda_status(cudaEventCreate(&rig.start[d]), "cudaEventCreate"));
    STRATA_RETURN_IF_ERROR(cuda_status(cudaEventCreate(&rig.end[d]), "cudaEventCreate"));
  }
  // Pseudo-random payloads in both host buffers, and in the D2H / HBM source on the GPU.
  auto* words = static_cast<std::uint64_t*>(rig.host[0]);
  SplitMix64 rng(seed);
  for (std::size_t i = 0; i < kPieceBytes / sizeof(std::uint64_t); ++i) words[i] = rng.next();
  for (int k = 1; k < kPieces; ++k) std::memcpy(piece(rig.host[0], k), rig.host[0], kPieceBytes);
  std::memcpy(rig.host[1], rig.host[0], kBytesPerDirection);
  return cuda_status(
      cudaMemcpy(rig.gpu[1], rig.host[0], kBytesPerDirection, cudaMemcpyHostToDevice),
      "cudaMemcpy (fill)");
}

struct LinkTiming {
  double h2d_ms = 0;
  double d2h_ms = 0;
  double span_ms = 0;  // first start to last end
};

// One pass: 16 pieces of 256 MiB in each direction asked for, interleaved so that with both
// directions the two streams start within microseconds of each other.
inline absl::StatusOr<LinkTiming> run_link(LinkRig& rig, bool h2d, bool d2h) {
  const std::array<bool, 2> on = {h2d, d2h};
  const std::array<void*, 2> dst = {rig.gpu[0], rig.host[1]};
  const std::array<void*, 2> src = {rig.host[0], rig.gpu[1]};
  constexpr std::array<cudaMemcpyKind, 2> kKinds = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost};
  for (int d = 0; d < 2; ++d) {
    if (on[d]) {
      STRATA_RETURN_IF_ERROR(cuda_status(cudaEventRecord(rig.start[d], rig.stream[d]), "record"));
    }
  }
  for (int k = 0; k < kPieces; ++k) {
    for (int d = 0; d < 2; ++d) {
      if (!on[d]) continue;
      STRATA_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(piece(dst[d], k), piece(src[d], k),
                                                         kPieceBytes, kKinds[d], rig.stream[d]),
                                         "cudaMemcpyAsync"));
    }
  }
  for (int d = 0; d < 2; ++d) {
    if (on[d]) {
      STRATA_RETURN_IF_ERROR(cuda_status(cudaEventRecord(rig.end[d], rig.stream[d]), "record"));
    }
  }
  for (int d = 0; d < 2; ++d) {
    if (on[d]) {
      STRATA_RETURN_IF_ERROR(cuda_status(cudaEventSynchronize(rig.end[d]), "cudaEventSynchronize"));
    }
  }
  LinkTiming t;
  float ms = 0;
  if (on[0]) {
    STRATA_RETURN_IF_ERROR(
        cuda_status(cudaEventElapsedTime(&ms, rig.start[0], rig.end[0]), "elapsed"));
    t.h2d_ms = ms;
  }
  if (on[1]) {
    STRATA_RETURN_IF_ERROR(
        cuda_status(cudaEventElapsedTime(&ms, rig.start[1], rig.end[1]), "elapsed"));
    t.d2h_ms = ms;
  }
  if (on[0] && on[1]) {
    // Relative to the H2D start; the D2H start may be a little before or after it.
    float d2h_start = 0;
    float d2h_end = 0;
    STRATA_RETURN_IF_ERROR(
        cuda_status(cudaEventElapsedTime(&d2h_start, rig.start[0], rig.start[1]), "elapsed"));
    STRATA_RETURN_IF_ERROR(
        cuda_status(cudaEventElapsedTime(&d2h_end, rig.start[0], rig.end[1]), "elapsed"));
    t.span_ms = std::max<double>(t.h2d_ms, d2h_end) - std::min<double>(0.0, d2h_start);
  } else {
    t.span_ms = on[0] ? t.h2d_ms : t.d2h_ms;
  }
  return t;
}

// Note [Adjacent floor]
// ~~~~~~~~~~~~~~~~~~~~~
// Raw passes taken next to the runs a benchmark times, one before each run and outside its clock,
// so that a ratio to the link compares a run with the link as it was then. The PCIe link of some
// hosts drifts by 10% within minutes (an H100 host, 2026-11-23: 41.6 GB/s per direction both at
// once at the start of a run, 37.8 GB/s two minutes later), and a figure taken once per process
// misjudges every run timed after it.
//
//   AdjacentLink both(rig, /*h2d=*/true, /*d2h=*/true);
//   for (auto _ : state) { STRATA_RETURN_IF_ERROR(both.sample()); ...timed run... }
//   double floor_ms = bytes_each_way / (both.span_gbps() * 1e9) * 1e3;
class AdjacentLink {
 public:
  AdjacentLink(LinkRig& rig, bool h2d, bool d2h) : rig_(rig), h2d_(h2d), d2h_(d2h) {}

  absl::Status sample() {
    STRATA_ASSIGN_OR_RETURN(LinkTiming t, run_link(rig_, h2d_, d2h_));
    h2d_ms_ += t.h2d_ms;
    d2h_ms_ += t.d2h_ms;
    span_ms_ += t.span_ms;
    ++passes_;
    return absl::OkStatus();
  }

  // Decimal GB/s over every pass so far (0 before the first): each direction's own rate, and
  // bytes each way over the span of the directions asked for (the floor's denominator).
  double h2d_gbps() const { return gbps(h2d_ms_); }
  double d2h_gbps() const { return gbps(d2h_ms_); }
  double span_gbps() const { return gbps(span_ms_); }

 private:
  double gbps(double ms) const {
    return ms > 0 ? static_cast<double>(kBytesPerDirection) * passes_ / (ms * 1e6) : 0;
  }

  LinkRig& rig_;
  bool h2d_;
  bool d2h_;
  double h2d_ms_ = 0;
  double d2h_ms_ = 0;
  double span_ms_ = 0;
  int passes_ = 0;
};

}  // namespace strata::bench

#endif  // STRATA_HAS_CUDA
