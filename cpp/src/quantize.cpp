// quantize_symmetric / dequantize_symmetric: argument validation, the split of the groups over the pool,
// and the dispatch to the chosen ISA's kernel. See Note [Quantization arithmetic] in zerocore/quantize.hpp.
#include "zerocore/quantize.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>

#include "quantize_kernels.hpp"
#include "zerocore/error.hpp"

namespace zerocore {
namespace {

// Below this many elements per thread the handoff to a worker costs more than the work it saves (the
// same threshold as the Adam kernels').
constexpr int64_t kMinElementsPerThread = 32 * 1024;

using QuantizeFn = QuantizeResult (*)(const kernels::QuantizeArgs&, int64_t, int64_t);
using DequantizeFn = void (*)(const kernels::DequantizeArgs&, int64_t, int64_t);

// What both directions check: sizes, bits and group_size, the dtype, the pointers and the SIMD path.
void check_common(const char* caller, int64_t n, int bits, int64_t group_size, ScalarType type,
                  const char* type_name, const void* data, const char* data_name, const void* q, const float* scales,
                  SimdPath path) {
  check_quantize_args(caller, n, bits, group_size, type, type_name);
  if (n > 0) {
    ZC_CHECK_ARG(data != nullptr, caller, ": ", data_name, " must not be null when n > 0 (n = ", n, ")");
    ZC_CHECK_ARG(q != nullptr, caller, ": q must not be null when n > 0 (n = ", n, ")");
    ZC_CHECK_ARG(scales != nullptr, caller, ": scales must not be null when n > 0 (n = ", n, ")");
  }
  check_simd_path(path, caller);
}

QuantizeFn quantize_kernel(SimdPath path) {
  switch (path) {
    case SimdPath::kScalar: return kernels::quantize_groups_scalar;
#if defined(ZEROCORE_HAVE_AVX2)
    case SimdPath::kAvx2: return kernels::quantize_groups_avx2;
#endif
#if defined(ZEROCORE_HAVE_AVX512)
    case SimdPath::kAvx512: return kernels::quantize_groups_avx512;
#endif
    default: break;
  }
  throw InvalidArgument(detail::concat("no quantize kernel for SIMD path '", simd_path_name(path), "'"));
}

DequantizeFn dequantize_kernel(SimdPath path) {
  switch (path) {
    case SimdPath::kScalar: return kernels::dequantize_groups_scalar;
#if defined(ZEROCORE_HAVE_AVX2)
    case SimdPath::kAvx2: return kernels::dequantize_groups_avx2;
#endif
#if defined(ZEROCORE_HAVE_AVX512)
    case SimdPath::kAvx512: return kernels::dequantize_groups_avx512;
#endif
    default: break;
  }
  throw InvalidArgument(detail::concat("no dequantize kernel for SIMD path '", simd_path_name(path), "'"));
}

// Runs fn(group_begin, group_end) over [0, num_groups): on the calling thread when the work is small,
// otherwise one contiguous range of whole groups per thread (balanced to within a group).
template <typename Fn>
void split_groups(int64_t n, int64_t group_size, ThreadPool* pool, const Fn& fn) {
  const int64_t groups = quantize_num_groups(n, group_size);
  const int64_t threads = pool == nullptr ? 1 : pool->num_threads();
  const int64_t useful_threads = std::min({threads, groups, std::max<int64_t>(1, n / kMinElementsPerThread)});
  if (useful_threads <= 1) {
    fn(0, groups);
    return;
  }
  pool->parallel_for(groups, (groups + useful_threads - 1) / useful_threads, fn);
}

}  // namespace

void check_quantize_args(const char* caller, int64_t n, int bits, int64_t group_size, ScalarType type,
                         const char* type_name) {
  ZC_CHECK_ARG(n >= 0, caller, ": n must be >= 0, got ", n);
  ZC_CHECK_ARG(bits == 8 || bits == 4, caller, ": bits must be 8 (int8) or 4 (int4), got ", bits);
  ZC_CHECK_ARG(group_size > 0, caller, ": group_size must be > 0, got ", group_size);
  ZC_CHECK_ARG(bits == 8 || group_size % 2 == 0, caller,
               ": group_size must be even for bits = 4 (two values per byte, every group starting on a byte "
               "boundary), got ", group_size);
  ZC_CHECK_ARG(is_float_type(type), caller, ": ", type_name, " must be float32, bfloat16 or float16, got ",
               static_cast<int>(type));
}

int quantize_qmax(int bits) {
  ZC_CHECK_ARG(bits == 8 || bits == 4, "bits must be 8 (int8) or 4 (int4), got ", bits);
  return bits == 8 ? 127 : 7;
}

int64_t quantized_bytes(int64_t n, int bits) {
  ZC_CHECK_ARG(n >= 0, "n must be >= 0, got ", n);
  ZC_CHECK_ARG(bits == 8 || bits == 4, "bits must be 8 (int8) or 4 (int4), got ", bits);
  return bits == 8 ? n : n / 2 + n % 2;
}

int64_t quantize_num_groups(int64_t n, int64_t group_size) {
  ZC_CHECK_ARG(n >= 0, "n must be >= 0, got ", n);
  ZC_CHECK_ARG(group_size > 0, "group_size must be > 0, got ", group_size);
  return n / group_size + (n % group_size != 0 ? 1 : 0);
}

QuantizeResult quantize_symmetric(const void* input, ScalarType in_dtype, int64_t n, int bits, int64_t group_size,
                                  uint8_t* out_q, float* out_scales, ThreadPool* pool, SimdPath path) {
  constexpr const char* kCaller = "quantize_symmetric";
  check_common(kCaller, n, bits, group_size, in_dtype, "in_dtype", input, "input", out_q, out_scales, path);
  const QuantizeFn kernel = quantize_kernel(path);
  QuantizeResult total;
  if (n == 0) return total;
  const kernels::QuantizeArgs args{input, in_dtype, n, bits, group_size, out_q, out_scales};
  std::mutex mutex;
  split_groups(n, group_size, pool, [&](int64_t begin, int64_t end) {
    const QuantizeResult part = kernel(args, begin, end);
    if (part.nonfinite_count == 0) return;
    std::lock_guard<std::mutex> lock(mutex);
    kernels::merge_results(total, part);
  });
  return total;
}

void dequantize_symmetric(const uint8_t* q, const float* scales, int64_t n, int bits, int64_t group_size, void* out,
                          ScalarType out_dtype, ThreadPool* pool, SimdPath path) {
  constexpr const char* kCaller = "dequantize_symmetric";
  check_common(kCaller, n, bits, group_size, out_dtype, "out_dtype", out, "out", q, scales, path);
  const DequantizeFn kernel = dequantize_kernel(path);
  if (n == 0) return;
  const kernels::DequantizeArgs args{q, scales, n, bits, group_size, out, out_dtype};
  split_groups(n, group_size, pool, [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
}

}  // namespace zerocore
