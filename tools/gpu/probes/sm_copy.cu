// tools/gpu/probes/sm_copy.cu: copies between page-locked host memory and device memory made by a
// kernel that reads or writes the host memory over the link (mapped pinned memory), against the
// copy engines: each direction alone and both at once, by the number of blocks, and whether the
// kernel slows a busy kernel beside it. 1 GiB each way, from mmap + cudaHostRegister(Mapped), the
// median of 5. The kernel is the one the branch experiment/sm-h2d fetched states with
// (runtime/sm_copy.cu there); bench/results/2026-11-27-H200-sm-h2d-experiment/ has the runs.
//   nvcc -O2 -arch=sm_90 tools/gpu/probes/sm_copy.cu -o /tmp/sm_copy && /tmp/sm_copy
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "check.h"

constexpr size_t kBytes = 1ull << 30;

// A grid-stride copy in 16-byte words, four loads in flight a thread (bytes a multiple of 16).
__global__ void copy_kernel(uint4* __restrict__ dst, const uint4* __restrict__ src, size_t n16) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < 4; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < n16; i += stride) dst[i] = src[i];
}

void kernel_copy(void* dst, const void* src, int blocks, cudaStream_t s) {
  copy_kernel<<<blocks, 512, 0, s>>>(static_cast<uint4*>(dst), static_cast<const uint4*>(src),
                                     kBytes / 16);
  CHECK(cudaGetLastError());
}

__global__ void busy(float* x, int iters) {  // compute bound, every SM
  float v = x[blockIdx.x * blockDim.x + threadIdx.x];
  for (int i = 0; i < iters; ++i) v = v * 1.0000001f + 0.5f;
  x[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

template <typename F>
float median_ms(cudaStream_t s, F f) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(cudaEventRecord(a, s));
    f();
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[2];
}

// Runs h2d (on stream a) and d2h (on stream b) together, timed from one event on `a`; -1 blocks
// means the copy engine, 0 no copy that way.
float both(int h2d_blocks, int d2h_blocks, void* dev, void* dev2, void* host, void* back,
           void* mapped_host, void* mapped_back, cudaStream_t a, cudaStream_t b) {
  return median_ms(a, [&] {
    cudaEvent_t start, done;
    CHECK(cudaEventCreateWithFlags(&start, cudaEventDisableTiming));
    CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    CHECK(cudaEventRecord(start, a));
    CHECK(cudaStreamWaitEvent(b, start));
    if (d2h_blocks < 0) CHECK(cudaMemcpyAsync(back, dev2, kBytes, cudaMemcpyDefault, b));
    if (d2h_blocks > 0) kernel_copy(mapped_back, dev2, d2h_blocks, b);
    if (h2d_blocks < 0) CHECK(cudaMemcpyAsync(dev, host, kBytes, cudaMemcpyDefault, a));
    if (h2d_blocks > 0) kernel_copy(dev, mapped_host, h2d_blocks, a);
    CHECK(cudaEventRecord(done, b));
    CHECK(cudaStreamWaitEvent(a, done));
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(done));
  });
}

int main() {
  void* host = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  void* back = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  std::memset(host, 3, kBytes);
  std::memset(back, 0, kBytes);
  CHECK(cudaHostRegister(host, kBytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
  CHECK(cudaHostRegister(back, kBytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
  void *dev = nullptr, *dev2 = nullptr, *mapped_host = nullptr, *mapped_back = nullptr;
  float* work = nullptr;
  CHECK(cudaMalloc(&dev, kBytes));
  CHECK(cudaMalloc(&dev2, kBytes));
  CHECK(cudaMemset(dev2, 5, kBytes));
  CHECK(cudaMalloc(&work, 132 * 8 * 256 * sizeof(float)));
  CHECK(cudaMemset(work, 0, 132 * 8 * 256 * sizeof(float)));
  CHECK(cudaHostGetDevicePointer(&mapped_host, host, 0));
  CHECK(cudaHostGetDevicePointer(&mapped_back, back, 0));
  cudaStream_t a, b, comp;
  CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&comp, cudaStreamNonBlocking));
  auto gbps = [](float ms) { return kBytes / ms / 1e6; };
  auto run = [&](const char* what, int h, int d) {
    const float ms = both(h, d, dev, dev2, host, back, mapped_host, mapped_back, a, b);
    std::printf("%-44s %7.2f ms  %5.1f GB/s %s\n", what, ms, gbps(ms),
                h != 0 && d != 0 ? "each way" : "");
  };
  char what[96];
  run("H2D, copy engine", -1, 0);
  run("D2H, copy engine", 0, -1);
  run("both ways, copy engines", -1, -1);
  for (int blocks : {4, 8, 16, 32, 64, 132}) {
    std::snprintf(what, sizeof what, "H2D, kernel %d blocks", blocks);
    run(what, blocks, 0);
    std::snprintf(what, sizeof what, "D2H, kernel %d blocks", blocks);
    run(what, 0, blocks);
    std::snprintf(what, sizeof what, "both: H2D kernel %d blocks, D2H engine", blocks);
    run(what, blocks, -1);
    std::snprintf(what, sizeof what, "both: H2D engine, D2H kernel %d blocks", blocks);
    run(what, -1, blocks);
    std::snprintf(what, sizeof what, "both: kernels of %d blocks each", blocks);
    run(what, blocks, blocks);
  }
  // A compute-bound kernel on every SM, alone and beside a 16-block H2D kernel.
  const float busy_alone = median_ms(comp, [&] { busy<<<132 * 8, 256, 0, comp>>>(work, 8000000); });
  float busy_ms = 0;
  const float with_busy = median_ms(a, [&] {
    cudaEvent_t start, e0, e1;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    CHECK(cudaEventRecord(start, a));
    CHECK(cudaStreamWaitEvent(comp, start));
    CHECK(cudaEventRecord(e0, comp));
    busy<<<132 * 8, 256, 0, comp>>>(work, 8000000);
    CHECK(cudaEventRecord(e1, comp));
    kernel_copy(dev, mapped_host, 16, a);
    CHECK(cudaStreamWaitEvent(a, e1));
    CHECK(cudaEventSynchronize(e1));
    CHECK(cudaEventElapsedTime(&busy_ms, e0, e1));
  });
  std::printf("busy kernel alone %.2f ms; beside a 16-block H2D kernel %.2f ms (both done %.2f)\n",
              busy_alone, busy_ms, with_busy);
  std::vector<unsigned char> check(4096);
  CHECK(cudaMemcpy(check.data(), static_cast<char*>(dev) + kBytes - 4096, 4096, cudaMemcpyDefault));
  const bool h2d_ok = check[0] == 3 && check[4095] == 3;
  const bool d2h_ok = static_cast<unsigned char*>(back)[kBytes - 1] == 5;
  std::printf("bytes copied right: H2D %s, D2H %s\n", h2d_ok ? "yes" : "NO", d2h_ok ? "yes" : "NO");
  return h2d_ok && d2h_ok ? 0 : 1;
}
