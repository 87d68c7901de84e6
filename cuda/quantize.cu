// Symmetric blockwise int8 / int4 quantization on CUDA device memory. API: zerocore/cuda_quantize.hpp;
// arithmetic: Note [Quantization arithmetic] in zerocore/quantize.hpp, reproduced bit for bit.
//
// Note [CUDA quantize kernels]
// ----------------------------
// * A *team* of threads owns one group at a time: a warp when group_size <= kWarpTeamMaxGroup (eight groups
//   per 256-thread block), the whole block otherwise; teams walk the groups grid-stride. The team reads its
//   group once for max |x| (as integer bits, so inf/NaN sort above every finite value; warp shuffles, then
//   shared memory across the block's warps) and once more to quantize, so a group's second read hits L1/L2.
// * scale = __fdiv_ru(absmax, qmax) is the CPU's rounded-up scale exactly. q = __float2int_rn(x * (1/scale))
//   then moved by one where the exact residual x - q * scale (one FMA) says the rounded reciprocal crossed a
//   half, as the CPU's SIMD paths do; tiny scales run lifted by 2^64 as on the CPU. Every product is an
//   explicit __fmul_rn / __fmaf_rn, so nvcc's FMA contraction cannot change a bit.
// * int4: a thread writes whole bytes (elements 2k and 2k + 1 of its group), so no two threads share a byte.
// * Non-finite inputs: the team counts them, atomicAdd into nonfinite[0] and atomicMin into nonfinite[1],
//   and writes scale NaN and q = 0 for the group. Both counters are reset by the launch (cudaMemsetAsync).
// * Dequantize uses the same teams: the team loads its group's scale once and writes q * scale (__fmul_rn),
//   rounded to nearest even by __float2bfloat16_rn / __float2half_rn (the CPU's roundings for every non-NaN
//   value); a NaN scale writes the canonical quiet NaN of the output dtype, as the CPU does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "zerocore/cuda_quantize.hpp"
#include "zerocore/error.hpp"
#include "zerocore/quantize.hpp"

namespace zerocore {
namespace cuda_quantize_detail {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int64_t kWarpTeamMaxGroup = 512;  // up to 16 elements per lane: a warp per group
constexpr int64_t kMaxGrid = 65535 * 32;    // teams walk the groups grid-stride beyond this

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("zerocore CUDA: ") + what + ": " + cudaGetErrorString(err));
  }
}

// ---------------------------------------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// The canonical quiet NaN of each output dtype (the CPU's: 0x7FC00000, 0x7FC0, 0x7E00).
template <typename T>
__device__ __forceinline__ T canonical_nan();
template <>
__device__ __forceinline__ float canonical_nan<float>() { return __uint_as_float(0x7FC00000u); }
template <>
__device__ __forceinline__ __nv_bfloat16 canonical_nan<__nv_bfloat16>() { return __ushort_as_bfloat16(0x7FC0); }
template <>
__device__ __forceinline__ __half canonical_nan<__half>() { return __ushort_as_half(0x7E00); }

__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }
__device__ __forceinline__ bool is_nonfinite(float x) { return abs_bits(x) >= 0x7F800000u; }

// max over the team of `value`. kTeam = 32: the warp; kTeam = kThreads: the block, through `shared`
// (kThreads / 32 slots). Every thread of the team must call it.
template <int kTeam>
__device__ __forceinline__ uint32_t team_max(uint32_t value, uint32_t* shared) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) value = max(value, __shfl_xor_sync(0xFFFFFFFFu, value, offset));
  if constexpr (kTeam == kWarp) {
    return value;
  } else {
    const int warp = threadIdx.x / kWarp;
    if (threadIdx.x % kWarp == 0) shared[warp] = value;
    __syncthreads();
    uint32_t result = shared[0];
#pragma unroll
    for (int w = 1; w < kTeam / kWarp; ++w) result = max(result, shared[w]);
    __syncthreads();  // the slots are reused by the next group
    return result;
  }
}

// The working scale of Note [Quantization arithmetic]: tiny scales are lifted by 2^64 with x.
struct Rounder {
  float prescale, scale, inverse, half;

  __device__ __forceinline__ explicit Rounder(float group_scale) {
    prescale = group_scale < 7.8886090522101181e-31f ? 18446744073709551616.0f : 1.0f;  // 2^-100, 2^64
    scale = __fmul_rn(group_scale, prescale);
    inverse = __frcp_rn(scale);
    half = __fmul_rn(0.5f, scale);
  }

  // round_half_even(x / group_scale), exactly.
  __device__ __forceinline__ int quantize(float x) const {
    const float xs = __fmul_rn(x, prescale);
    int q = __float2int_rn(__fmul_rn(xs, inverse));
    const float r = __fmaf_rn(-static_cast<float>(q), scale, xs);  // xs - q * scale, exact
    const bool odd = (q & 1) != 0;
    if (r > half || (r == half && odd)) {
      ++q;
    } else if (r < -half || (r == -half && odd)) {
      --q;
    }
    return q;
  }
};

struct GroupBounds {
  int64_t begin, end;
};

__device__ __forceinline__ GroupBounds bounds_of(int64_t g, int64_t n, int64_t group_size) {
  const int64_t begin = g * group_size;
  return {begin, min(n, begin + group_size)};
}

// ---------------------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------------------
template <typename In, int kBits, int kTeam>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const In* __restrict__ x, int64_t n, int64_t group_size, int64_t num_groups,
                    uint8_t* __restrict__ q, float* __restrict__ scales, unsigned long long* nonfinite) {
  constexpr int kTeamsPerBlock = kThreads / kTeam;
  constexpr int kQmax = kBits == 8 ? 127 : 7;
  __shared__ uint32_t shared[kThreads / kWarp];
  const int lane = threadIdx.x % kTeam;
  const int64_t first_group = static_cast<int64_t>(blockIdx.x) * kTeamsPerBlock + threadIdx.x / kTeam;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kTeamsPerBlock;
  // Block teams: every thread runs the same iterations (team_max syncs the block). Warp teams: per warp.
  for (int64_t g = first_group; g < num_groups; g += stride) {
    const GroupBounds group = bounds_of(g, n, group_size);
    uint32_t largest = 0;
    for (int64_t i = group.begin + lane; i < group.end; i += kTeam) largest = max(largest, abs_bits(to_float(x[i])));
    largest = team_max<kTeam>(largest, shared);

    const int64_t bytes = kBits == 8 ? group.end - group.begin : (group.end - group.begin + 1) / 2;
    uint8_t* const group_q = q + (kBits == 8 ? group.begin : group.begin / 2);
    if (largest >= 0x7F800000u) {  // inf or NaN: count them, poison the scale, never quantize
      unsigned long long count = 0;
      unsigned long long first = ~0ull;
      for (int64_t i = group.begin + lane; i < group.end; i += kTeam) {
        if (is_nonfinite(to_float(x[i]))) {
          ++count;
          first = min(first, static_cast<unsigned long long>(i));
        }
      }
      if (count > 0) {
        atomicAdd(&nonfinite[0], count);
        atomicMin(&nonfinite[1], first);
      }
      if (lane == 0) scales[g] = __uint_as_float(0x7FC00000u);
      for (int64_t b = lane; b < bytes; b += kTeam) group_q[b] = 0;
      continue;
    }
    const float scale = __fdiv_ru(__uint_as_float(largest), static_cast<float>(kQmax));
    if (lane == 0) scales[g] = scale;
    if (scale == 0.0f) {
      for (int64_t b = lane; b < bytes; b += kTeam) group_q[b] = 0;
      continue;
    }
    const Rounder rounder(scale);
    if constexpr (kBits == 8) {
      for (int64_t i = group.begin + lane; i < group.end; i += kTeam) {
        group_q[i - group.begin] = static_cast<uint8_t>(rounder.quantize(to_float(x[i])));
      }
    } else {
      for (int64_t b = lane; b < bytes; b += kTeam) {
        const int64_t i = group.begin + 2 * b;
        const int low = rounder.quantize(to_float(x[i]));
        const int high = i + 1 < group.end ? rounder.quantize(to_float(x[i + 1])) : 0;
        group_q[b] = static_cast<uint8_t>((low & 0xF) | ((high & 0xF) << 4));
      }
    }
  }
}

// A two's complement nibble as a float.
__device__ __forceinline__ float nibble_value(uint32_t nibble) {
  return static_cast<float>(static_cast<int>(nibble ^ 8u) - 8);
}

template <typename Out, int kBits, int kTeam>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scales, int64_t n, int64_t group_size,
                      int64_t num_groups, Out* __restrict__ out) {
  constexpr int kTeamsPerBlock = kThreads / kTeam;
  const int lane = threadIdx.x % kTeam;
  const int64_t first_group = static_cast<int64_t>(blockIdx.x) * kTeamsPerBlock + threadIdx.x / kTeam;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kTeamsPerBlock;
  for (int64_t g = first_group; g < num_groups; g += stride) {
    const GroupBounds group = bounds_of(g, n, group_size);
    const float scale = scales[g];
    if (scale != scale) {
      for (int64_t i = group.begin + lane; i < group.end; i += kTeam) out[i] = canonical_nan<Out>();
      continue;
    }
    if constexpr (kBits == 8) {
      const int8_t* const group_q = reinterpret_cast<const int8_t*>(q) + group.begin;
      for (int64_t i = group.begin + lane; i < group.end; i += kTeam) {
        out[i] = from_float<Out>(__fmul_rn(static_cast<float>(group_q[i - group.begin]), scale));
      }
    } else {
      const uint8_t* const group_q = q + group.begin / 2;
      const int64_t bytes = (group.end - group.begin + 1) / 2;
      for (int64_t b = lane; b < bytes; b += kTeam) {
        const uint32_t byte = group_q[b];
        const int64_t i = group.begin + 2 * b;
        out[i] = from_float<Out>(__fmul_rn(nibble_value(byte & 0xFu), scale));
        if (i + 1 < group.end) out[i + 1] = from_float<Out>(__fmul_rn(nibble_value(byte >> 4), scale));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------------------
// Blocks for `num_groups` groups with teams of kTeam threads.
template <int kTeam>
unsigned grid_for(int64_t num_groups) {
  constexpr int64_t kTeamsPerBlock = kThreads / kTeam;
  return static_cast<unsigned>(std::min<int64_t>(kMaxGrid, (num_groups + kTeamsPerBlock - 1) / kTeamsPerBlock));
}

template <typename In, int kBits>
void launch_quantize_typed(const void* input, int64_t n, int64_t group_size, uint8_t* q, float* scales,
                           unsigned long long* nonfinite, cudaStream_t stream) {
  const int64_t num_groups = quantize_num_groups(n, group_size);
  const In* x = static_cast<const In*>(input);
  if (group_size <= kWarpTeamMaxGroup) {
    quantize_kernel<In, kBits, kWarp><<<grid_for<kWarp>(num_groups), kThreads, 0, stream>>>(
        x, n, group_size, num_groups, q, scales, nonfinite);
  } else {
    quantize_kernel<In, kBits, kThreads><<<grid_for<kThreads>(num_groups), kThreads, 0, stream>>>(
        x, n, group_size, num_groups, q, scales, nonfinite);
  }
  check_cuda(cudaGetLastError(), "quantize_kernel launch");
}

template <typename Out, int kBits>
void launch_dequantize_typed(const uint8_t* q, const float* scales, int64_t n, int64_t group_size, void* out,
                             cudaStream_t stream) {
  const int64_t num_groups = quantize_num_groups(n, group_size);
  Out* y = static_cast<Out*>(out);
  if (group_size <= kWarpTeamMaxGroup) {
    dequantize_kernel<Out, kBits, kWarp><<<grid_for<kWarp>(num_groups), kThreads, 0, stream>>>(
        q, scales, n, group_size, num_groups, y);
  } else {
    dequantize_kernel<Out, kBits, kThreads><<<grid_for<kThreads>(num_groups), kThreads, 0, stream>>>(
        q, scales, n, group_size, num_groups, y);
  }
  check_cuda(cudaGetLastError(), "dequantize_kernel launch");
}

template <int kBits>
void launch_quantize_bits(const void* input, ScalarType type, int64_t n, int64_t group_size, uint8_t* q,
                          float* scales, unsigned long long* nonfinite, cudaStream_t stream) {
  switch (type) {
    case ScalarType::kFloat32:
      return launch_quantize_typed<float, kBits>(input, n, group_size, q, scales, nonfinite, stream);
    case ScalarType::kBFloat16:
      return launch_quantize_typed<__nv_bfloat16, kBits>(input, n, group_size, q, scales, nonfinite, stream);
    case ScalarType::kFloat16:
      return launch_quantize_typed<__half, kBits>(input, n, group_size, q, scales, nonfinite, stream);
  }
}

template <int kBits>
void launch_dequantize_bits(const uint8_t* q, const float* scales, int64_t n, int64_t group_size, void* out,
                            ScalarType type, cudaStream_t stream) {
  switch (type) {
    case ScalarType::kFloat32:
      return launch_dequantize_typed<float, kBits>(q, scales, n, group_size, out, stream);
    case ScalarType::kBFloat16:
      return launch_dequantize_typed<__nv_bfloat16, kBits>(q, scales, n, group_size, out, stream);
    case ScalarType::kFloat16:
      return launch_dequantize_typed<__half, kBits>(q, scales, n, group_size, out, stream);
  }
}

}  // namespace
}  // namespace cuda_quantize_detail

void launch_quantize_symmetric(const void* input, ScalarType in_dtype, int64_t n, int bits, int64_t group_size,
                               uint8_t* q, float* scales, int64_t* nonfinite, void* stream) {
  using namespace cuda_quantize_detail;
  constexpr const char* kCaller = "launch_quantize_symmetric";
  check_quantize_args(kCaller, n, bits, group_size, in_dtype, "in_dtype");
  ZC_CHECK_ARG(nonfinite != nullptr, kCaller, ": nonfinite must not be null");
  const auto s = static_cast<cudaStream_t>(stream);
  // count = 0, first index = all ones (the largest unsigned value, so atomicMin takes any index).
  check_cuda(cudaMemsetAsync(nonfinite, 0, sizeof(int64_t), s), "cudaMemsetAsync");
  check_cuda(cudaMemsetAsync(nonfinite + 1, 0xFF, sizeof(int64_t), s), "cudaMemsetAsync");
  if (n == 0) return;
  ZC_CHECK_ARG(input != nullptr && q != nullptr && scales != nullptr, kCaller,
               ": input, q and scales must not be null when n > 0 (n = ", n, ")");
  auto* counters = reinterpret_cast<unsigned long long*>(nonfinite);
  if (bits == 8) {
    launch_quantize_bits<8>(input, in_dtype, n, group_size, q, scales, counters, s);
  } else {
    launch_quantize_bits<4>(input, in_dtype, n, group_size, q, scales, counters, s);
  }
}

void launch_dequantize_symmetric(const uint8_t* q, const float* scales, int64_t n, int bits, int64_t group_size,
                                 void* out, ScalarType out_dtype, void* stream) {
  using namespace cuda_quantize_detail;
  constexpr const char* kCaller = "launch_dequantize_symmetric";
  check_quantize_args(kCaller, n, bits, group_size, out_dtype, "out_dtype");
  if (n == 0) return;
  ZC_CHECK_ARG(q != nullptr && scales != nullptr && out != nullptr, kCaller,
               ": q, scales and out must not be null when n > 0 (n = ", n, ")");
  const auto s = static_cast<cudaStream_t>(stream);
  if (bits == 8) {
    launch_dequantize_bits<8>(q, scales, n, group_size, out, out_dtype, s);
  } else {
    launch_dequantize_bits<4>(q, scales, n, group_size, out, out_dtype, s);
  }
}

}  // namespace zerocore
