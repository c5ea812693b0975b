// tools/gpu/probes/reload_fresh.cu: why is a phase switch's reload slower than its link floor?
// h2d_pages.cu showed that host-to-device copies into GPU memory that has just changed hands (freed
// by one owner, allocated by another) run about 1.12 x slower for about 100 ms. This probe asks
// what that window belongs to and whether a reload can step around it:
//   - is it the free (the driver clearing memory given back) or the allocation?
//   - does it happen with CUDA's virtual memory management (cuMemCreate + cuMemMap, what strata's
//     GPU tier uses) as with cudaMalloc?
//   - do copies spread over 2 or 4 streams (other copy engines) escape it? Does a kernel that
//     reads host-mapped pinned memory (the SMs carry the bytes, no copy engine) escape it?
// Each case mimics strata-train's switch: strata's memory is released, a stand-in for a rollout
// engine takes 8 GiB, writes it and frees it, strata's memory is taken again, and 6 GiB are copied
// host to device in 20 MiB pieces (median of 5 repetitions, timed by events on the streams).
//   nvcc -O2 -arch=sm_90 tools/gpu/probes/reload_fresh.cu -lcuda -o /tmp/reload_fresh
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

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

constexpr size_t kTotal = 6ull << 30;
constexpr size_t kStandIn = 8ull << 30;
constexpr size_t kChunk = 20ull << 20;

// strata's memory: cudaMalloc'd, or reserved + created + mapped through the driver.
struct DeviceMemory {
  bool vmm = false;
  void* ptr = nullptr;
  CUmemGenericAllocationHandle handle = 0;
  size_t size = 0;

  void take() {
    if (!vmm) {
      CHECK(cudaMalloc(&ptr, kTotal));
      return;
    }
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t gran = 0;
    CHECK_CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    size = (kTotal + gran - 1) / gran * gran;
    CUdeviceptr va = 0;
    CHECK_CU(cuMemAddressReserve(&va, size, 0, 0, 0));
    CHECK_CU(cuMemCreate(&handle, size, &prop, 0));
    CHECK_CU(cuMemMap(va, size, 0, handle, 0));
    CUmemAccessDesc access = {};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CHECK_CU(cuMemSetAccess(va, size, &access, 1));
    ptr = reinterpret_cast<void*>(va);
  }

  void give_back() {
    CHECK(cudaDeviceSynchronize());  // unmapping does not wait for work on the memory
    if (!vmm) {
      CHECK(cudaFree(ptr));
    } else {
      const auto va = reinterpret_cast<CUdeviceptr>(ptr);
      CHECK_CU(cuMemUnmap(va, size));
      CHECK_CU(cuMemRelease(handle));
      CHECK_CU(cuMemAddressFree(va, size));
    }
    ptr = nullptr;
  }
};

struct Case {
  const char* name;
  bool fresh;     // strata's memory released and taken again before the copy
  bool vmm;       // ... through the driver's virtual memory management
  bool stand_in;  // a rollout stand-in takes, writes and frees 8 GiB in between
  int sleep_ms;   // a wait after the stand-in's free, before strata takes its memory
  int wait_ms;    // a wait after strata takes its memory, before the copy
  int streams;    // copies spread round-robin over this many streams
  bool by_sm;     // a kernel reads the pinned memory instead of the copy engines
  int blocks_per_sm = 4;
  size_t chunk = kChunk;
  size_t sm_first = 0;    // these first bytes by the SMs, the rest by a copy engine (one stream)
  bool adaptive = false;  // by the SMs until a small copy-engine copy queued first has completed
  bool split = false;     // sm_first's bytes by the SMs on one stream while a copy engine copies
                          // the rest on another, at the same time
};

// Each thread moves 16 bytes at a time from host-mapped pinned memory: the SMs, not a copy
// engine, carry the bytes over the link.
// Four loads in flight per thread before the stores (n a multiple of 4 x the grid's threads).
__global__ void sm_copy(uint4* __restrict__ dst, const uint4* __restrict__ src, size_t n) {
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (i + u * stride < n) v[u] = src[i + u * stride];
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (i + u * stride < n) dst[i + u * stride] = v[u];
    }
  }
}

size_t g_sm_bytes = 0;  // what the adaptive case's SMs copied in its last repetition

double run(const Case& c, void* host, void* host_on_device, std::vector<cudaStream_t>& streams,
           int sms) {
  DeviceMemory dev;
  dev.vmm = c.vmm;
  dev.take();
  CHECK(cudaMemset(dev.ptr, 1, kTotal));
  std::vector<double> ms;
  cudaEvent_t start, end[4], probe;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreateWithFlags(&probe, cudaEventDisableTiming));
  for (cudaEvent_t& ev : end) CHECK(cudaEventCreate(&ev));
  for (int rep = 0; rep < 5; ++rep) {
    if (c.fresh) {
      dev.give_back();
      if (c.stand_in) {
        void* other = nullptr;
        CHECK(cudaMalloc(&other, kStandIn));
        CHECK(cudaMemset(other, 3, kStandIn));
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaFree(other));
      }
      if (c.sleep_ms > 0) usleep(c.sleep_ms * 1000);
      dev.take();
      if (c.wait_ms > 0) usleep(c.wait_ms * 1000);
    }
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaEventRecord(start, streams[0]));
    for (int s = 1; s < c.streams; ++s) CHECK(cudaStreamWaitEvent(streams[s], start, 0));
    int k = 0;
    size_t off = 0;
    auto by_sm = [&](size_t n, cudaStream_t stream) {
      sm_copy<<<sms * c.blocks_per_sm, 512, 0, stream>>>(
          reinterpret_cast<uint4*>(static_cast<char*>(dev.ptr) + off),
          reinterpret_cast<const uint4*>(static_cast<char*>(host_on_device) + off), n / 16);
      CHECK(cudaGetLastError());
    };
    auto by_ce = [&](size_t n, cudaStream_t stream) {
      CHECK(cudaMemcpyAsync(static_cast<char*>(dev.ptr) + off, static_cast<char*>(host) + off, n,
                            cudaMemcpyHostToDevice, stream));
    };
    if (c.adaptive) {
      // A 2 MiB copy-engine copy first; the SMs copy 32 MiB pieces (at most 2 queued ahead)
      // until it has landed, then the copy engine takes the rest.
      by_ce(2 << 20, streams[1]);
      off += 2 << 20;
      CHECK(cudaEventRecord(probe, streams[1]));
      std::vector<cudaEvent_t> queued;
      while (off < kTotal && cudaEventQuery(probe) == cudaErrorNotReady) {
        const size_t n = std::min(size_t{32} << 20, kTotal - off);
        by_sm(n, streams[0]);
        off += n;
        cudaEvent_t e;
        CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        CHECK(cudaEventRecord(e, streams[0]));
        queued.push_back(e);
        if (queued.size() >= 2) CHECK(cudaEventSynchronize(queued[queued.size() - 2]));
      }
      g_sm_bytes = off - (2 << 20);
      for (cudaEvent_t e : queued) CHECK(cudaEventDestroy(e));
      for (; off < kTotal; off += c.chunk) by_ce(std::min(c.chunk, kTotal - off), streams[1]);
    }
    for (; off < c.sm_first; off += c.chunk) by_sm(std::min(c.chunk, c.sm_first - off), streams[0]);
    for (; off < kTotal; off += c.chunk, ++k) {
      if (c.split) {
        by_ce(std::min(c.chunk, kTotal - off), streams[1]);
        continue;
      }
      const size_t n = std::min(c.chunk, kTotal - off);
      if (c.by_sm) {
        by_sm(n, streams[k % c.streams]);
      } else {
        by_ce(n, streams[k % c.streams]);
      }
    }
    float worst = 0;
    for (int s = 0; s < c.streams; ++s) CHECK(cudaEventRecord(end[s], streams[s]));
    for (int s = 0; s < c.streams; ++s) {
      CHECK(cudaEventSynchronize(end[s]));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, start, end[s]));
      worst = std::max(worst, t);
    }
    ms.push_back(worst);
  }
  dev.give_back();
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(probe));
  for (cudaEvent_t ev : end) CHECK(cudaEventDestroy(ev));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int main() {
  CHECK(cudaFree(nullptr));
  CHECK_CU(cuInit(0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d async copy engines; 6 GiB host to device in 20 MiB copies, median of 5\n",
              prop.name, prop.asyncEngineCount);
  void* host = mmap(nullptr, kTotal, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (host == MAP_FAILED) return 2;
  std::memset(host, 2, kTotal);
  CHECK(cudaHostRegister(host, kTotal, cudaHostRegisterPortable | cudaHostRegisterMapped));
  void* host_on_device = nullptr;
  CHECK(cudaHostGetDevicePointer(&host_on_device, host, 0));
  std::vector<cudaStream_t> streams(4);
  for (auto& s : streams) CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const Case cases[] = {
      {"in use for a while, 1 stream", false, false, false, 0, 0, 1},
      {"in use for a while, 2 streams", false, false, false, 0, 0, 2},
      {"in use for a while, SM copy", false, false, false, 0, 0, 1, true},
      {"in use for a while, SM copy, 1 block/SM", false, false, false, 0, 0, 1, true, 1},
      {"in use for a while, SM copy, 2 blocks/SM", false, false, false, 0, 0, 1, true, 2},
      {"in use for a while, SM copy, 256 MiB launches", false, false, false, 0, 0, 1, true, 4,
       256ull << 20},
      {"in use for a while, SM copy, 2 streams", false, false, false, 0, 0, 2, true},
      {"cudaMalloc, no stand-in, 1 stream", true, false, false, 0, 0, 1},
      {"cudaMalloc after stand-in, 1 stream", true, false, true, 0, 0, 1},
      {"cudaMalloc after stand-in, 2 streams", true, false, true, 0, 0, 2},
      {"cudaMalloc after stand-in, 4 streams", true, false, true, 0, 0, 4},
      {"cudaMalloc after stand-in + 100 ms, 1 stream", true, false, true, 100, 0, 1},
      {"cudaMalloc after stand-in, then 100 ms, 1 stream", true, false, true, 0, 100, 1},
      {"VMM, no stand-in, 1 stream", true, true, false, 0, 0, 1},
      {"VMM after stand-in, 1 stream", true, true, true, 0, 0, 1},
      {"VMM after stand-in, 2 streams", true, true, true, 0, 0, 2},
      {"VMM after stand-in, 4 streams", true, true, true, 0, 0, 4},
      {"VMM after stand-in + 100 ms, 1 stream", true, true, true, 100, 0, 1},
      {"VMM after stand-in, then 100 ms, 1 stream", true, true, true, 0, 100, 1},
      {"VMM after stand-in, then 30 ms, 1 stream", true, true, true, 0, 30, 1},
      {"VMM after stand-in, then 60 ms, 1 stream", true, true, true, 0, 60, 1},
      {"VMM after stand-in, SM copy", true, true, true, 0, 0, 1, true},
      {"cudaMalloc after stand-in, SM copy", true, false, true, 0, 0, 1, true},
      {"VMM after stand-in, SM copy, 2 blocks/SM", true, true, true, 0, 0, 1, true, 2},
      {"in use, SMs the first 1.5 GiB, then 1 stream", false, false, false, 0, 0, 1, false, 4,
       kChunk, 1536ull << 20},
      {"VMM after stand-in, SMs 1.5 GiB, then 1 stream", true, true, true, 0, 0, 1, false, 4,
       kChunk, 1536ull << 20},
      {"in use, SMs 2.5 GiB beside 1 stream", false, false, false, 0, 0, 2, false, 4, kChunk,
       2560ull << 20, false, true},
      {"VMM after stand-in, SMs 2.5 GiB beside 1 stream", true, true, true, 0, 0, 2, false, 4,
       kChunk, 2560ull << 20, false, true},
      {"in use, SMs 1.5 GiB beside 1 stream", false, false, false, 0, 0, 2, false, 4, kChunk,
       1536ull << 20, false, true},
      {"VMM after stand-in, SMs 1.5 GiB beside 1 stream", true, true, true, 0, 0, 2, false, 4,
       kChunk, 1536ull << 20, false, true},
      {"VMM after stand-in, then 10 ms, 1 stream", true, true, true, 0, 10, 1},
      {"VMM after stand-in + 10 ms, 1 stream", true, true, true, 10, 0, 1},
      {"in use, adaptive", false, false, false, 0, 0, 2, false, 4, kChunk, 0, true},
      {"VMM after stand-in, adaptive", true, true, true, 0, 0, 2, false, 4, kChunk, 0, true},
      {"VMM, no stand-in, adaptive", true, true, false, 0, 0, 2, false, 4, kChunk, 0, true},
      {"VMM after stand-in, SM copy, 256 MiB launches", true, true, true, 0, 0, 1, true, 4,
       256ull << 20},
  };
  for (const Case& c : cases) {
    const double ms = run(c, host, host_on_device, streams, prop.multiProcessorCount);
    std::printf("%-50s %8.2f ms  %5.1f GB/s", c.name, ms, kTotal / ms / 1e6);
    if (c.adaptive) std::printf("  (SMs copied %.2f GiB)", g_sm_bytes / double(1 << 30));
    std::printf("\n");
    std::fflush(stdout);
  }
  CHECK(cudaHostUnregister(host));
  munmap(host, kTotal);
  return 0;
}
