// tools/gpu/probes/free_overlap.cu: does giving GPU memory back to the driver wait for copies in
// flight that do not touch it? A phase switch (runtime/phase.cpp) copies every tensor out and then
// frees the GPU tier's segments; if a free can run while later copies still stream, the switch can
// free each segment as soon as its own copies are done and hide the frees behind the link.
//
// For each way of freeing (cudaFree; VMM cuMemUnmap + cuMemRelease + cuMemAddressFree;
// cudaFreeAsync on a pool, then cudaMemPoolTrimTo) it queues one large device-to-pinned copy,
// frees an unrelated buffer while the copy streams, and prints how long the free call took and
// whether the whole took the copy's time (overlapped) or the copy's plus the free's (serialized).
//   nvcc -O2 -arch=sm_90 tools/gpu/probes/free_overlap.cu -lcuda -o /tmp/free_overlap
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>

#include "check.h"
#define CHECK_CU(x)                                                      \
  do {                                                                   \
    CUresult r = (x);                                                    \
    if (r != CUDA_SUCCESS) {                                             \
      const char* s = nullptr;                                           \
      cuGetErrorString(r, &s);                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

constexpr size_t kCopy = 4ull << 30;  // about 80 ms at 50 GB/s
constexpr size_t kFreed = 1ull << 30;

struct Vmm {
  CUdeviceptr va = 0;
  CUmemGenericAllocationHandle h = 0;
  size_t size = 0;
};

Vmm vmm_alloc(size_t size) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t gran = 0;
  CHECK_CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  Vmm v;
  v.size = (size + gran - 1) / gran * gran;
  CHECK_CU(cuMemAddressReserve(&v.va, v.size, 0, 0, 0));
  CHECK_CU(cuMemCreate(&v.h, v.size, &prop, 0));
  CHECK_CU(cuMemMap(v.va, v.size, 0, v.h, 0));
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CHECK_CU(cuMemSetAccess(v.va, v.size, &access, 1));
  CHECK(cudaMemset(reinterpret_cast<void*>(v.va), 1, v.size));
  return v;
}

void vmm_free(const Vmm& v) {
  CHECK_CU(cuMemUnmap(v.va, v.size));
  CHECK_CU(cuMemRelease(v.h));
  CHECK_CU(cuMemAddressFree(v.va, v.size));
}

int main() {
  CHECK(cudaSetDevice(0));
  CHECK(cudaFree(nullptr));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s\n", prop.name);
  void* src = nullptr;
  void* host = nullptr;
  CHECK(cudaMalloc(&src, kCopy));
  CHECK(cudaMemset(src, 3, kCopy));
  CHECK(cudaHostAlloc(&host, kCopy, cudaHostAllocDefault));
  cudaStream_t d2h, side;
  CHECK(cudaStreamCreateWithFlags(&d2h, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaMemPool_t pool;
  CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));

  auto copy_alone = [&] {
    CHECK(cudaDeviceSynchronize());
    const auto t = Clock::now();
    CHECK(cudaMemcpyAsync(host, src, kCopy, cudaMemcpyDeviceToHost, d2h));
    CHECK(cudaStreamSynchronize(d2h));
    return ms_since(t);
  };
  // prepare() makes the buffer to free (untimed); release() frees it while the copy streams.
  auto trial = [&](const char* name, std::function<void()> prepare, std::function<void()> release,
                   double alone_ms) {
    prepare();
    CHECK(cudaDeviceSynchronize());
    const auto t = Clock::now();
    CHECK(cudaMemcpyAsync(host, src, kCopy, cudaMemcpyDeviceToHost, d2h));
    const auto f = Clock::now();
    release();
    const double free_ms = ms_since(f);
    CHECK(cudaStreamSynchronize(d2h));
    const double total = ms_since(t);
    // The free's own cost, taken with the device idle.
    prepare();
    CHECK(cudaDeviceSynchronize());
    const auto g = Clock::now();
    release();
    const double idle_free_ms = ms_since(g);
    std::printf(
        "%-34s free call during copy %8.2f ms (idle %6.2f ms); copy+free %8.2f ms vs copy "
        "alone %8.2f ms: %s\n",
        name, free_ms, idle_free_ms, total, alone_ms,
        free_ms > 0.5 * alone_ms ? "WAITED FOR THE COPY" : "overlapped");
  };

  double alone = 0;
  for (int i = 0; i < 3; ++i) alone = copy_alone();
  std::printf("copy alone: %zu MiB in %.2f ms (%.1f GB/s)\n", kCopy >> 20, alone,
              kCopy / alone / 1e6);

  for (int rep = 0; rep < 2; ++rep) {
    void* buf = nullptr;
    trial(
        "cudaFree (1 GiB)",
        [&] {
          CHECK(cudaMalloc(&buf, kFreed));
          CHECK(cudaMemset(buf, 0, kFreed));
        },
        [&] { CHECK(cudaFree(buf)); }, alone);
    void* bufs[8];
    trial(
        "cudaFree (8 x 128 MiB)",
        [&] {
          for (auto& b : bufs) {
            CHECK(cudaMalloc(&b, kFreed / 8));
            CHECK(cudaMemset(b, 0, kFreed / 8));
          }
        },
        [&] {
          for (auto& b : bufs) CHECK(cudaFree(b));
        },
        alone);
    Vmm v;
    trial(
        "VMM unmap+release+addressfree", [&] { v = vmm_alloc(kFreed); }, [&] { vmm_free(v); },
        alone);
    trial(
        "cudaFreeAsync(side) + TrimTo(0)",
        [&] {
          CHECK(cudaMallocAsync(&buf, kFreed, side));
          CHECK(cudaMemsetAsync(buf, 0, kFreed, side));
        },
        [&] {
          CHECK(cudaFreeAsync(buf, side));
          CHECK(cudaStreamSynchronize(side));
          CHECK(cudaMemPoolTrimTo(pool, 0));
        },
        alone);
    // And the opposite question for the reload: does cudaMalloc wait for copies in flight?
    buf = nullptr;
    trial(
        "cudaMalloc (1 GiB) during copy",
        [&] {
          if (buf != nullptr) CHECK(cudaFree(buf));
          buf = nullptr;
        },
        [&] { CHECK(cudaMalloc(&buf, kFreed)); }, alone);
    CHECK(cudaFree(buf));
  }
  return 0;
}
