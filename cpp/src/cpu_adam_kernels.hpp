// Internal to the CPU Adam: the per-ISA kernels over one chunk [begin, end) of the spans, and the exact
// scalar 16-bit float conversions every path agrees with. Each ISA lives in its own translation unit,
// compiled with that ISA's -m flags; cpu_adam.cpp validates, splits the work and picks one.
#pragma once

#include <cstdint>
#include <cstring>

#include "zerocore/adam_types.hpp"

namespace zerocore {
namespace kernels {

// Per-call constants. torch computes them as Python floats (double) and its CPU kernels round each one
// to fp32 once, so we do the same to reproduce its arithmetic; see Note [Adam arithmetic].
struct Coefficients {
  float grad_scale = 1.0f;
  float decay = 1.0f;                  // AdamW: 1 - lr * weight_decay; L2 mode: 1 (p * 1 is exact)
  bool l2 = false;                     // L2 mode with weight_decay != 0: g += weight_decay * p
  float l2_weight_decay = 0.0f;
  float one_minus_beta1 = 0.1f;        // lerp weight of the first moment
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  // sqrt(1 - beta2^step), 1 without bias correction (x / 1 is exact). Divided by, as torch does: a
  // multiply by the reciprocal would free the divider, but in L2 mode, where p feeds back into the
  // moments, it drifted from torch by up to 1.4x torch's own error; the division matches bit for bit.
  float bias_correction2_sqrt = 1.0f;
  float eps = 1e-8f;
  float neg_step_size = -1e-3f;        // -lr / (1 - beta1^step); -lr without bias correction
  bool stream_param_out = false;       // write param_out with non-temporal stores (huge spans only)
};

// One Adam step over elements [begin, end) of `spans`. Any alignment; any begin <= end <= spans.n.
void adam_chunk_scalar(const AdamSpans& spans, const Coefficients& coef, int64_t begin, int64_t end);
void adam_chunk_avx2(const AdamSpans& spans, const Coefficients& coef, int64_t begin, int64_t end);
void adam_chunk_avx512(const AdamSpans& spans, const Coefficients& coef, int64_t begin, int64_t end);

// True when grad[begin, end) holds no inf/NaN; looks only at the exponent bits, never converts.
bool all_finite_chunk_scalar(const void* grad, ScalarType type, int64_t begin, int64_t end);
bool all_finite_chunk_avx2(const void* grad, ScalarType type, int64_t begin, int64_t end);
bool all_finite_chunk_avx512(const void* grad, ScalarType type, int64_t begin, int64_t end);

// ---------------------------------------------------------------------------------------------------------
// Exact scalar conversions (also used for the scalar path's every element).
// ---------------------------------------------------------------------------------------------------------

inline uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline float bf16_to_float(uint16_t bits) { return bits_float(static_cast<uint32_t>(bits) << 16); }

// Round to nearest even exactly like torch's c10::BFloat16 (NaN becomes the quiet NaN 0x7FC0).
inline uint16_t float_to_bf16_rne(float value) {
  const uint32_t bits = float_bits(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

inline float half_to_float(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1Fu;
  const uint32_t mantissa = half & 0x3FFu;
  if (exponent == 0x1F) {  // inf, or NaN made quiet as vcvtph2ps does
    return bits_float(sign | 0x7F800000u | (mantissa << 13) | (mantissa != 0 ? 0x400000u : 0u));
  }
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24, exact in fp32.
  return bits_float(sign | float_bits(static_cast<float>(mantissa) * 5.9604644775390625e-8f));
}

// Round to nearest even, as vcvtps2ph with _MM_FROUND_TO_NEAREST_INT does: subnormal results, overflow
// to inf, and NaN kept as a quiet NaN with its sign and top payload bits.
inline uint16_t float_to_half_rne(float value) {
  const uint32_t bits = float_bits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((magnitude >> 13) & 0x3FFu));
  // 65520 = 0x477FF000 is halfway between 65504 (odd mantissa) and 2^16, so it and above round to inf.
  if (magnitude >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);
  if (magnitude >= 0x38800000u) {  // normal half: re-bias the exponent, round the 13 dropped bits
    const uint32_t rebiased = magnitude - 0x38000000u;
    return static_cast<uint16_t>(sign | ((rebiased + 0xFFFu + ((rebiased >> 13) & 1u)) >> 13));
  }
  // Below 2^-14: a half subnormal, in units of 2^-24. At most 2^-25 rounds to zero (2^-25 is a tie to 0).
  if (magnitude <= 0x33000000u) return sign;
  const uint32_t exponent = magnitude >> 23;  // 102..112 here
  const uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - exponent;     // 14..24
  uint32_t result = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;  // may carry into 0x400
  return static_cast<uint16_t>(sign | result);
}

}  // namespace kernels
}  // namespace zerocore
