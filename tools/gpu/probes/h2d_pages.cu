// tools/gpu/probes/h2d_pages.cu: does host-to-device copy speed depend on how the pinned memory
// was made, or on how many copies carry the bytes? A phase switch's reload (runtime/phase.cpp)
// reads strata's pinned segments (mmap + cudaHostRegister by default) in one copy per tensor,
// while the link floor next to it is one 256 MiB copy out of torch's pinned memory.
//
// For pinned memory made by cudaHostAlloc, by mmap + cudaHostRegister, and by mmap +
// madvise(MADV_HUGEPAGE) + cudaHostRegister, it times 6 GiB each way as one copy per 256 MiB and as
// one copy per 20 MiB (the median of 5 repetitions).
//   nvcc -O2 -arch=sm_90 tools/gpu/probes/h2d_pages.cu -o /tmp/h2d_pages
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "check.h"

constexpr size_t kTotal = 6ull << 30;

void* make_host(int method) {
  if (method == 0) {
    void* p = nullptr;
    CHECK(cudaHostAlloc(&p, kTotal, cudaHostAllocPortable));
    return p;
  }
  void* p = mmap(nullptr, kTotal, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) std::exit(2);
  if (method == 2 && madvise(p, kTotal, MADV_HUGEPAGE) != 0) std::perror("madvise");
  CHECK(cudaHostRegister(p, kTotal, cudaHostRegisterPortable));
  return p;
}

// fresh: the device buffer is freed and allocated again before each repetition (a reload copies
// into memory just taken from the driver). events: each copy is bracketed by timing events and
// followed by an arrival event, as the runtime's migration engine queues it.
// touch: after a fresh allocation, 0 nothing, 1 wait 100 ms, 2 cudaMemset the buffer first (its
// time printed apart).
double g_memset_ms = 0;
double run(void*& dev, void* host, size_t chunk, bool h2d, cudaStream_t s, bool fresh = false,
           bool events = false, int touch = 0) {
  std::vector<double> ms;
  std::vector<cudaEvent_t> marks;
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int rep = 0; rep < 5; ++rep) {
    if (fresh) {
      CHECK(cudaFree(dev));
      CHECK(cudaMalloc(&dev, kTotal));
      if (touch == 1) usleep(100000);
      if (touch == 2) {
        const auto t0 = std::chrono::steady_clock::now();
        CHECK(cudaMemsetAsync(dev, 0, kTotal, s));
        CHECK(cudaStreamSynchronize(s));
        g_memset_ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
      }
    }
    CHECK(cudaEventRecord(a, s));
    for (size_t off = 0; off < kTotal; off += chunk) {
      const size_t n = std::min(chunk, kTotal - off);
      char* h = static_cast<char*>(host) + off;
      char* d = static_cast<char*>(dev) + off;
      auto mark = [&](unsigned flags) {
        cudaEvent_t e;
        CHECK(cudaEventCreateWithFlags(&e, flags));
        CHECK(cudaEventRecord(e, s));
        marks.push_back(e);
      };
      if (events) mark(cudaEventDefault);
      if (h2d) {
        CHECK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, s));
      } else {
        CHECK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, s));
      }
      if (events) {
        mark(cudaEventDefault);
        mark(cudaEventDisableTiming);
      }
    }
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int main() {
  void* dev = nullptr;
  CHECK(cudaMalloc(&dev, kTotal));
  CHECK(cudaMemset(dev, 1, kTotal));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const char* names[] = {"cudaHostAlloc", "mmap+cudaHostRegister", "mmap+MADV_HUGEPAGE+register"};
  for (int method = 0; method < 3; ++method) {
    void* host = make_host(method);
    std::memset(host, 2, kTotal);
    for (size_t chunk : {size_t{256} << 20, size_t{20} << 20}) {
      const double h = run(dev, host, chunk, true, s);
      const double d = run(dev, host, chunk, false, s);
      std::printf("%-28s %3zu MiB copies: H2D %7.2f ms (%5.1f GB/s)  D2H %7.2f ms (%5.1f GB/s)\n",
                  names[method], chunk >> 20, h, kTotal / h / 1e6, d, kTotal / d / 1e6);
    }
    if (method == 1) {
      for (size_t chunk : {size_t{20} << 20, size_t{1} << 20}) {
        const double f = run(dev, host, chunk, true, s, /*fresh=*/true);
        const double e = run(dev, host, chunk, true, s, false, /*events=*/true);
        const double fe = run(dev, host, chunk, true, s, true, true);
        std::printf(
            "%-28s %3zu MiB copies: H2D into fresh memory %7.2f ms, with events %7.2f ms, "
            "both %7.2f ms\n",
            names[method], chunk >> 20, f, e, fe);
      }
      const double slept = run(dev, host, size_t{20} << 20, true, s, true, false, 1);
      const double set = run(dev, host, size_t{20} << 20, true, s, true, false, 2);
      std::printf(
          "%-28s  20 MiB copies: H2D into fresh memory after 100 ms %7.2f ms, after a cudaMemset "
          "of it (%.2f ms) %7.2f ms\n",
          names[method], slept, g_memset_ms, set);
    }
    if (method == 0) {
      CHECK(cudaFreeHost(host));
    } else {
      CHECK(cudaHostUnregister(host));
      munmap(host, kTotal);
    }
  }
  return 0;
}
