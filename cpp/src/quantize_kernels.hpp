// Internal to the CPU quantization: the per-ISA kernels over a range of groups, and the per-group pieces
// every path shares (the scale, the non-finite bookkeeping). Each ISA lives in its own translation unit,
// compiled with that ISA's -m flags; quantize.cpp validates, splits the groups over the pool and picks one.
// See Note [Quantization arithmetic] in zerocore/quantize.hpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_adam_kernels.hpp"  // the exact scalar bf16/fp16 conversions
#include "zerocore/adam_types.hpp"
#include "zerocore/quantize.hpp"

namespace zerocore {
namespace kernels {

// One quantize_symmetric call, validated.
struct QuantizeArgs {
  const void* input = nullptr;
  ScalarType in_type = ScalarType::kFloat32;
  int64_t n = 0;
  int bits = 8;
  int64_t group_size = 1;
  uint8_t* q = nullptr;
  float* scales = nullptr;
};

// One dequantize_symmetric call, validated.
struct DequantizeArgs {
  const uint8_t* q = nullptr;
  const float* scales = nullptr;
  int64_t n = 0;
  int bits = 8;
  int64_t group_size = 1;
  void* out = nullptr;
  ScalarType out_type = ScalarType::kFloat32;
};

// Quantizes groups [group_begin, group_end) and returns what it found there (first_nonfinite is a global
// element index). Groups never share a byte of q, so ranges may run concurrently.
QuantizeResult quantize_groups_scalar(const QuantizeArgs& args, int64_t group_begin, int64_t group_end);
QuantizeResult quantize_groups_avx2(const QuantizeArgs& args, int64_t group_begin, int64_t group_end);
QuantizeResult quantize_groups_avx512(const QuantizeArgs& args, int64_t group_begin, int64_t group_end);

// Dequantizes groups [group_begin, group_end) into args.out.
void dequantize_groups_scalar(const DequantizeArgs& args, int64_t group_begin, int64_t group_end);
void dequantize_groups_avx2(const DequantizeArgs& args, int64_t group_begin, int64_t group_end);
void dequantize_groups_avx512(const DequantizeArgs& args, int64_t group_begin, int64_t group_end);

// ---------------------------------------------------------------------------------------------------------
// Shared per-group pieces. In an unnamed namespace: every translation unit gets its own copy, compiled with
// its own -m flags. As inline functions with external linkage, an out-of-line copy emitted by the AVX-512
// file (dequantize_group_scalar is) could be the one the linker keeps for the scalar path too, which would
// then fault on a CPU without AVX-512.
// ---------------------------------------------------------------------------------------------------------
namespace {

// From this many elements on, the SIMD paths write q (quantize) and the output (dequantize) with
// non-temporal stores: they are far larger than the caches, so the stores would only evict, and skipping
// the read-for-ownership saves a read of every line written.
constexpr int64_t kStreamMinElements = int64_t{1} << 20;

constexpr uint32_t kF32AbsMask = 0x7FFFFFFFu;
constexpr uint32_t kF32ExponentMask = 0x7F800000u;  // |bits| >= this: inf or NaN

// Elements [begin, end) of group g.
struct GroupRange {
  int64_t begin;
  int64_t end;
};

inline GroupRange group_range(int64_t n, int64_t group_size, int64_t g) {
  const int64_t begin = g * group_size;
  return {begin, std::min(n, begin + group_size)};
}

// Where element `index` (the first of its group, so even for bits = 4) starts in q.
inline int64_t q_byte_offset(int bits, int64_t index) { return bits == 8 ? index : index / 2; }

// Bytes of q for `count` elements starting at a group start.
inline int64_t q_bytes(int bits, int64_t count) { return bits == 8 ? count : (count + 1) / 2; }

template <ScalarType kType>
inline float load_as_float(const void* data, int64_t i) {
  if constexpr (kType == ScalarType::kFloat32) {
    return static_cast<const float*>(data)[i];
  } else if constexpr (kType == ScalarType::kBFloat16) {
    return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
  } else {
    return half_to_float(static_cast<const uint16_t*>(data)[i]);
  }
}

// scale = absmax / qmax rounded up to fp32 (absmax finite, as fp32 bits without the sign).
// absmax / qmax is rounded to nearest first; when that landed below the quotient (qmax * s < absmax,
// exact in double: 24 x 7 bits) the next fp32 value up is the rounded-up one. 0 stays 0.
inline float group_scale(uint32_t absmax_bits, int qmax) {
  const float absmax = bits_float(absmax_bits);
  float scale = absmax / static_cast<float>(qmax);
  if (static_cast<double>(scale) * qmax < static_cast<double>(absmax)) scale = bits_float(float_bits(scale) + 1u);
  return scale;
}

// The SIMD kernels' working scale. They compute t = x * (1 / scale), which needs a finite reciprocal and a
// normal scale / 2; a scale below 2^-100 (a group of tiny values) is therefore used as scale * 2^64 with
// every x also multiplied by 2^64. Both products are exact, so the quotients, and q, are unchanged.
struct WorkingScale {
  float prescale;  // 1 or 2^64, multiplies x
  float scale;     // scale * prescale
  float inverse;   // 1 / (scale * prescale), rounded
  float half;      // scale * prescale / 2, exact
};

inline WorkingScale working_scale(float scale) {
  constexpr float kTiny = 7.8886090522101181e-31f;  // 2^-100
  constexpr float kLift = 18446744073709551616.0f;  // 2^64
  const float prescale = scale < kTiny ? kLift : 1.0f;
  const float lifted = scale * prescale;
  return {prescale, lifted, 1.0f / lifted, 0.5f * lifted};
}

// A group holding an inf/NaN: counts them into `result` (element indices are global), and writes scale NaN
// and q = 0 so that nothing downstream can mistake the group for data.
template <ScalarType kType>
void flag_nonfinite_group(const QuantizeArgs& args, int64_t g, GroupRange range, QuantizeResult& result) {
  for (int64_t i = range.begin; i < range.end; ++i) {
    if ((float_bits(load_as_float<kType>(args.input, i)) & kF32AbsMask) >= kF32ExponentMask) {
      if (result.nonfinite_count == 0 || i < result.first_nonfinite) result.first_nonfinite = i;
      ++result.nonfinite_count;
    }
  }
  args.scales[g] = std::numeric_limits<float>::quiet_NaN();
  std::memset(args.q + q_byte_offset(args.bits, range.begin), 0,
              static_cast<size_t>(q_bytes(args.bits, range.end - range.begin)));
}

// Writes scale 0 and q = 0 for an all-zero group.
inline void write_zero_group(const QuantizeArgs& args, int64_t g, GroupRange range) {
  args.scales[g] = 0.0f;
  std::memset(args.q + q_byte_offset(args.bits, range.begin), 0,
              static_cast<size_t>(q_bytes(args.bits, range.end - range.begin)));
}

// q_i of a group's bytes as an int: a sign-extended byte or nibble (i counts from the group's start).
inline int32_t q_value(const uint8_t* q, int bits, int64_t i) {
  if (bits == 8) return static_cast<int8_t>(q[i]);
  const uint32_t byte = q[i / 2];
  const uint32_t nibble = (i & 1) ? byte >> 4 : byte & 0xFu;
  return static_cast<int32_t>(nibble ^ 8u) - 8;
}

// Dequantizes group g element by element: the scalar path for every group, and the SIMD paths for a group
// whose scale is NaN (flagged by quantize). A NaN scale gives the output dtype's canonical quiet NaN
// (0x7FC00000, bf16 0x7FC0, fp16 0x7E00) whatever its payload, on every path and on CUDA.
template <ScalarType kOut>
void dequantize_group_scalar(const DequantizeArgs& args, int64_t g) {
  const GroupRange range = group_range(args.n, args.group_size, g);
  const float scale = args.scales[g];
  const bool is_nan = scale != scale;
  const uint8_t* const q = args.q + q_byte_offset(args.bits, range.begin);
  for (int64_t i = range.begin; i < range.end; ++i) {
    const float value = is_nan ? bits_float(0x7FC00000u)
                               : static_cast<float>(q_value(q, args.bits, i - range.begin)) * scale;
    if constexpr (kOut == ScalarType::kFloat32) {
      static_cast<float*>(args.out)[i] = value;
    } else if constexpr (kOut == ScalarType::kBFloat16) {
      static_cast<uint16_t*>(args.out)[i] = float_to_bf16_rne(value);
    } else {
      static_cast<uint16_t*>(args.out)[i] = float_to_half_rne(value);
    }
  }
}

// The SIMD quantize paths' loop over groups [group_begin, group_end). Each group's max |x| comes from
// absmax(range) (fp32 bits without the sign); a group holding inf/NaN is flagged, an all-zero one written as
// zeros, any other gets its scale and quantize(range, working_scale, stream) writes its q. Before the first
// group, prefetch(address) is called for every 64-byte line of its first prefetch_bytes of input (the
// conversion loops prefetch the rest, that far ahead). stream: q is large enough for non-temporal stores,
// which the caller fences after the call.
template <ScalarType kIn, int kBits, typename AbsMax, typename Prefetch, typename Quantize>
QuantizeResult quantize_group_loop(const QuantizeArgs& args, int64_t group_begin, int64_t group_end, bool stream,
                                   int64_t prefetch_bytes, AbsMax absmax, Prefetch prefetch, Quantize quantize) {
  constexpr int64_t kBytes = kIn == ScalarType::kFloat32 ? 4 : 2;
  QuantizeResult result;
  if (group_begin >= group_end) return result;
  const int64_t first = group_range(args.n, args.group_size, group_begin).begin * kBytes;
  const int64_t first_end = std::min(args.n * kBytes, first + prefetch_bytes);
  for (int64_t at = first; at < first_end; at += 64) prefetch(static_cast<const char*>(args.input) + at);
  for (int64_t g = group_begin; g < group_end; ++g) {
    const GroupRange range = group_range(args.n, args.group_size, g);
    const uint32_t absmax_bits = absmax(range);
    if (absmax_bits >= kF32ExponentMask) {
      flag_nonfinite_group<kIn>(args, g, range, result);
      continue;
    }
    const float scale = group_scale(absmax_bits, kBits == 8 ? 127 : 7);
    if (scale == 0.0f) {
      write_zero_group(args, g, range);
      continue;
    }
    args.scales[g] = scale;
    quantize(range, working_scale(scale), stream);
  }
  return result;
}

// Adds one range's findings into the total (first_nonfinite: the smallest index).
inline void merge_results(QuantizeResult& total, const QuantizeResult& part) {
  if (part.nonfinite_count == 0) return;
  if (total.nonfinite_count == 0 || part.first_nonfinite < total.first_nonfinite) {
    total.first_nonfinite = part.first_nonfinite;
  }
  total.nonfinite_count += part.nonfinite_count;
}

}  // namespace
}  // namespace kernels
}  // namespace zerocore
