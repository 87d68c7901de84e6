// Symmetric blockwise int8 / int4 quantization (ZeRO++'s qwZ/qgZ payloads) on raw CPU spans, SIMD per ISA
// and split over a ThreadPool. The CUDA kernels (zerocore/cuda_quantize.hpp) compute the same bytes.
//
// Note [Quantization arithmetic]
// ------------------------------
// The n inputs (fp32, bf16 or fp16, read exactly as fp32) are cut into groups of group_size elements, the
// last one possibly shorter. With qmax = 127 (bits = 8) or 7 (bits = 4), for every group g:
//
//   absmax   = max |x_i| over the group
//   scale_g  = absmax / qmax, rounded UP to fp32: the smallest fp32 value with qmax * scale_g >= absmax
//   q_i      = round_half_even(x_i / scale_g), the exact real quotient rounded once   (scale_g > 0)
//   q_i      = 0, scale_g = 0                                                         (an all-zero group)
//
// Rounding the scale up (instead of to nearest) keeps every |x_i / scale_g| <= qmax, so q_i never needs a
// clamp and |x_i - q_i * scale_g| <= scale_g / 2 holds exactly for every element, even for groups so small
// that scale_g is an fp32 subnormal (where rounding to nearest can leave qmax * scale short of max |x| by
// more than scale / 2).
//
// The quotient is rounded exactly, so every path writes the same bytes whatever its instructions. The
// scalar path divides in double (x / scale is either a half-integer or at least 2^-25 from one, far more
// than double's error). The SIMD and CUDA kernels round t = x * (1 / scale) (within 2^-16 of the quotient,
// so at most one off) and move it by one where the residual r = x - q * scale, one FMA, says so: r > s/2, or
// r == s/2 with q odd, moves up (mirrored below). r is exact whenever |x| >= s/2; below that the right q is
// 0, and t rounds to 0 (r = x, exact) or to a wrong +-1, which is odd and has a true |r| > s/2 that rounding
// can bring down to s/2 at most: either way q moves to 0. Scales below 2^-100 run with x and scale
// multiplied by 2^64 (exact), so that 1 / scale is finite and s/2 normal.
//
// Dequantization is x'_i = q_i * scale_g computed in fp32 (rounded to nearest even), then rounded to
// nearest even to the output dtype (bf16 / fp16; overflow to inf as in any conversion). So
//   |x_i - x'_i| <= scale_g / 2 + 2^-24 |q_i * scale_g| + 2^-150 + u |x'_i| + t
// with u = 0 for fp32 (2^-8 bf16, 2^-11 fp16) and t = 0 (2^-134, 2^-25: half the dtype's smallest
// subnormal), for every x'_i in the dtype's finite range. An fp32 x' can overflow only when the group's max
// |x| exceeds 2^128 - 2^106 (qmax * scale may pass the largest fp32 value by a few of its ulps).
//
// Storage: bits = 8: one int8 (two's complement) per element, n bytes. bits = 4: two elements per byte,
// element 2k in the low nibble and 2k + 1 in the high nibble, each a two's complement nibble in [-7, 7];
// an odd n leaves the last byte's high nibble 0. group_size must be even for bits = 4 so that every group
// starts on a byte boundary (group g's bytes are [g * group_size / 2, ...)). One fp32 scale per group.
//
// Non-finite inputs are never quantized: a group holding an inf or NaN gets scale NaN and q = 0 (so a
// dequantization of it is NaN, never a plausible number), and the result counts the non-finite elements
// and names the first one. The caller must treat a result with nonfinite_count > 0 as an error.
#pragma once

#include <cstdint>

#include "zerocore/adam_types.hpp"
#include "zerocore/simd.hpp"
#include "zerocore/thread_pool.hpp"

namespace zerocore {

// What quantize_symmetric found in its input.
struct QuantizeResult {
  int64_t nonfinite_count = 0;   // inputs that are inf or NaN (0: every group was quantized)
  int64_t first_nonfinite = -1;  // index of the first of them, -1 when there is none
  bool ok() const { return nonfinite_count == 0; }
};

// The largest |q|: 127 for bits = 8, 7 for bits = 4. Throws InvalidArgument for any other bits.
int quantize_qmax(int bits);
// Bytes of q for n elements: n (bits = 8) or ceil(n / 2) (bits = 4). Validates n >= 0 and bits.
int64_t quantized_bytes(int64_t n, int bits);
// Groups (= scales) for n elements: ceil(n / group_size). Validates n >= 0 and group_size > 0.
int64_t quantize_num_groups(int64_t n, int64_t group_size);

// The size and dtype rules of every quantize / dequantize entry point, these and the CUDA ones
// (zerocore/cuda_quantize.hpp): throws InvalidArgument, each message prefixed with "<caller>: ", unless
// n >= 0, bits is 8 or 4, group_size > 0 (and even for bits = 4) and `type` (named `type_name` in the
// message) is fp32, bf16 or fp16. Pointers are the caller's to check.
void check_quantize_args(const char* caller, int64_t n, int bits, int64_t group_size, ScalarType type,
                         const char* type_name);

// Quantizes input[0, n) of type in_dtype into out_q (quantized_bytes(n, bits) bytes) and out_scales
// (quantize_num_groups(n, group_size) floats); see Note [Quantization arithmetic]. The work is split by
// groups over `pool` (nullptr: the calling thread only) and runs on `path` (by default the active path,
// which tests may force). Throws InvalidArgument for bits not 8 or 4, group_size <= 0, an odd group_size
// with bits = 4, n < 0, a null pointer with n > 0, or an in_dtype that is not fp32/bf16/fp16.
QuantizeResult quantize_symmetric(const void* input, ScalarType in_dtype, int64_t n, int bits, int64_t group_size,
                                  uint8_t* out_q, float* out_scales, ThreadPool* pool = nullptr,
                                  SimdPath path = active_simd_path());

// Writes x'_i = q_i * scale_g (fp32, then rounded to out_dtype) for i in [0, n) straight into `out`, which
// may be any part of a larger buffer (e.g. this rank's slice of a gathered unit): exactly n elements of
// out_dtype are written and nothing else is touched. q and scales are as quantize_symmetric wrote them
// for the same n, bits and group_size. Same validation as quantize_symmetric.
void dequantize_symmetric(const uint8_t* q, const float* scales, int64_t n, int bits, int64_t group_size, void* out,
                          ScalarType out_dtype, ThreadPool* pool = nullptr, SimdPath path = active_simd_path());

}  // namespace zerocore
