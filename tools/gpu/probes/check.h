// tools/gpu/probes/check.h: CHECK(cuda call), the probes' one error check: on an error it prints
// the call, where it was and the runtime's message, and exits 1. Each probe is one file built
// with nvcc alone, so this header is all they share.
//   CHECK(cudaMalloc(&p, bytes));
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                                \
  do {                                                                                          \
    cudaError_t err_ = (x);                                                                     \
    if (err_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)
