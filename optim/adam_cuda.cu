// The fused multi-tensor Adam kernel and its launcher (see optim/adam_kernels.h).
#include <cstdint>

#include "optim/adam_kernels.h"

namespace strata::optim {
namespace {

constexpr int kMaxTensors = 24;
// Enough blocks for several waves on an H100/H200 (132 SMs, 4 blocks of 512 threads each): with
// fewer (320) a launch left much of the GPU's thread slots empty and the step fell short of what a
// kernel with Adam's four reads and three writes and no arithmetic reaches
// (tools/gpu/probes/hbm_mix.cu; the figures are in bench/results).
constexpr int kMaxBlocks = 2048;
// Elements per block, by how the moments are stored: float32's loop is four elements a thread with
// float4 loads; the compressed loops do more work an element, so their blocks are smaller and more
// of them fill the GPU. Multiples of 4 keep float4 aligned; int8's is two blocks of moments for
// each of a CUDA block's warps.
constexpr std::int64_t chunk_of(StateType moments) {
  return moments == StateType::kF32 ? 65536 : (moments == StateType::kBF16 ? 16384 : 8192);
}
constexpr int kThreads = 512;
static_assert(chunk_of(StateType::kI8) % (kThreads / 32 * kStateBlock) == 0,
              "an int8 chunk is whole blocks of moments for every warp");

// Passed by value: 12 KB, under the 32 KB kernel-argument limit of CUDA 12.1 and later (drivers
// from r530) on Volta and newer.
struct Meta {
  AdamTensor t[kMaxTensors];
  bool vec[kMaxTensors];  // float32 throughout, no master, all pointers 16-byte aligned
  // A bfloat16 / float16 parameter with its master: master and moments 16-byte aligned, the
  // parameter and a low-precision gradient 8-byte aligned (a float32 gradient 16).
  bool vec_low[kMaxTensors];
  unsigned char block_tensor[kMaxBlocks];  // kMaxTensors < 256
  int block_chunk[kMaxBlocks];
};
static_assert(sizeof(Meta) <= 32764, "kernel arguments are limited to 32764 bytes");

__device__ __forceinline__ void update4(float4& p, const float4& g, float4& m, float4& v,
                                        const AdamScalars& s, float inv) {
  adam_element(p.x, g.x, m.x, v.x, nullptr, s, inv);
  adam_element(p.y, g.y, m.y, v.y, nullptr, s, inv);
  adam_element(p.z, g.z, m.z, v.z, nullptr, s, inv);
  adam_element(p.w, g.w, m.w, v.w, nullptr, s, inv);
}

// Four elements of a bfloat16 / float16 (8 bytes) or float32 (16 bytes) tensor from index i.
__device__ __forceinline__ void load4(const void* base, ElemType type, std::int64_t i, float* out) {
  if (type == ElemType::kF32) {
    const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    out[0] = f.x;
    out[1] = f.y;
    out[2] = f.z;
    out[3] = f.w;
    return;
  }
  const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const std::uint16_t*>(base) + i);
  const std::uint16_t h[4] = {
      static_cast<std::uint16_t>(u.x & 0xffffu), static_cast<std::uint16_t>(u.x >> 16),
      static_cast<std::uint16_t>(u.y & 0xffffu), static_cast<std::uint16_t>(u.y >> 16)};
  for (int k = 0; k < 4; ++k)
    out[k] = type == ElemType::kBF16 ? bf16_to_float(h[k]) : f16_to_float(h[k]);
}

__device__ __forceinline__ std::uint32_t to_low(float v, ElemType type) {
  return type == ElemType::kBF16 ? float_to_bf16(v) : float_to_f16(v);
}

// Mixed precision four elements at a time (See Note [Mixed precision] in adam_math.h): 28 bytes a
// parameter through HBM (master, moments and gradient read; master, moments and parameter written).
__device__ __forceinline__ void update_low4(const AdamTensor& x, std::int64_t i,
                                            const AdamScalars& s, float inv) {
  float4 pm = *reinterpret_cast<float4*>(x.master + i);
  float4 mm = *reinterpret_cast<float4*>(static_cast<float*>(x.exp_avg) + i);
  float4 vv = *reinterpret_cast<float4*>(static_cast<float*>(x.exp_avg_sq) + i);
  float g[4];
  load4(x.grad, x.grad_type, i, g);
  adam_element(pm.x, g[0], mm.x, vv.x, nullptr, s, inv);
  adam_element(pm.y, g[1], mm.y, vv.y, nullptr, s, inv);
  adam_element(pm.z, g[2], mm.z, vv.z, nullptr, s, inv);
  adam_element(pm.w, g[3], mm.w, vv.w, nullptr, s, inv);
  *reinterpret_cast<float4*>(x.master + i) = pm;
  *reinterpret_cast<float4*>(static_cast<float*>(x.exp_avg) + i) = mm;
  *reinterpret_cast<float4*>(static_cast<float*>(x.exp_avg_sq) + i) = vv;
  const uint2 packed = {to_low(pm.x, x.param_type) | (to_low(pm.y, x.param_type) << 16),
                        to_low(pm.z, x.param_type) | (to_low(pm.w, x.param_type) << 16)};
  *reinterpret_cast<uint2*>(static_cast<std::uint16_t*>(x.param) + i) = packed;
}

// One kernel per way of storing the moments (S), so that the float32 kernel carries none of the
// compressed paths' registers.
template <StateType S>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(Meta meta, AdamScalars s, const float* grad_scale, const float* found_inf) {
  const int t = meta.block_tensor[blockIdx.x];
  const AdamTensor& x = meta.t[t];
  if (found_inf != nullptr && *found_inf != 0.0f) {
    // The tensor's first block counts the skip, once per tensor and step (See Note [Skipped steps]
    // in adam_kernels.h).
    if (threadIdx.x == 0 && meta.block_chunk[blockIdx.x] == 0 && x.skipped != nullptr) {
      ++*x.skipped;
    }
    return;
  }
  // The settled step: the bias corrections' and the compressed moments' rounding's (See Note
  // [Compressed moments] in state_codec.h).
  __shared__ std::int64_t settled_t;
  {
    // The bias corrections with the device's pow, as torch's fused kernel takes them, so the bits
    // match its (the host's pow may differ in the last place); the skipped count lives in pinned
    // host memory (See Note [Skipped steps] in adam_kernels.h). One read per block.
    __shared__ float step_size, bias_correction2_sqrt;
    if (threadIdx.x == 0) {
      AdamScalars settled = s;
      settled_t = settled_step(x);
      bias_corrections(settled, settled_t);
      step_size = settled.step_size;
      bias_correction2_sqrt = settled.bias_correction2_sqrt;
    }
    __syncthreads();
    s.step_size = step_size;
    s.bias_correction2_sqrt = bias_correction2_sqrt;
  }
  const float inv = grad_scale != nullptr ? 1.0f / *grad_scale : 1.0f;
  constexpr std::int64_t kChunk = chunk_of(S);
  const std::int64_t begin = static_cast<std::int64_t>(meta.block_chunk[blockIdx.x]) * kChunk;
  const std::int64_t end = begin + kChunk < x.numel ? begin + kChunk : x.numel;
  if constexpr (S == StateType::kI8) {
    // A warp a block of moments (kStateBlock elements, kPerLane a lane at lane + 32 k, so that
    // each load of the warp reads consecutive elements): the block's absmax is the warp's, by
    // shuffles, with no barrier and no shared memory; the warps of a CUDA block take the chunk's
    // blocks in turn. Past the tensor's end a lane steps nothing and writes the padding's zero
    // codes (See Note [Compressed moments] in state_codec.h).
    constexpr int kPerLane = kStateBlock / 32;
    constexpr int kWarps = kThreads / 32;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const int warp = static_cast<int>(threadIdx.x) >> 5;
    auto* codes_m = static_cast<std::uint8_t*>(x.exp_avg);
    auto* codes_v = static_cast<std::uint8_t*>(x.exp_avg_sq);
    float* scales_m = int8_scales(x.exp_avg, x.numel);
    float* scales_v = int8_scales(x.exp_avg_sq, x.numel);
    for (std::int64_t b0 = begin + warp * kStateBlock; b0 < end; b0 += kWarps * kStateBlock) {
      const std::int64_t block = b0 / kStateBlock;
      const float scale_m = scales_m[block];
      const float scale_v = scales_v[block];
      float m[kPerLane], v[kPerLane];
      float am = 0.0f, av = 0.0f;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const std::int64_t i = b0 + k * 32 + lane;
        m[k] = 0.0f;
        v[k] = 0.0f;
        if (i < x.numel) {
          m[k] = decode_exp_avg(codes_m[i]) * scale_m;
          v[k] = decode_exp_avg_sq(codes_v[i]) * scale_v;
          float p = x.master != nullptr ? x.master[i] : load_elem(x.param, x.param_type, i);
          adam_element(p, load_elem(x.grad, x.grad_type, i), m[k], v[k], nullptr, s, inv);
          if (x.master != nullptr) x.master[i] = p;
          store_elem(x.param, x.param_type, i, p);
        }
        am = absmax_of(am, m[k]);
        av = absmax_of(av, v[k]);
      }
      for (int offset = 16; offset > 0; offset >>= 1) {
        am = absmax_of(am, __shfl_xor_sync(0xffffffffu, am, offset));
        av = absmax_of(av, __shfl_xor_sync(0xffffffffu, av, offset));
      }
      const float inverse_m = inverse_scale(am);
      const float inverse_v = inverse_scale(av);
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const std::int64_t i = b0 + k * 32 + lane;
        if (i < x.numel) {
          encode_int8_moments(x, i, settled_t, m[k], v[k], inverse_m, inverse_v);
        } else {  // the last block's padding
          codes_m[i] = 0;
          codes_v[i] = 0;
        }
      }
      if (lane == 0) {
        scales_m[block] = am;
        scales_v[block] = av;
      }
    }
    return;
  }
  if constexpr (S == StateType::kBF16) {
    // Four elements a thread at a time, their loads first.
    constexpr int kUnroll = 4;
    auto* m16 = static_cast<std::uint16_t*>(x.exp_avg);
    auto* v16 = static_cast<std::uint16_t*>(x.exp_avg_sq);
    const std::int64_t stride = blockDim.x;
    for (std::int64_t j0 = begin + threadIdx.x; j0 < end; j0 += kUnroll * stride) {
      float p[kUnroll], g[kUnroll], m[kUnroll], v[kUnroll];
      for (int k = 0; k < kUnroll; ++k) {
        const std::int64_t j = j0 + k * stride;
        const bool in = j < end;
        m[k] = in ? bf16_to_float(m16[j]) : 0.0f;
        v[k] = in ? bf16_to_float(v16[j]) : 0.0f;
        p[k] = !in ? 0.0f : x.master != nullptr ? x.master[j] : load_elem(x.param, x.param_type, j);
        g[k] = in ? load_elem(x.grad, x.grad_type, j) : 0.0f;
      }
      for (int k = 0; k < kUnroll; ++k) {
        const std::int64_t j = j0 + k * stride;
        if (j >= end) continue;
        adam_element(p[k], g[k], m[k], v[k], nullptr, s, inv);
        const std::uint32_t r = state_random_bits(x.seed, settled_t, j);
        m16[j] = float_to_bf16_stochastic(m[k], r);
        v16[j] = float_to_bf16_stochastic(v[k], r >> 16);
        if (x.master != nullptr) x.master[j] = p[k];
        store_elem(x.param, x.param_type, j, p[k]);
      }
    }
    return;
  }
  float* p = static_cast<float*>(x.param);
  const float* g = static_cast<const float*>(x.grad);
  float* m = static_cast<float*>(x.exp_avg);
  float* v = static_cast<float*>(x.exp_avg_sq);
  std::int64_t i = begin + threadIdx.x * 4;
  if (meta.vec_low[t] && !s.amsgrad) {
    for (; i + 3 < end; i += static_cast<std::int64_t>(blockDim.x) * 4) update_low4(x, i, s, inv);
    const std::int64_t tail = begin + ((end - begin) & ~std::int64_t{3});
    for (std::int64_t j = tail + threadIdx.x; j < end; j += blockDim.x) {
      adam_tensor_element(x, j, s, inv);
    }
    return;
  }
  if (meta.vec[t] && !s.amsgrad) {
    for (; i + 3 < end; i += static_cast<std::int64_t>(blockDim.x) * 4) {
      float4 pp = *reinterpret_cast<float4*>(p + i);
      const float4 gg = *reinterpret_cast<const float4*>(g + i);
      float4 mm = *reinterpret_cast<float4*>(m + i);
      float4 vv = *reinterpret_cast<float4*>(v + i);
      update4(pp, gg, mm, vv, s, inv);
      *reinterpret_cast<float4*>(p + i) = pp;
      *reinterpret_cast<float4*>(m + i) = mm;
      *reinterpret_cast<float4*>(v + i) = vv;
    }
    // The scalar tail: fewer than four elements at the end of the tensor.
    const std::int64_t tail = begin + ((end - begin) & ~std::int64_t{3});
    for (std::int64_t j = tail + threadIdx.x; j < end; j += blockDim.x) {
      adam_element(p[j], g[j], m[j], v[j], nullptr, s, inv);
    }
    return;
  }
  for (std::int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    adam_tensor_element(x, j, s, inv);
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<std::uintptr_t>(ptr) & 15) == 0; }
bool aligned8(const void* ptr) { return (reinterpret_cast<std::uintptr_t>(ptr) & 7) == 0; }

struct ThreeFloats {
  const float* src[3];
};

__global__ void read_floats_kernel(ThreeFloats in, float* dst) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < 3 && in.src[i] != nullptr) dst[i] = *in.src[i];
}

}  // namespace

namespace {

struct BiasRequests {
  BiasRequest r[kMaxBiasRequests];
};

__global__ void bias_kernel(BiasRequests in, int count, float* out) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= count) return;
  // The same call adam_kernel makes for its tensors (See Note [Bias corrections from the device]).
  AdamScalars s = in.r[i].scalars;
  bias_corrections(s, in.r[i].step);
  out[2 * i] = s.step_size;
  out[2 * i + 1] = s.bias_correction2_sqrt;
}

}  // namespace

cudaError_t adam_bias_corrections_cuda(const BiasRequest* requests, int count, float* out,
                                       cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  if (count > kMaxBiasRequests) return cudaErrorInvalidValue;
  BiasRequests in{};
  for (int i = 0; i < count; ++i) in.r[i] = requests[i];
  bias_kernel<<<1, kMaxBiasRequests, 0, stream>>>(in, count, out);
  return cudaGetLastError();
}

cudaError_t adam_read_floats_cuda(const std::array<const float*, 3>& src, float* dst,
                                  cudaStream_t stream) {
  read_floats_kernel<<<1, 32, 0, stream>>>(ThreeFloats{{src[0], src[1], src[2]}}, dst);
  return cudaGetLastError();
}

cudaError_t adam_step_cuda(const AdamTensor* tensors, std::size_t count, const AdamScalars& s,
                           const float* grad_scale, const float* found_inf, cudaStream_t stream) {
  Meta meta{};
  int tensors_in = 0;
  int blocks = 0;
  StateType moments = count > 0 ? tensors[0].state_type : StateType::kF32;
  auto launch = [&]() -> cudaError_t {
    if (blocks == 0) return cudaSuccess;
    switch (moments) {
      case StateType::kBF16:
        adam_kernel<StateType::kBF16>
            <<<blocks, kThreads, 0, stream>>>(meta, s, grad_scale, found_inf);
        break;
      case StateType::kI8:
        adam_kernel<StateType::kI8>
            <<<blocks, kThreads, 0, stream>>>(meta, s, grad_scale, found_inf);
        break;
      default:
        adam_kernel<StateType::kF32>
            <<<blocks, kThreads, 0, stream>>>(meta, s, grad_scale, found_inf);
    }
    cudaError_t err = cudaGetLastError();
    meta = Meta{};
    tensors_in = 0;
    blocks = 0;
    return err;
  };
  for (std::size_t t = 0; t < count; ++t) {
    const AdamTensor& x = tensors[t];
    // An empty tensor gets one block only to count a skipped step (See Note [Skipped steps]).
    if (x.numel == 0 && x.skipped == nullptr) continue;
    if (x.state_type != moments) {  // a launch holds tensors of one kind of moments
      if (cudaError_t err = launch(); err != cudaSuccess) return err;
      moments = x.state_type;
    }
    const std::int64_t chunk = chunk_of(moments);
    const std::int64_t chunks = x.numel == 0 ? 1 : (x.numel + chunk - 1) / chunk;
    for (std::int64_t c = 0; c < chunks; ++c) {
      if (c == 0 || tensors_in == 0) {
        if (tensors_in == kMaxTensors) {
          if (cudaError_t err = launch(); err != cudaSuccess) return err;
        }
        const int slot = tensors_in++;
        meta.t[slot] = x;
        meta.vec[slot] = x.param_type == ElemType::kF32 && x.grad_type == ElemType::kF32 &&
                         x.master == nullptr && aligned16(x.param) && aligned16(x.grad) &&
                         aligned16(x.exp_avg) && aligned16(x.exp_avg_sq);
        meta.vec_low[slot] = x.param_type != ElemType::kF32 && x.master != nullptr &&
                             aligned16(x.master) && aligned16(x.exp_avg) &&
                             aligned16(x.exp_avg_sq) && aligned8(x.param) &&
                             (x.grad_type == ElemType::kF32 ? aligned16(x.grad) : aligned8(x.grad));
      }
      meta.block_tensor[blocks] = static_cast<unsigned char>(tensors_in - 1);
      meta.block_chunk[blocks] = static_cast<int>(c);
      if (++blocks == kMaxBlocks) {
        if (cudaError_t err = launch(); err != cudaSuccess) return err;
      }
    }
  }
  return launch();
}

}  // namespace strata::optim
