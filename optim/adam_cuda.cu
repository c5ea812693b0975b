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
// of them fill the GPU. Multiples of 4 keep float4 aligned; int8's is whole blocks of moments for
// each of a CUDA block's warps.
constexpr std::int64_t chunk_of(StateType moments) {
  return moments == StateType::kF32 ? 65536 : (moments == StateType::kBF16 ? 16384 : 8192);
}
// Threads a CUDA block, and the blocks an SM must be able to hold (0: no such bound), which caps
// a thread's registers, by how the moments are stored. float32 needs few registers and takes 512
// threads. The compressed kernels would take 64 (bfloat16) and over 90 (int8) registers, so an SM
// held a quarter to a half of the threads it can, and they waited on memory; in smaller blocks,
// capped at 40 (bfloat16) and 64 (int8) registers, they keep more of memory busy, and int8 then
// outruns the float32 kernel, as it moves fewer bytes (strata_adam_kernel; the figures are in
// bench/results).
constexpr int threads_of(StateType moments) {
  return moments == StateType::kF32 ? 512 : (moments == StateType::kBF16 ? 256 : 128);
}
constexpr int min_blocks_of(StateType moments) {
  return moments == StateType::kF32 ? 0 : (moments == StateType::kBF16 ? 6 : 8);
}
static_assert(chunk_of(StateType::kI8) % (threads_of(StateType::kI8) / 32 * kStateBlock) == 0,
              "an int8 chunk is whole blocks of moments for every warp");

// How a tensor with int8 moments is laid out, for its whole blocks of moments: kAny takes the
// loop that reads the element types where it runs and one element a load; the others know the
// types when compiled and load four elements at once (every pointer aligned for it; a bfloat16 or
// float16 parameter with its float32 master, a float32 one without).
enum I8Layout : unsigned char { kAny, kF32, kBF16, kBF16GradF32, kF16, kF16GradF32 };

// Passed by value: 12 KB, under the 32 KB kernel-argument limit of CUDA 12.1 and later (drivers
// from r530) on Volta and newer.
struct Meta {
  AdamTensor t[kMaxTensors];
  bool vec[kMaxTensors];  // float32 throughout, no master, all pointers 16-byte aligned
  // A bfloat16 / float16 parameter with its master: master and moments 16-byte aligned, the
  // parameter and a low-precision gradient 8-byte aligned (a float32 gradient 16).
  bool vec_low[kMaxTensors];
  // int8 moments: which whole-block loop a tensor takes (I8Layout).
  unsigned char i8_layout[kMaxTensors];
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

__device__ __forceinline__ std::uint32_t to_low(float v, ElemType type) {
  return type == ElemType::kBF16 ? float_to_bf16(v) : float_to_f16(v);
}

// Four elements of type T (known when compiled) from index i, a multiple of 4: one float4 (float32)
// or one uint2 (bfloat16 / float16) load; and back.
template <ElemType T>
__device__ __forceinline__ void load4_as(const void* base, std::int64_t i, float* out) {
  if constexpr (T == ElemType::kF32) {
    const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    out[0] = f.x;
    out[1] = f.y;
    out[2] = f.z;
    out[3] = f.w;
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const std::uint16_t*>(base) + i);
    const std::uint32_t w[2] = {u.x, u.y};
    for (int k = 0; k < 4; ++k) {
      const auto h = static_cast<std::uint16_t>(w[k / 2] >> (16 * (k % 2)));
      out[k] = T == ElemType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
    }
  }
}
template <ElemType T>
__device__ __forceinline__ void store4_as(void* base, std::int64_t i, const float* in) {
  if constexpr (T == ElemType::kF32) {
    *reinterpret_cast<float4*>(static_cast<float*>(base) + i) = {in[0], in[1], in[2], in[3]};
  } else {
    const uint2 u = {to_low(in[0], T) | (to_low(in[1], T) << 16),
                     to_low(in[2], T) | (to_low(in[3], T) << 16)};
    *reinterpret_cast<uint2*>(static_cast<std::uint16_t*>(base) + i) = u;
  }
}

// The same load with the type read where it runs.
__device__ __forceinline__ void load4(const void* base, ElemType type, std::int64_t i, float* out) {
  switch (type) {
    case ElemType::kF32:
      return load4_as<ElemType::kF32>(base, i, out);
    case ElemType::kBF16:
      return load4_as<ElemType::kBF16>(base, i, out);
    default:
      return load4_as<ElemType::kF16>(base, i, out);
  }
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

// The parameter's and the gradient's element types of a layout known when compiled.
constexpr ElemType param_of(I8Layout l) {
  return l == kF32 ? ElemType::kF32
                   : (l == kBF16 || l == kBF16GradF32 ? ElemType::kBF16 : ElemType::kF16);
}
constexpr ElemType grad_of(I8Layout l) {
  return l == kBF16 ? ElemType::kBF16 : (l == kF16 ? ElemType::kF16 : ElemType::kF32);
}

// A warp steps the int8 moments of the chunk [begin, end) a block of kStateBlock elements at a
// time; the warps of a CUDA block take the chunk's blocks in turn. The block's absmax is the
// warp's, by shuffles, with no barrier and no shared memory. Past the tensor's end a lane steps
// nothing and writes the padding's zero codes (See Note [Compressed moments] in state_codec.h).
//
// A whole block under a layout known when compiled (L != kAny) is eight elements a lane, four at
// lane * 4 and four 128 further, so that every load and store of the warp is one contiguous piece:
// two float4 (or uint2) loads a tensor and one 32-bit load of four codes a moment, no element
// checked against the end, and the random bits' key (state_key) computed once a block. The last
// block of a tensor, and every block under kAny, reads element by element at lane + 32 k with the
// types read where it runs. Each element's arithmetic, and so its bits, is the same either way.
template <I8Layout L>
__device__ __forceinline__ void int8_blocks(const AdamTensor& x, std::int64_t begin,
                                            std::int64_t end, std::int64_t t, const AdamScalars& s,
                                            float inv) {
  constexpr int kPerLane = kStateBlock / 32;
  constexpr int kWarps = threads_of(StateType::kI8) / 32;
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
    const bool whole = L != kAny && b0 + kStateBlock <= x.numel;
    if (whole) {
      constexpr ElemType P = param_of(L), G = grad_of(L);
      float p[kPerLane], g[kPerLane];
      std::uint32_t cm[2], cv[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const std::int64_t i = b0 + h * 128 + lane * 4;
        cm[h] = *reinterpret_cast<const std::uint32_t*>(codes_m + i);
        cv[h] = *reinterpret_cast<const std::uint32_t*>(codes_v + i);
        if constexpr (P == ElemType::kF32) {
          load4_as<P>(x.param, i, p + 4 * h);
        } else {
          load4_as<ElemType::kF32>(x.master, i, p + 4 * h);
        }
        load4_as<G>(x.grad, i, g + 4 * h);
      }
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const std::uint32_t shift = 8 * (k % 4);
        m[k] = decode_exp_avg(static_cast<std::uint8_t>(cm[k / 4] >> shift)) * scale_m;
        v[k] = decode_exp_avg_sq(static_cast<std::uint8_t>(cv[k / 4] >> shift)) * scale_v;
        adam_element(p[k], g[k], m[k], v[k], nullptr, s, inv);
        am = absmax_of(am, m[k]);
        av = absmax_of(av, v[k]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const std::int64_t i = b0 + h * 128 + lane * 4;
        if constexpr (P != ElemType::kF32) store4_as<ElemType::kF32>(x.master, i, p + 4 * h);
        store4_as<P>(x.param, i, p + 4 * h);
      }
    } else {
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
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      am = absmax_of(am, __shfl_xor_sync(0xffffffffu, am, offset));
      av = absmax_of(av, __shfl_xor_sync(0xffffffffu, av, offset));
    }
    const float inverse_m = inverse_scale(am);
    const float inverse_v = inverse_scale(av);
    if (whole) {
      const auto high = static_cast<std::uint32_t>(static_cast<std::uint64_t>(b0) >> 32);
      const std::uint32_t key_m = state_key(x.seed, t, high, 0);
      const std::uint32_t key_v = state_key(x.seed, t, high, 1);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const std::int64_t i = b0 + h * 128 + lane * 4;
        std::uint32_t om = 0, ov = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const std::uint32_t low = static_cast<std::uint32_t>(i) + j;
          const float mr = relative_to(m[4 * h + j], inverse_m);
          const float vr = relative_to(v[4 * h + j], inverse_v);
          om |= std::uint32_t{encode_exp_avg(mr, state_mix(low, key_m))} << (8 * j);
          ov |= std::uint32_t{encode_exp_avg_sq(vr, state_mix(low, key_v))} << (8 * j);
        }
        *reinterpret_cast<std::uint32_t*>(codes_m + i) = om;
        *reinterpret_cast<std::uint32_t*>(codes_v + i) = ov;
      }
    } else {
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const std::int64_t i = b0 + k * 32 + lane;
        if (i < x.numel) {
          encode_int8_moments(x, i, t, m[k], v[k], inverse_m, inverse_v);
        } else {  // the last block's padding
          codes_m[i] = 0;
          codes_v[i] = 0;
        }
      }
    }
    if (lane == 0) {
      scales_m[block] = am;
      scales_v[block] = av;
    }
  }
}

// One kernel per way of storing the moments (S), so that the float32 kernel carries none of the
// compressed paths' registers.
template <StateType S>
__global__ void __launch_bounds__(threads_of(S), min_blocks_of(S))
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
    switch (meta.i8_layout[t]) {
      case kF32:
        return int8_blocks<kF32>(x, begin, end, settled_t, s, inv);
      case kBF16:
        return int8_blocks<kBF16>(x, begin, end, settled_t, s, inv);
      case kBF16GradF32:
        return int8_blocks<kBF16GradF32>(x, begin, end, settled_t, s, inv);
      case kF16:
        return int8_blocks<kF16>(x, begin, end, settled_t, s, inv);
      case kF16GradF32:
        return int8_blocks<kF16GradF32>(x, begin, end, settled_t, s, inv);
      default:
        return int8_blocks<kAny>(x, begin, end, settled_t, s, inv);
    }
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
bool aligned4(const void* ptr) { return (reinterpret_cast<std::uintptr_t>(ptr) & 3) == 0; }

// The whole-block loop an int8 tensor takes: the one compiled for its types where its pointers
// allow four elements a load (16 bytes for float32, 8 for 16-bit elements, 4 for the codes).
I8Layout int8_layout(const AdamTensor& x) {
  auto aligned = [](const void* ptr, ElemType type) {
    return type == ElemType::kF32 ? aligned16(ptr) : aligned8(ptr);
  };
  if (!aligned4(x.exp_avg) || !aligned4(x.exp_avg_sq) || !aligned(x.param, x.param_type) ||
      !aligned(x.grad, x.grad_type)) {
    return kAny;
  }
  if (x.param_type == ElemType::kF32) {
    return x.master == nullptr && x.grad_type == ElemType::kF32 ? kF32 : kAny;
  }
  if (x.master == nullptr || !aligned16(x.master)) return kAny;
  const bool bf16 = x.param_type == ElemType::kBF16;
  if (x.grad_type == ElemType::kF32) return bf16 ? kBF16GradF32 : kF16GradF32;
  if (x.grad_type == x.param_type) return bf16 ? kBF16 : kF16;
  return kAny;
}

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
            <<<blocks, threads_of(StateType::kBF16), 0, stream>>>(meta, s, grad_scale, found_inf);
        break;
      case StateType::kI8:
        adam_kernel<StateType::kI8>
            <<<blocks, threads_of(StateType::kI8), 0, stream>>>(meta, s, grad_scale, found_inf);
        break;
      default:
        adam_kernel<StateType::kF32>
            <<<blocks, threads_of(StateType::kF32), 0, stream>>>(meta, s, grad_scale, found_inf);
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
        meta.i8_layout[slot] = x.state_type == StateType::kI8 ? int8_layout(x) : kAny;
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
