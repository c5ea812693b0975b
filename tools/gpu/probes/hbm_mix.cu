// tools/gpu/probes/hbm_mix.cu: how much of the HBM bandwidth a cudaMemcpy device-to-device copy
// shows can a kernel with Adam's access pattern reach at all? PERF.md asks the resident Adam step
// for >= 85% of the copy's figure; strata's fused kernel reaches 84-85%. Adam reads four float32
// streams (p, g, m, v) and writes three back in place (28 B a parameter); a copy reads one and
// writes another. If a kernel that does Adam's reads and writes with almost no arithmetic lands
// where Adam does, the remaining gap is the memory system's, not the kernel's.
//
// Kernels, each over the same 4 x 1.5 GiB of float32 (float4 loads, grid-stride loops with 2, 4, 8
// and 16 blocks of 256 threads per SM, and one thread per float4):
//   copy      b = a                       (8 B an element: 1 read, 1 write)
//   read4     sum of p + g + m + v        (16 B: 4 reads)
//   mix4r3w   p += 1e-7 g, m = 0.9 m + g, v = 0.999 v + g g   (28 B: Adam's 4 reads, 3 writes)
// against cudaMemcpyAsync device to device of 1.5 GiB (2 x bytes counted). Median of 7 after one
// warm-up; GB/s decimal and as a fraction of the copy.
//   nvcc -O3 -arch=sm_90 tools/gpu/probes/hbm_mix.cu -o /tmp/hbm_mix && /tmp/hbm_mix
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "check.h"

constexpr size_t kBytes = 1536ull << 20;  // per array
constexpr size_t kVec = kBytes / sizeof(float4);

__global__ void copy_kernel(const float4* __restrict__ a, float4* __restrict__ b, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    b[i] = a[i];
  }
}

__global__ void read4_kernel(const float4* __restrict__ p, const float4* __restrict__ g,
                             const float4* __restrict__ m, const float4* __restrict__ v, float* out,
                             size_t n) {
  float acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const float4 a = p[i], b = g[i], c = m[i], d = v[i];
    acc += a.x + b.y + c.z + d.w;
  }
  if (acc == 12345.678f) *out = acc;  // keeps the loads; never true for the data used
}

__device__ __forceinline__ void mix(float& p, float g, float& m, float& v) {
  p += 1e-7f * g;
  m = 0.9f * m + g;
  v = 0.999f * v + g * g;
}

__global__ void mix_kernel(float4* __restrict__ p, const float4* __restrict__ g,
                           float4* __restrict__ m, float4* __restrict__ v, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    float4 a = p[i], c = m[i], d = v[i];
    const float4 b = g[i];
    mix(a.x, b.x, c.x, d.x);
    mix(a.y, b.y, c.y, d.y);
    mix(a.z, b.z, c.z, d.z);
    mix(a.w, b.w, c.w, d.w);
    p[i] = a;
    m[i] = c;
    v[i] = d;
  }
}

float median_ms(const std::function<void()>& launch) {
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  std::vector<float> ms;
  for (int rep = 0; rep < 8; ++rep) {
    CHECK(cudaEventRecord(start));
    launch();
    CHECK(cudaEventRecord(end));
    CHECK(cudaEventSynchronize(end));
    CHECK(cudaGetLastError());
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, start, end));
    if (rep > 0) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(end));
  return ms[ms.size() / 2];
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  float4 *p, *g, *m, *v;
  float* out;
  CHECK(cudaMalloc(&p, kBytes));
  CHECK(cudaMalloc(&g, kBytes));
  CHECK(cudaMalloc(&m, kBytes));
  CHECK(cudaMalloc(&v, kBytes));
  CHECK(cudaMalloc(&out, sizeof(float)));
  CHECK(cudaMemset(p, 0, kBytes));
  CHECK(cudaMemset(g, 0, kBytes));
  CHECK(cudaMemset(m, 0, kBytes));
  CHECK(cudaMemset(v, 0, kBytes));

  const double copy_gbps =
      2.0 * kBytes /
      (median_ms([&] { CHECK(cudaMemcpyAsync(m, p, kBytes, cudaMemcpyDefault)); }) * 1e6);
  std::printf("cudaMemcpyAsync device to device: %.1f GB/s (the reference)\n", copy_gbps);
  const int sms = prop.multiProcessorCount;
  std::vector<std::pair<const char*, int>> grids = {{"2/SM", 2 * sms},
                                                    {"4/SM", 4 * sms},
                                                    {"8/SM", 8 * sms},
                                                    {"16/SM", 16 * sms},
                                                    {"1 thread/float4", int((kVec + 255) / 256)}};
  for (const auto& grid : grids) {
    const char* name = grid.first;
    const int blocks = grid.second;
    const double c =
        2.0 * kBytes / (median_ms([&] { copy_kernel<<<blocks, 256>>>(p, m, kVec); }) * 1e6);
    const double r =
        4.0 * kBytes /
        (median_ms([&] { read4_kernel<<<blocks, 256>>>(p, g, m, v, out, kVec); }) * 1e6);
    const double x =
        7.0 * kBytes / (median_ms([&] { mix_kernel<<<blocks, 256>>>(p, g, m, v, kVec); }) * 1e6);
    std::printf(
        "grid %-16s copy %7.1f GB/s (%.3f)  read4 %7.1f GB/s (%.3f)  mix4r3w %7.1f GB/s (%.3f)\n",
        name, c, c / copy_gbps, r, r / copy_gbps, x, x / copy_gbps);
  }
  CHECK(cudaFree(p));
  CHECK(cudaFree(g));
  CHECK(cudaFree(m));
  CHECK(cudaFree(v));
  CHECK(cudaFree(out));
  return 0;
}
