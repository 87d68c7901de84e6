// Fused Adam / AdamW and the finite-gradient check on CUDA device memory. API: zerocore/cuda_adam.hpp;
// arithmetic: adam_math.cuh and Note [Adam arithmetic].
//
// Note [CUDA Adam kernels]
// ------------------------
// * Templates over the gradient type (fp32/bf16/fp16), the param_out type (none/bf16/fp16, written with
//   round-to-nearest-even) and the mode (AdamW/L2): 18 flat and 18 multi-tensor kernels.
// * Each thread handles kVec = 8 elements per step with 16-byte loads/stores (two per fp32 array, one per
//   16-bit array). A range is vectorised from the first index at which every pointer is 16-byte aligned
//   (so a tensor[1:] view of aligned buffers still vectorises after a short scalar head); the head, the
//   tail and ranges with no common alignment take the scalar path.
// * The flat kernel is grid-stride with grid = min(work, SMs x resident blocks per SM); both numbers are
//   cached per device (and, for occupancy, per kernel). The multi-tensor kernel gives each block one
//   kChunk-element chunk of one tensor; the chunk and tensor tables travel in the kernel arguments.
// * Device scalars (AdamDeviceScalars) are read by every thread at kernel start: `skip` first (the whole
//   kernel returns), then lr/step/grad_scale, from which the fp32 coefficients are re-derived in double
//   with the host's code. No launch synchronises with the host.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "adam_math.cuh"
#include "zerocore/cuda_adam.hpp"
#include "zerocore/error.hpp"

namespace zerocore {
namespace cuda_detail {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;               // elements per thread step
constexpr int64_t kChunk = 65536;     // multi-tensor: elements per block
constexpr int kMaxDevices = 64;       // per-device caches; higher ordinals are queried every time

// ---------------------------------------------------------------------------------------------------------
// Host helpers
// ---------------------------------------------------------------------------------------------------------
void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("zerocore CUDA: ") + what + ": " + cudaGetErrorString(err));
  }
}

int current_device() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

int sm_count(int device) {
  static std::atomic<int> cache[kMaxDevices] = {};
  if (device < kMaxDevices) {
    if (const int cached = cache[device].load(std::memory_order_relaxed)) return cached;
  }
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  sms = std::max(sms, 1);
  if (device < kMaxDevices) cache[device].store(sms, std::memory_order_relaxed);
  return sms;
}

// Resident blocks per SM of one kernel, cached per device by the caller's `cache` (one per kernel).
template <typename Kernel>
int blocks_per_sm(Kernel kernel, std::atomic<int>* cache, int device) {
  if (device < kMaxDevices) {
    if (const int cached = cache[device].load(std::memory_order_relaxed)) return cached;
  }
  int blocks = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  blocks = std::max(blocks, 1);
  if (device < kMaxDevices) cache[device].store(blocks, std::memory_order_relaxed);
  return blocks;
}

// Grid for a grid-stride kernel with `thread_steps` units of per-thread work: enough blocks to fill the
// device once, fewer for small inputs.
template <typename Kernel>
int grid_size(Kernel kernel, std::atomic<int>* cache, int64_t thread_steps) {
  const int device = current_device();
  const int64_t resident = static_cast<int64_t>(sm_count(device)) * blocks_per_sm(kernel, cache, device);
  const int64_t needed = (thread_steps + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min(needed, resident)));
}

void check_launch(const char* what) { check_cuda(cudaGetLastError(), what); }

// ---------------------------------------------------------------------------------------------------------
// Element types
// ---------------------------------------------------------------------------------------------------------
struct NoOut {};  // param_out absent

template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
  static __device__ __forceinline__ float to_float(float x) { return x; }
};
template <>
struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &h, 4);
    return u;
  }
};
template <>
struct Cvt<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &h, 4);
    return u;
  }
};

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// N elements of T from / to a 16-byte aligned address, as 16-byte accesses.
template <int N, typename T>
__device__ __forceinline__ void load_vec(const T* src, T (&dst)[N]) {
  static_assert((N * sizeof(T)) % 16 == 0, "whole 16-byte accesses only");
  constexpr int kPer = 16 / sizeof(T);
#pragma unroll
  for (int c = 0; c < N / kPer; ++c) {
    const uint4 raw = reinterpret_cast<const uint4*>(src)[c];
    memcpy(&dst[c * kPer], &raw, 16);
  }
}

template <int N>
__device__ __forceinline__ void store_vec(float* dst, const float (&src)[N]) {
  static_assert(N % 4 == 0, "whole 16-byte accesses only");
#pragma unroll
  for (int c = 0; c < N / 4; ++c) {
    // __stwb (st.global.wb.v4) keeps the store one 16-byte access; a plain float4 assignment is sometimes
    // split into scalar stores by the front end.
    const float4 value = make_float4(src[4 * c], src[4 * c + 1], src[4 * c + 2], src[4 * c + 3]);
    __stwb(reinterpret_cast<float4*>(dst) + c, value);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Adam
// ---------------------------------------------------------------------------------------------------------
struct AdamPtrs {
  float* p;
  const void* g;
  float* m;
  float* v;
  void* out;
};

// Everything a kernel needs to know about the scalars: the host-derived coefficients plus what it needs to
// re-derive them from device values.
struct KernelScalars {
  AdamCoeffs coeffs;
  double lr, beta1, beta2, eps, weight_decay, step, grad_scale;
  bool bias_correction;
  const float* lr_ptr;
  const float* step_ptr;
  const float* grad_scale_ptr;
  const int32_t* skip;
};

// False when the launch is to be skipped; otherwise fills the coefficients for this launch.
__device__ __forceinline__ bool resolve_scalars(const KernelScalars& ks, AdamCoeffs& c) {
  if (ks.skip != nullptr && *ks.skip != 0) return false;
  c = ks.coeffs;
  if (ks.lr_ptr != nullptr || ks.step_ptr != nullptr || ks.grad_scale_ptr != nullptr) {
    const double lr = ks.lr_ptr != nullptr ? static_cast<double>(*ks.lr_ptr) : ks.lr;
    const double step = ks.step_ptr != nullptr ? static_cast<double>(*ks.step_ptr) : ks.step;
    const double grad_scale =
        ks.grad_scale_ptr != nullptr ? static_cast<double>(*ks.grad_scale_ptr) : ks.grad_scale;
    c = make_adam_coeffs(lr, ks.beta1, ks.beta2, ks.eps, ks.weight_decay, step, grad_scale, ks.bias_correction);
  }
  return true;
}

template <typename GradT, typename OutT, AdamMode Mode>
__device__ __forceinline__ void adam_scalar(const AdamPtrs& t, int64_t i, const AdamCoeffs& c) {
  float p = t.p[i];
  float m = t.m[i];
  float v = t.v[i];
  adam_update<Mode>(p, m, v, Cvt<GradT>::to_float(static_cast<const GradT*>(t.g)[i]), c);
  t.p[i] = p;
  t.m[i] = m;
  t.v[i] = v;
  if constexpr (!std::is_same_v<OutT, NoOut>) static_cast<OutT*>(t.out)[i] = Cvt<OutT>::from_float(p);
}

template <typename GradT, typename OutT, AdamMode Mode>
__device__ __forceinline__ void adam_vector(const AdamPtrs& t, int64_t i, const AdamCoeffs& c) {
  float p[kVec], m[kVec], v[kVec];
  GradT g[kVec];
  load_vec(t.p + i, p);
  load_vec(t.m + i, m);
  load_vec(t.v + i, v);
  load_vec(static_cast<const GradT*>(t.g) + i, g);
#pragma unroll
  for (int j = 0; j < kVec; ++j) adam_update<Mode>(p[j], m[j], v[j], Cvt<GradT>::to_float(g[j]), c);
  store_vec(t.p + i, p);
  store_vec(t.m + i, m);
  store_vec(t.v + i, v);
  if constexpr (!std::is_same_v<OutT, NoOut>) {
    static_assert(kVec == 8 && sizeof(OutT) == 2, "one 16-byte store of 8 16-bit values");
    const uint4 out = make_uint4(Cvt<OutT>::pack2(p[0], p[1]), Cvt<OutT>::pack2(p[2], p[3]),
                                 Cvt<OutT>::pack2(p[4], p[5]), Cvt<OutT>::pack2(p[6], p[7]));
    __stwb(reinterpret_cast<uint4*>(static_cast<OutT*>(t.out) + i), out);
  }
}

// The smallest k in [0, kVec) such that every pointer of element begin + k is 16-byte aligned; -1: none.
template <typename GradT, typename OutT>
__device__ __forceinline__ int vector_head(const AdamPtrs& t, int64_t begin) {
  for (int k = 0; k < kVec; ++k) {
    const int64_t i = begin + k;
    bool ok = aligned16(t.p + i) && aligned16(t.m + i) && aligned16(t.v + i) &&
              aligned16(static_cast<const GradT*>(t.g) + i);
    if constexpr (!std::is_same_v<OutT, NoOut>) ok = ok && aligned16(static_cast<const OutT*>(t.out) + i);
    if (ok) return k;
  }
  return -1;
}

// Elements [begin, end) split over threads tid = 0..nthreads-1.
template <typename GradT, typename OutT, AdamMode Mode>
__device__ __forceinline__ void adam_range(const AdamPtrs& t, int64_t begin, int64_t end, int64_t tid,
                                           int64_t nthreads, const AdamCoeffs& c) {
  const int64_t len = end - begin;
  const int k = vector_head<GradT, OutT>(t, begin);
  int64_t head = len;  // scalar elements before the vectors
  int64_t nvec = 0;
  if (k >= 0 && k < len) {
    head = k;
    nvec = (len - k) / kVec;
  }
  const int64_t vec_begin = begin + head;
  for (int64_t j = tid; j < nvec; j += nthreads) adam_vector<GradT, OutT, Mode>(t, vec_begin + j * kVec, c);
  const int64_t tail_begin = vec_begin + nvec * kVec;
  const int64_t nscalar = head + (end - tail_begin);
  for (int64_t j = tid; j < nscalar; j += nthreads) {
    adam_scalar<GradT, OutT, Mode>(t, j < head ? begin + j : tail_begin + (j - head), c);
  }
}

template <typename GradT, typename OutT, AdamMode Mode>
__global__ void __launch_bounds__(kThreads) fused_adam_kernel(AdamPtrs t, int64_t n, KernelScalars ks) {
  AdamCoeffs c;
  if (!resolve_scalars(ks, c)) return;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  adam_range<GradT, OutT, Mode>(t, 0, n, tid, static_cast<int64_t>(gridDim.x) * blockDim.x, c);
}

// Multi-tensor: block b handles chunk chunk[b] of tensor tensor[b].
constexpr int kMtAdamTensors = 24;
constexpr int kMtBlocks = 320;
struct MtAdamArgs {
  AdamPtrs t[kMtAdamTensors];
  int64_t n[kMtAdamTensors];
  int32_t chunk[kMtBlocks];
  uint8_t tensor[kMtBlocks];
};
static_assert(sizeof(MtAdamArgs) + sizeof(KernelScalars) <= 4000, "kernel arguments must stay under 4 KB");

template <typename GradT, typename OutT, AdamMode Mode>
__global__ void __launch_bounds__(kThreads) multi_tensor_adam_kernel(MtAdamArgs args, KernelScalars ks) {
  AdamCoeffs c;
  if (!resolve_scalars(ks, c)) return;
  const int ti = args.tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(args.chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(begin + kChunk, args.n[ti]);
  const AdamPtrs t = args.t[ti];  // into registers once
  adam_range<GradT, OutT, Mode>(t, begin, end, threadIdx.x, blockDim.x, c);
}

// ---------------------------------------------------------------------------------------------------------
// Finite check: a value is inf/NaN iff its exponent bits are all ones, so only the element width (U) and
// the exponent mask depend on the type.
// ---------------------------------------------------------------------------------------------------------
template <typename U>
__device__ __forceinline__ bool range_has_nonfinite(const U* g, int64_t begin, int64_t end, int64_t tid,
                                                    int64_t nthreads, U mask) {
  constexpr int kPer = 16 / sizeof(U);
  const int64_t len = end - begin;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(g + begin);
  int64_t head = len;
  int64_t nvec = 0;
  if (addr % sizeof(U) == 0) {
    const int64_t to_aligned = static_cast<int64_t>((16 - addr % 16) % 16 / sizeof(U));
    head = to_aligned < len ? to_aligned : len;
    nvec = (len - head) / kPer;
  }
  bool bad = false;
  const int64_t vec_begin = begin + head;
  for (int64_t j = tid; j < nvec; j += nthreads) {
    U lanes[kPer];
    load_vec(g + vec_begin + j * kPer, lanes);
#pragma unroll
    for (int l = 0; l < kPer; ++l) bad |= (lanes[l] & mask) == mask;
  }
  const int64_t tail_begin = vec_begin + nvec * kPer;
  const int64_t nscalar = head + (end - tail_begin);
  for (int64_t j = tid; j < nscalar; j += nthreads) {
    bad |= (g[j < head ? begin + j : tail_begin + (j - head)] & mask) == mask;
  }
  return bad;
}

constexpr uint32_t kF32ExpMask = 0x7f800000u;
constexpr uint16_t kBF16ExpMask = 0x7f80u;
constexpr uint16_t kF16ExpMask = 0x7c00u;

// The flag is read and written by concurrently running blocks (the early-exit read races with another
// block's write of 1). Plain accesses would be a data race under the PTX memory model (and the read may be
// served from a stale L1 line); volatile accesses are relaxed system-scope ones, so the race is benign by
// definition: the read sees 0 or 1, every writer stores the same 1.
__device__ __forceinline__ bool flag_is_set(const int32_t* flag) {
  return *static_cast<const volatile int32_t*>(flag) != 0;
}
__device__ __forceinline__ void set_flag(int32_t* flag) { *static_cast<volatile int32_t*>(flag) = 1; }

template <typename U>
__global__ void __launch_bounds__(kThreads) check_finite_kernel(const U* g, int64_t n, U mask, int32_t* flag) {
  // Uniform per block: blocks of a check that already failed (earlier launch or block) do nothing.
  if (__syncthreads_or(threadIdx.x == 0 && flag_is_set(flag))) return;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool bad = range_has_nonfinite(g, 0, n, tid, static_cast<int64_t>(gridDim.x) * blockDim.x, mask);
  if (__syncthreads_or(bad) && threadIdx.x == 0) set_flag(flag);
}

constexpr int kMtFiniteTensors = 48;
struct MtFiniteArgs {
  const void* g[kMtFiniteTensors];
  int64_t n[kMtFiniteTensors];
  uint8_t type[kMtFiniteTensors];  // ScalarType
  int32_t chunk[kMtBlocks];
  uint8_t tensor[kMtBlocks];
};
static_assert(sizeof(MtFiniteArgs) <= 4000, "kernel arguments must stay under 4 KB");

__global__ void __launch_bounds__(kThreads) multi_tensor_check_finite_kernel(MtFiniteArgs args, int32_t* flag) {
  if (__syncthreads_or(threadIdx.x == 0 && flag_is_set(flag))) return;
  const int ti = args.tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(args.chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(begin + kChunk, args.n[ti]);
  bool bad;
  switch (static_cast<ScalarType>(args.type[ti])) {
    case ScalarType::kFloat32:
      bad = range_has_nonfinite(static_cast<const uint32_t*>(args.g[ti]), begin, end, threadIdx.x, blockDim.x,
                                kF32ExpMask);
      break;
    case ScalarType::kBFloat16:
      bad = range_has_nonfinite(static_cast<const uint16_t*>(args.g[ti]), begin, end, threadIdx.x, blockDim.x,
                                kBF16ExpMask);
      break;
    default:
      bad = range_has_nonfinite(static_cast<const uint16_t*>(args.g[ti]), begin, end, threadIdx.x, blockDim.x,
                                kF16ExpMask);
      break;
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) set_flag(flag);
}

// ---------------------------------------------------------------------------------------------------------
// Host side: validation, dispatch, tables
// ---------------------------------------------------------------------------------------------------------
template <typename T>
struct Tag {
  using type = T;
};
template <AdamMode M>
struct ModeTag {
  static constexpr AdamMode value = M;
};

void check_type(ScalarType type, const char* what) {
  ZC_CHECK_ARG(is_float_type(type), what, " has an unknown ScalarType value ", static_cast<int>(type));
}

void check_spans(const AdamSpans& s, const char* where) {
  ZC_CHECK_ARG(s.n >= 0, where, ": n must be >= 0, got ", s.n);
  check_type(s.grad_type, "grad_type");
  if (s.n == 0) return;
  ZC_CHECK_ARG(s.param != nullptr && s.grad != nullptr && s.exp_avg != nullptr && s.exp_avg_sq != nullptr, where,
               ": param, grad, exp_avg and exp_avg_sq must be non-null");
  if (s.param_out != nullptr) {
    ZC_CHECK_ARG(s.param_out_type == ScalarType::kBFloat16 || s.param_out_type == ScalarType::kFloat16, where,
                 ": param_out_type must be bfloat16 or float16");
  }
}

// Validates the hyper-parameters as cpu adam_step does (values overridden by device scalars are not checked).
KernelScalars make_kernel_scalars(const AdamHyper& h, const AdamDeviceScalars& dev, const char* where) {
  ZC_CHECK_ARG(dev.step != nullptr || h.step >= 1, where, ": step must be >= 1, got ", h.step);
  ZC_CHECK_ARG(dev.lr != nullptr || h.lr >= 0.0, where, ": lr must be >= 0, got ", h.lr);
  ZC_CHECK_ARG(h.beta1 >= 0.0 && h.beta1 < 1.0, where, ": beta1 must be in [0, 1), got ", h.beta1);
  ZC_CHECK_ARG(h.beta2 >= 0.0 && h.beta2 < 1.0, where, ": beta2 must be in [0, 1), got ", h.beta2);
  ZC_CHECK_ARG(h.eps >= 0.0, where, ": eps must be >= 0, got ", h.eps);
  ZC_CHECK_ARG(h.weight_decay >= 0.0, where, ": weight_decay must be >= 0, got ", h.weight_decay);
  KernelScalars ks{};
  const double step = static_cast<double>(std::max<int64_t>(h.step, 1));
  ks.coeffs =
      make_adam_coeffs(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, step, h.grad_scale, h.bias_correction);
  ks.lr = h.lr;
  ks.beta1 = h.beta1;
  ks.beta2 = h.beta2;
  ks.eps = h.eps;
  ks.weight_decay = h.weight_decay;
  ks.step = step;
  ks.grad_scale = h.grad_scale;
  ks.bias_correction = h.bias_correction;
  ks.lr_ptr = dev.lr;
  ks.step_ptr = dev.step;
  ks.grad_scale_ptr = dev.grad_scale;
  ks.skip = dev.skip;
  return ks;
}

// Calls f(Tag<GradT>, Tag<OutT>, ModeTag<Mode>) for the run-time types.
template <typename F>
void dispatch_adam(ScalarType grad_type, bool has_out, ScalarType out_type, bool adamw, F&& f) {
  auto with_mode = [&](auto g, auto o) {
    if (adamw) {
      f(g, o, ModeTag<AdamMode::kAdamW>{});
    } else {
      f(g, o, ModeTag<AdamMode::kL2>{});
    }
  };
  auto with_out = [&](auto g) {
    if (!has_out) {
      with_mode(g, Tag<NoOut>{});
    } else if (out_type == ScalarType::kBFloat16) {
      with_mode(g, Tag<__nv_bfloat16>{});
    } else {
      with_mode(g, Tag<__half>{});
    }
  };
  switch (grad_type) {
    case ScalarType::kFloat32: with_out(Tag<float>{}); break;
    case ScalarType::kBFloat16: with_out(Tag<__nv_bfloat16>{}); break;
    case ScalarType::kFloat16: with_out(Tag<__half>{}); break;
  }
}

AdamPtrs ptrs_of(const AdamSpans& s) { return {s.param, s.grad, s.exp_avg, s.exp_avg_sq, s.param_out}; }

// Splits the tensors `order` (indices with n > 0) into launches of at most MaxTensors tensors and kMtBlocks
// chunks, apex multi_tensor_apply style: a tensor whose chunks do not all fit continues in slot 0 of the
// next launch. put(slot, index) fills a tensor slot of `args`; launch(nblocks) launches with `args`.
template <int MaxTensors, typename Args, typename NOf, typename Put, typename Launch>
void for_each_launch(Args& args, const std::vector<int64_t>& order, NOf n_of, Put put, Launch launch) {
  int ntensors = 0;
  int nblocks = 0;
  for (const int64_t index : order) {
    put(ntensors, index);
    ++ntensors;
    const int64_t nchunks = (n_of(index) + kChunk - 1) / kChunk;
    ZC_CHECK_ARG(nchunks <= INT32_MAX, "tensor ", index, " is too large");
    for (int64_t c = 0; c < nchunks; ++c) {
      args.tensor[nblocks] = static_cast<uint8_t>(ntensors - 1);
      args.chunk[nblocks] = static_cast<int32_t>(c);
      ++nblocks;
      const bool last_chunk = c == nchunks - 1;
      if (nblocks == kMtBlocks || (ntensors == MaxTensors && last_chunk)) {
        launch(nblocks);
        nblocks = 0;
        if (last_chunk) {
          ntensors = 0;
        } else {
          put(0, index);
          ntensors = 1;
        }
      }
    }
  }
  if (nblocks > 0) launch(nblocks);
}

}  // namespace
}  // namespace cuda_detail

using namespace cuda_detail;

void launch_fused_adam(const AdamSpans& spans, const AdamHyper& hyper, const AdamDeviceScalars& dev, void* stream) {
  check_spans(spans, "launch_fused_adam");
  const KernelScalars ks = make_kernel_scalars(hyper, dev, "launch_fused_adam");
  if (spans.n == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  const AdamPtrs t = ptrs_of(spans);
  dispatch_adam(spans.grad_type, spans.param_out != nullptr, spans.param_out_type, hyper.adamw,
                [&](auto g, auto o, auto mode) {
                  using G = typename decltype(g)::type;
                  using O = typename decltype(o)::type;
                  auto kernel = fused_adam_kernel<G, O, decltype(mode)::value>;
                  static std::atomic<int> occupancy[kMaxDevices] = {};
                  const int grid = grid_size(kernel, occupancy, (spans.n + kVec - 1) / kVec);
                  kernel<<<grid, kThreads, 0, s>>>(t, spans.n, ks);
                  check_launch("fused_adam_kernel launch");
                });
}

void launch_multi_tensor_adam(const AdamSpans* tensors, int64_t num_tensors, const AdamHyper& hyper,
                              const AdamDeviceScalars& dev, void* stream) {
  ZC_CHECK_ARG(num_tensors >= 0, "num_tensors must be >= 0, got ", num_tensors);
  ZC_CHECK_ARG(num_tensors == 0 || tensors != nullptr, "tensors must be non-null");
  for (int64_t i = 0; i < num_tensors; ++i) check_spans(tensors[i], "launch_multi_tensor_adam");
  const KernelScalars ks = make_kernel_scalars(hyper, dev, "launch_multi_tensor_adam");
  const auto s = static_cast<cudaStream_t>(stream);
  // One group per kernel instantiation: (grad type, param_out type or none).
  auto group_of = [&](const AdamSpans& t) {
    const int out = t.param_out == nullptr ? 0 : (t.param_out_type == ScalarType::kBFloat16 ? 1 : 2);
    return static_cast<int>(t.grad_type) * 3 + out;
  };
  std::vector<int64_t> order[9];
  for (int64_t i = 0; i < num_tensors; ++i) {
    if (tensors[i].n > 0) order[group_of(tensors[i])].push_back(i);
  }
  for (const auto& group : order) {
    if (group.empty()) continue;
    const AdamSpans& first = tensors[group.front()];
    dispatch_adam(first.grad_type, first.param_out != nullptr, first.param_out_type, hyper.adamw,
                  [&](auto g, auto o, auto mode) {
                    using G = typename decltype(g)::type;
                    using O = typename decltype(o)::type;
                    auto kernel = multi_tensor_adam_kernel<G, O, decltype(mode)::value>;
                    MtAdamArgs args{};
                    for_each_launch<kMtAdamTensors>(
                        args, group, [&](int64_t i) { return tensors[i].n; },
                        [&](int slot, int64_t i) {
                          args.t[slot] = ptrs_of(tensors[i]);
                          args.n[slot] = tensors[i].n;
                        },
                        [&](int nblocks) {
                          kernel<<<nblocks, kThreads, 0, s>>>(args, ks);
                          check_launch("multi_tensor_adam_kernel launch");
                        });
                  });
  }
}

void launch_check_finite(const void* grad, ScalarType grad_type, int64_t n, int32_t* found_nonfinite,
                         void* stream) {
  check_type(grad_type, "grad_type");
  ZC_CHECK_ARG(n >= 0, "n must be >= 0, got ", n);
  ZC_CHECK_ARG(found_nonfinite != nullptr, "found_nonfinite must be non-null");
  if (n == 0) return;
  ZC_CHECK_ARG(grad != nullptr, "grad must be non-null");
  const auto s = static_cast<cudaStream_t>(stream);
  if (grad_type == ScalarType::kFloat32) {
    static std::atomic<int> occupancy[kMaxDevices] = {};
    const int grid = grid_size(check_finite_kernel<uint32_t>, occupancy, (n + 3) / 4);
    check_finite_kernel<uint32_t><<<grid, kThreads, 0, s>>>(static_cast<const uint32_t*>(grad), n, kF32ExpMask,
                                                             found_nonfinite);
  } else {
    static std::atomic<int> occupancy[kMaxDevices] = {};
    const int grid = grid_size(check_finite_kernel<uint16_t>, occupancy, (n + 7) / 8);
    const uint16_t mask = grad_type == ScalarType::kBFloat16 ? kBF16ExpMask : kF16ExpMask;
    check_finite_kernel<uint16_t><<<grid, kThreads, 0, s>>>(static_cast<const uint16_t*>(grad), n, mask,
                                                             found_nonfinite);
  }
  check_launch("check_finite_kernel launch");
}

void launch_multi_tensor_check_finite(const AdamSpans* tensors, int64_t num_tensors, int32_t* found_nonfinite,
                                      void* stream) {
  ZC_CHECK_ARG(num_tensors >= 0, "num_tensors must be >= 0, got ", num_tensors);
  ZC_CHECK_ARG(num_tensors == 0 || tensors != nullptr, "tensors must be non-null");
  ZC_CHECK_ARG(found_nonfinite != nullptr, "found_nonfinite must be non-null");
  std::vector<int64_t> order;
  for (int64_t i = 0; i < num_tensors; ++i) {
    check_type(tensors[i].grad_type, "grad_type");
    ZC_CHECK_ARG(tensors[i].n >= 0, "n must be >= 0, got ", tensors[i].n);
    if (tensors[i].n == 0) continue;
    ZC_CHECK_ARG(tensors[i].grad != nullptr, "grad must be non-null");
    order.push_back(i);
  }
  const auto s = static_cast<cudaStream_t>(stream);
  MtFiniteArgs args{};
  for_each_launch<kMtFiniteTensors>(
      args, order, [&](int64_t i) { return tensors[i].n; },
      [&](int slot, int64_t i) {
        args.g[slot] = tensors[i].grad;
        args.n[slot] = tensors[i].n;
        args.type[slot] = static_cast<uint8_t>(tensors[i].grad_type);
      },
      [&](int nblocks) {
        multi_tensor_check_finite_kernel<<<nblocks, kThreads, 0, s>>>(args, found_nonfinite);
        check_launch("multi_tensor_check_finite_kernel launch");
      });
}

}  // namespace zerocore
