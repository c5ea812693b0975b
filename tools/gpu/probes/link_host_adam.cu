// tools/gpu/probes/link_host_adam.cu: how much link and how much host Adam does this machine give
// at once? A hybrid step (policies/hybrid.cpp) streams some layers' states both ways while the
// host kernel steps the others, and both draw on host memory. strata_step_rates measures the pair
// for the threads the step will use; this probe measures it for every thread count, with a loop of
// its own in the host kernel's memory pattern.
//
// Copies run both ways without a break (one thread a direction keeps 4 copies of 32 MiB in flight
// between pinned memory and the GPU, waiting with blocking sync so that it burns no core), and T
// threads run an AdamW update with the host kernel's memory pattern over pinned arrays larger than
// the caches (bfloat16: gradient and parameter in bfloat16, float32 master and moments; float32:
// gradient, parameter and moments in float32; 28 bytes a parameter either way). Over a 1.5 s
// window it counts the bytes each direction finished and the parameters the threads stepped. Then
// for each T it prints the step a split could reach with those rates, for strata-train's 1.34 G
// bfloat16 GPT (12 bytes a parameter each way streamed, 2 on the host) and the users' script's
// 0.94 G float32 model (8 and 4): the fraction on the host where the link and the host finish
// together, and that step over the streamed one (the link alone, T = 0).
//   nvcc -O3 -Xcompiler -O3,-march=native,-fno-math-errno,-pthread \
//     tools/gpu/probes/link_host_adam.cu -o /tmp/link_host_adam && /tmp/link_host_adam [THREADS
//     [MODEL]]
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "check.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kChunk = 32ull << 20;       // bytes a copy
constexpr int kInFlight = 4;                 // copies queued a direction
constexpr size_t kLinkBytes = 512ull << 20;  // each direction's buffers
constexpr int64_t kParams = 160ll << 20;     // host Adam's parameters (3.4 GB of arrays)
constexpr int64_t kBlock = 1 << 16;          // parameters a thread steps between checks
constexpr double kWindow = 1.5;              // seconds measured

double now() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

struct Arrays {
  uint16_t* grad16;
  uint16_t* param16;
  float* grad32;
  float* master;
  float* m;
  float* v;
};

// One block of AdamW (lr 1e-4, betas 0.9 / 0.999, eps 1e-8, weight decay 0.01, step 10), written
// as the host kernel writes it (optim/adam_cpu.cpp), so that it does the same arithmetic a byte.
template <bool kBf16>
void adam_block(const Arrays& a, int64_t lo, int64_t hi) {
  const float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, lr = 1e-4f;
  const float decay = -(lr * 0.01f);
  const float bc2_sqrt = std::sqrt(1.0f - std::pow(beta2, 10.0f));
  const float step_size = lr / (1.0f - std::pow(beta1, 10.0f));
  float* __restrict master = a.master;
  float* __restrict m = a.m;
  float* __restrict v = a.v;
  const uint16_t* __restrict g16 = a.grad16;
  const float* __restrict g32 = a.grad32;
  uint16_t* __restrict p16 = a.param16;
  for (int64_t i = lo; i < hi; ++i) {
    float p = master[i];
    const float g = kBf16 ? bf16_to_float(g16[i]) : g32[i];
    p = fmaf(decay, p, p);
    const float mi = fmaf(beta1, m[i], fmaf(-beta1, g, g));
    const float g2 = g * g;
    const float vi = fmaf(beta2, v[i], fmaf(-beta2, g2, g2));
    const float denom = sqrtf(vi) / bc2_sqrt + eps;
    p -= step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
    if (kBf16) p16[i] = float_to_bf16(p);
  }
}

// Keeps kInFlight copies of kChunk queued on `stream` until `stop`, counting finished bytes.
void copy_loop(char* dst, const char* src, cudaStream_t stream, std::atomic<bool>* stop,
               std::atomic<int64_t>* done) {
  CHECK(cudaSetDevice(0));
  std::vector<cudaEvent_t> events(kInFlight);
  for (auto& e : events) CHECK(cudaEventCreateWithFlags(&e, cudaEventBlockingSync));
  const size_t slots = kLinkBytes / kChunk;
  int64_t queued = 0;
  auto queue = [&](int64_t k) {
    const size_t off = (k % slots) * kChunk;
    CHECK(cudaMemcpyAsync(dst + off, src + off, kChunk, cudaMemcpyDefault, stream));
    CHECK(cudaEventRecord(events[k % kInFlight], stream));
  };
  for (; queued < kInFlight; ++queued) queue(queued);
  for (int64_t k = 0; !stop->load(); ++k) {
    CHECK(cudaEventSynchronize(events[k % kInFlight]));
    done->fetch_add(kChunk);
    queue(queued++);
  }
  CHECK(cudaStreamSynchronize(stream));
  for (auto& e : events) CHECK(cudaEventDestroy(e));
}

struct Result {
  double h2d_gbps = 0, d2h_gbps = 0, params_per_s = 0;
};

// One window: copies in the directions asked, `threads` threads of host Adam.
Result measure(bool h2d, bool d2h, int threads, bool bf16, const Arrays& a, char* host_src,
               char* host_dst, char* dev_src, char* dev_dst) {
  std::atomic<bool> stop_copies{false}, stop_adam{false};
  std::atomic<int64_t> h2d_done{0}, d2h_done{0}, stepped{0};
  cudaStream_t s_h2d, s_d2h;
  CHECK(cudaStreamCreateWithFlags(&s_h2d, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&s_d2h, cudaStreamNonBlocking));
  std::vector<std::thread> copiers;
  if (h2d) copiers.emplace_back(copy_loop, dev_dst, host_src, s_h2d, &stop_copies, &h2d_done);
  if (d2h) copiers.emplace_back(copy_loop, host_dst, dev_src, s_d2h, &stop_copies, &d2h_done);
  std::vector<std::thread> workers;
  const int64_t per = (kParams + threads - 1) / std::max(threads, 1);
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      const int64_t lo = std::min(kParams, per * t), hi = std::min(kParams, lo + per);
      while (!stop_adam.load(std::memory_order_relaxed)) {
        for (int64_t b = lo; b < hi && !stop_adam.load(std::memory_order_relaxed); b += kBlock) {
          const int64_t e = std::min(hi, b + kBlock);
          if (bf16) {
            adam_block<true>(a, b, e);
          } else {
            adam_block<false>(a, b, e);
          }
          stepped.fetch_add(e - b, std::memory_order_relaxed);
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // every side at speed
  const double t0 = now();
  const int64_t h0 = h2d_done.load(), d0 = d2h_done.load(), s0 = stepped.load();
  std::this_thread::sleep_for(std::chrono::duration<double>(kWindow));
  const double t1 = now();
  const int64_t h1 = h2d_done.load(), d1 = d2h_done.load(), s1 = stepped.load();
  stop_adam = true;
  for (auto& w : workers) w.join();
  stop_copies = true;
  for (auto& c : copiers) c.join();
  CHECK(cudaStreamDestroy(s_h2d));
  CHECK(cudaStreamDestroy(s_d2h));
  const double dt = t1 - t0;
  return {static_cast<double>(h1 - h0) / dt / 1e9, static_cast<double>(d1 - d0) / dt / 1e9,
          static_cast<double>(s1 - s0) / dt};
}

// The step a split reaches with each way's link rate `link` (GB/s) and host Adam's `rate`
// (parameters/s), for `n` parameters moving `streamed` bytes each way streamed and `hosted` on the
// host: the host fraction f where the link's time equals the host's. Returns ms; f in *fraction.
double split_ms(double n, double streamed, double hosted, double link, double rate,
                double* fraction) {
  if (rate <= 0) {
    *fraction = 0;
    return n * streamed / (link * 1e9) * 1e3;
  }
  // n ((1 - f) streamed + f hosted) / link = f n / rate
  const double a = streamed / (link * 1e9), b = (streamed - hosted) / (link * 1e9) + 1.0 / rate;
  *fraction = a / b;
  return *fraction * n / rate * 1e3;
}

}  // namespace

int main(int argc, char** argv) {
  const int max_threads =
      argc > 1 ? std::atoi(argv[1]) : static_cast<int>(std::thread::hardware_concurrency());
  CHECK(cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync));
  CHECK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  char *host_src, *host_dst, *dev_src, *dev_dst;
  CHECK(cudaHostAlloc(&host_src, kLinkBytes, cudaHostAllocDefault));
  CHECK(cudaHostAlloc(&host_dst, kLinkBytes, cudaHostAllocDefault));
  CHECK(cudaMalloc(&dev_src, kLinkBytes));
  CHECK(cudaMalloc(&dev_dst, kLinkBytes));
  std::memset(host_src, 1, kLinkBytes);
  std::memset(host_dst, 0, kLinkBytes);
  CHECK(cudaMemset(dev_src, 1, kLinkBytes));
  Arrays a{};
  CHECK(cudaHostAlloc(&a.grad16, kParams * 2, cudaHostAllocDefault));
  CHECK(cudaHostAlloc(&a.param16, kParams * 2, cudaHostAllocDefault));
  CHECK(cudaHostAlloc(&a.grad32, kParams * 4, cudaHostAllocDefault));
  CHECK(cudaHostAlloc(&a.master, kParams * 4, cudaHostAllocDefault));
  CHECK(cudaHostAlloc(&a.m, kParams * 4, cudaHostAllocDefault));
  CHECK(cudaHostAlloc(&a.v, kParams * 4, cudaHostAllocDefault));
  for (int64_t i = 0; i < kParams; ++i) {
    a.grad16[i] = float_to_bf16(1e-3f);
    a.grad32[i] = 1e-3f;
    a.master[i] = 0.5f;
    a.m[i] = 0;
    a.v[i] = 0;
  }
  std::printf("# %s, %d host threads available; %.1f s windows, copies of %zu MiB, %d queued\n",
              prop.name, static_cast<int>(std::thread::hardware_concurrency()), kWindow,
              kChunk >> 20, kInFlight);
  std::vector<int> counts = {1, 2, 4, 6, 8, 10, 12, 14};
  for (int t : {max_threads - 1, max_threads}) {
    if (t > counts.back()) counts.push_back(t);
  }
  Result one_h2d = measure(true, false, 0, true, a, host_src, host_dst, dev_src, dev_dst);
  Result one_d2h = measure(false, true, 0, true, a, host_src, host_dst, dev_src, dev_dst);
  Result both = measure(true, true, 0, true, a, host_src, host_dst, dev_src, dev_dst);
  std::printf("link alone: h2d %.1f GB/s, d2h %.1f GB/s; both at once %.1f / %.1f GB/s\n",
              one_h2d.h2d_gbps, one_d2h.d2h_gbps, both.h2d_gbps, both.d2h_gbps);
  const double streamed_link = std::min(both.h2d_gbps, both.d2h_gbps);
  struct Model {
    const char* name;
    bool bf16;
    double n, streamed, hosted;
  };
  const Model models[] = {{"bfloat16 + float32 masters, 1.34 G", true, 1.34e9, 12, 2},
                          {"float32, 0.94 G", false, 0.94e9, 8, 4}};
  const std::string only = argc > 2 ? argv[2] : "";  // "bfloat16" or "float32": that model only
  for (const Model& model : models) {
    if (!only.empty() && only != (model.bf16 ? "bfloat16" : "float32")) continue;
    const double streamed_ms = model.n * model.streamed / (streamed_link * 1e9) * 1e3;
    std::printf("\n== %s: streamed over the link alone %.1f ms\n", model.name, streamed_ms);
    std::printf("%8s %14s %14s %14s %14s %10s %10s\n", "threads", "adam alone G/s", "adam+link G/s",
                "h2d GB/s", "d2h GB/s", "host frac", "x streamed");
    for (int t : counts) {
      if (t > max_threads) continue;
      Result alone = measure(false, false, t, model.bf16, a, host_src, host_dst, dev_src, dev_dst);
      Result r = measure(true, true, t, model.bf16, a, host_src, host_dst, dev_src, dev_dst);
      double f = 0;
      const double ms = split_ms(model.n, model.streamed, model.hosted,
                                 std::min(r.h2d_gbps, r.d2h_gbps), r.params_per_s, &f);
      std::printf("%8d %14.2f %14.2f %14.1f %14.1f %10.3f %10.3f\n", t, alone.params_per_s / 1e9,
                  r.params_per_s / 1e9, r.h2d_gbps, r.d2h_gbps, f, ms / streamed_ms);
    }
  }
  return 0;
}
