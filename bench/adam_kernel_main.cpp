// bench/adam_kernel_main.cpp: strata_adam_kernel times the CUDA Adam kernel alone (no copies, no
// runtime) on a model's worth of layers that stay on the GPU, for each way of storing the moments,
// and sets its rate beside the GPU memory's: a device-to-device copy of the same bytes.
//
// The step's layers are those of the users' script (bench/users_script.py): 24 blocks of two
// 4096 x 4096 weights, stepped a layer a launch as Adam steps them. A kernel's figure is its
// bytes through memory (parameter, gradient, master and moments read; parameter, master and moments
// written) over its time, so a kernel at memory's rate reads about the copy's GB/s.
//
//   strata_adam_kernel [--layers=24] [--numel=16777216] [--tensors_per_layer=2]
//                      [--param_dtype=float32|bfloat16] [--state_dtype=all|float32|bfloat16|int8]
//                      [--repeats=5]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "optim/adam_kernels.h"
#include "optim/state_codec.h"

namespace strata::optim {
namespace {

struct Args {
  int layers = 24;
  std::int64_t numel = std::int64_t{4096} * 4096;
  int tensors_per_layer = 2;
  ElemType param = ElemType::kF32;
  std::string state = "all";
  int repeats = 5;
};

bool check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  std::fprintf(stderr, "strata_adam_kernel: %s: %s\n", what, cudaGetErrorString(err));
  return false;
}

std::size_t moment_bytes(StateType type, std::int64_t n) {
  switch (type) {
    case StateType::kBF16:
      return 2 * static_cast<std::size_t>(n);
    case StateType::kI8:
      return static_cast<std::size_t>(int8_state_bytes(n));
    default:
      return 4 * static_cast<std::size_t>(n);
  }
}

const char* state_name(StateType type) {
  return type == StateType::kF32 ? "float32" : (type == StateType::kBF16 ? "bfloat16" : "int8");
}

// Milliseconds of the best of `repeats` steps (each a launch a layer on one stream), or < 0.
double time_steps(const std::vector<AdamTensor>& tensors, int per_launch, int repeats,
                  cudaStream_t stream) {
  cudaEvent_t start, end;
  if (!check(cudaEventCreate(&start), "event") || !check(cudaEventCreate(&end), "event")) return -1;
  double best = -1;
  for (int r = 0; r <= repeats; ++r) {  // the first step warms up
    cudaEventRecord(start, stream);
    for (std::size_t t = 0; t < tensors.size(); t += per_launch) {
      const std::size_t count = std::min<std::size_t>(per_launch, tensors.size() - t);
      const AdamScalars s = adam_scalars(AdamHyper{.weight_decay = 0.01}, r + 1);
      if (!check(adam_step_cuda(&tensors[t], count, s, nullptr, nullptr, stream), "adam")) {
        return -1;
      }
    }
    cudaEventRecord(end, stream);
    if (!check(cudaEventSynchronize(end), "step")) return -1;
    float ms = 0;
    cudaEventElapsedTime(&ms, start, end);
    if (r > 0 && (best < 0 || ms < best)) best = ms;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  return best;
}

int run(const Args& args) {
  cudaDeviceProp prop{};
  if (!check(cudaGetDeviceProperties(&prop, 0), "device")) return 1;
  std::printf("device: %s\n", prop.name);
  cudaStream_t stream;
  if (!check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream")) return 1;
  const int count = args.layers * args.tensors_per_layer;
  const std::int64_t n = args.numel;
  const bool mixed = args.param != ElemType::kF32;
  const std::size_t low = elem_size(args.param);

  // Device-to-device copy of 1 GiB: memory's rate for a stream that reads and writes.
  {
    const std::size_t bytes = std::size_t{1} << 30;
    void *a, *b;
    if (!check(cudaMalloc(&a, bytes), "malloc") || !check(cudaMalloc(&b, bytes), "malloc")) {
      return 1;
    }
    cudaEvent_t start, end;
    cudaEventCreate(&start);
    cudaEventCreate(&end);
    float best = 0;
    for (int r = 0; r <= args.repeats; ++r) {
      cudaEventRecord(start, stream);
      cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream);
      cudaEventRecord(end, stream);
      if (!check(cudaEventSynchronize(end), "copy")) return 1;
      float ms = 0;
      cudaEventElapsedTime(&ms, start, end);
      if (r > 0 && (best == 0 || ms < best)) best = ms;
    }
    std::printf("copy: %.1f GB/s (read + write)\n", 2.0 * bytes / (best / 1e3) / 1e9);
    cudaFree(a);
    cudaFree(b);
  }

  for (StateType type : {StateType::kF32, StateType::kBF16, StateType::kI8}) {
    if (args.state != "all" && args.state != state_name(type)) continue;
    const std::size_t mb = moment_bytes(type, n);
    const std::size_t tensor_bytes =
        low * n + low * n + (mixed ? 4 * static_cast<std::size_t>(n) : 0) + 2 * mb;
    std::vector<void*> buffers;
    std::vector<AdamTensor> tensors;
    bool ok = true;
    for (int t = 0; t < count && ok; ++t) {
      void* base = nullptr;
      if (!check(cudaMalloc(&base, tensor_bytes), "malloc")) {
        ok = false;
        break;
      }
      buffers.push_back(base);
      // Bytes of small floats (0x3c3c3c3c, about 0.0115; bfloat16 0x3c3c likewise), codes of
      // mid-range moments and scales of that float: every path of the codec runs.
      ok = check(cudaMemset(base, 0x3c, tensor_bytes), "memset");
      auto* bytes = static_cast<std::uint8_t*>(base);
      AdamTensor x;
      x.param = bytes;
      x.grad = bytes + low * n;
      std::size_t at = 2 * low * n;
      if (mixed) {
        x.master = reinterpret_cast<float*>(bytes + at);
        at += 4 * static_cast<std::size_t>(n);
      }
      x.exp_avg = bytes + at;
      x.exp_avg_sq = bytes + at + mb;
      x.numel = n;
      x.param_type = args.param;
      x.grad_type = args.param;
      x.state_type = type;
      x.seed = static_cast<std::uint32_t>(t) * 2654435761u;
      tensors.push_back(x);
    }
    double ms = ok ? time_steps(tensors, args.tensors_per_layer, args.repeats, stream) : -1;
    for (void* b : buffers) cudaFree(b);
    if (ms < 0) return 1;
    const double params = static_cast<double>(n) * count;
    const double bytes_moved = static_cast<double>(tensor_bytes) * count +
                               static_cast<double>(low * n + (mixed ? 4 * n : 0) + 2 * mb) * count;
    std::printf("state_dtype %-8s  %8.3f ms  %6.1f G params/s  %7.1f GB/s  (%zu B a parameter)\n",
                state_name(type), ms, params / (ms / 1e3) / 1e9, bytes_moved / (ms / 1e3) / 1e9,
                static_cast<std::size_t>(bytes_moved / params + 0.5));
  }
  return 0;
}

bool take(std::string_view arg, std::string_view name, std::string* value) {
  if (arg.substr(0, name.size()) != name) return false;
  *value = std::string(arg.substr(name.size()));
  return true;
}

}  // namespace
}  // namespace strata::optim

int main(int argc, char** argv) {
  using namespace strata::optim;
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string v;
    if (take(argv[i], "--layers=", &v)) {
      args.layers = std::atoi(v.c_str());
    } else if (take(argv[i], "--numel=", &v)) {
      args.numel = std::atoll(v.c_str());
    } else if (take(argv[i], "--tensors_per_layer=", &v)) {
      args.tensors_per_layer = std::atoi(v.c_str());
    } else if (take(argv[i], "--param_dtype=", &v) && (v == "float32" || v == "bfloat16")) {
      args.param = v == "float32" ? ElemType::kF32 : ElemType::kBF16;
    } else if (take(argv[i], "--state_dtype=", &v) &&
               (v == "all" || v == "float32" || v == "bfloat16" || v == "int8")) {
      args.state = v;
    } else if (take(argv[i], "--repeats=", &v)) {
      args.repeats = std::atoi(v.c_str());
    } else {
      std::fprintf(stderr, "strata_adam_kernel: unknown or bad argument %s\n", argv[i]);
      return 2;
    }
  }
  if (args.layers <= 0 || args.numel <= 0 || args.tensors_per_layer <= 0 || args.repeats <= 0) {
    std::fprintf(stderr, "strata_adam_kernel: sizes and repeats must be positive\n");
    return 2;
  }
  return run(args);
}
