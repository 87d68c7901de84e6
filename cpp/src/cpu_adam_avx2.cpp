// The AVX2 Adam kernel, 8 floats a vector; compiled with -mavx2 -mfma -mf16c and run only when the CPU has
// them. AVX2 has no masked 16-bit loads, so the tail (< 8 elements) goes through small stack buffers and
// the same vector code, which keeps every element's arithmetic identical to the body's.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_adam_kernels.hpp"

namespace zerocore {
namespace kernels {
namespace {

enum class OutKind { kNone, kBFloat16, kFloat16 };
constexpr int64_t kLanes = 8;

template <ScalarType kGrad>
constexpr int64_t grad_bytes() {
  return kGrad == ScalarType::kFloat32 ? 4 : 2;
}

template <ScalarType kGrad>
inline __m256 load_grad(const void* grad) {
  if constexpr (kGrad == ScalarType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad));
  } else {
    const __m128i bits = _mm_loadu_si128(static_cast<const __m128i*>(grad));
    if constexpr (kGrad == ScalarType::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    } else {
      return _mm256_cvtph_ps(bits);
    }
  }
}

// torch's round-to-nearest-even in integers, (bits + 0x7FFF + lsb) >> 16 with NaN -> 0x7FC0; a byte
// shuffle gathers the high 16-bit word of each lane (cheaper than a shift, extract and pack).
inline __m128i float_to_bf16(__m256 value) {
  const __m256i bits = _mm256_castps_si256(value);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), is_nan);
  const __m256i high_words = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                              2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(rounded, high_words), 0x08);
  return _mm256_castsi256_si128(packed);
}

template <OutKind kOut>
inline __m128i to_param_out(__m256 param) {
  if constexpr (kOut == OutKind::kBFloat16) return float_to_bf16(param);
  return _mm256_cvtps_ph(param, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

template <ScalarType kGrad, bool kL2>
struct AdamAvx2 {
  __m256 grad_scale, decay, l2_weight_decay, one_minus_beta1, beta2, one_minus_beta2;
  __m256 bias_correction2_sqrt, eps, neg_step_size;

  explicit AdamAvx2(const Coefficients& c)
      : grad_scale(_mm256_set1_ps(c.grad_scale)),
        decay(_mm256_set1_ps(c.decay)),
        l2_weight_decay(_mm256_set1_ps(c.l2_weight_decay)),
        one_minus_beta1(_mm256_set1_ps(c.one_minus_beta1)),
        beta2(_mm256_set1_ps(c.beta2)),
        one_minus_beta2(_mm256_set1_ps(c.one_minus_beta2)),
        bias_correction2_sqrt(_mm256_set1_ps(c.bias_correction2_sqrt)),
        eps(_mm256_set1_ps(c.eps)),
        neg_step_size(_mm256_set1_ps(c.neg_step_size)) {}

  // Updates the 8 elements at these addresses and returns the new params.
  inline __m256 update(const void* grad, float* param, float* exp_avg, float* exp_avg_sq) const {
    __m256 g = _mm256_mul_ps(load_grad<kGrad>(grad), grad_scale);
    __m256 p = _mm256_loadu_ps(param);
    if constexpr (kL2) g = _mm256_fmadd_ps(l2_weight_decay, p, g);  // grad.add(param, alpha=wd)
    __m256 m = _mm256_loadu_ps(exp_avg);
    m = _mm256_fmadd_ps(one_minus_beta1, _mm256_sub_ps(g, m), m);   // lerp_(grad, w), w < 0.5 form
    __m256 v = _mm256_loadu_ps(exp_avg_sq);
    v = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2, g), g, _mm256_mul_ps(v, beta2));  // mul_, addcmul_
    // exp_avg_sq.sqrt() / sqrt(bc2) + eps, divided as torch does
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bias_correction2_sqrt), eps);
    const __m256 step = _mm256_div_ps(_mm256_mul_ps(neg_step_size, m), denom);  // addcdiv_(m, denom, -lr/bc1)
    // param.mul_(1 - lr * wd) fused into the update: one rounding fewer than torch, and explicit, so the
    // compiler's own contraction cannot make the AVX2 and AVX-512 results differ.
    p = _mm256_fmadd_ps(p, decay, step);
    _mm256_storeu_ps(param, p);
    _mm256_storeu_ps(exp_avg, m);
    _mm256_storeu_ps(exp_avg_sq, v);
    return p;
  }
};

template <ScalarType kGrad, OutKind kOut, bool kL2>
void adam_chunk(const AdamSpans& spans, const Coefficients& coef, int64_t begin, int64_t end) {
  const AdamAvx2<kGrad, kL2> kernel(coef);
  constexpr int64_t kGradBytes = grad_bytes<kGrad>();
  // Local copies: stores through float* could otherwise alias `spans` and force reloads every iteration.
  const char* const grad = static_cast<const char*>(spans.grad);
  float* const param = spans.param;
  float* const exp_avg = spans.exp_avg;
  float* const exp_avg_sq = spans.exp_avg_sq;
  uint16_t* const param_out = static_cast<uint16_t*>(spans.param_out);
  auto update_and_store = [&](int64_t i) {
    const __m256 p = kernel.update(grad + i * kGradBytes, param + i, exp_avg + i, exp_avg_sq + i);
    if constexpr (kOut != OutKind::kNone) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(param_out + i), to_param_out<kOut>(p));
    }
  };
  // Fewer than 8 elements run the same vector code on stack copies: AVX2 has no masked 16-bit loads.
  auto update_and_store_partial = [&](int64_t i, int64_t count) {
    alignas(32) char grad_part[kLanes * 4] = {};
    alignas(32) float param_part[kLanes] = {}, exp_avg_part[kLanes] = {}, exp_avg_sq_part[kLanes] = {};
    std::memcpy(grad_part, grad + i * kGradBytes, count * kGradBytes);
    std::memcpy(param_part, param + i, count * sizeof(float));
    std::memcpy(exp_avg_part, exp_avg + i, count * sizeof(float));
    std::memcpy(exp_avg_sq_part, exp_avg_sq + i, count * sizeof(float));
    const __m256 p = kernel.update(grad_part, param_part, exp_avg_part, exp_avg_sq_part);
    std::memcpy(param + i, param_part, count * sizeof(float));
    std::memcpy(exp_avg + i, exp_avg_part, count * sizeof(float));
    std::memcpy(exp_avg_sq + i, exp_avg_sq_part, count * sizeof(float));
    if constexpr (kOut != OutKind::kNone) {
      alignas(16) uint16_t out_part[kLanes];
      _mm_store_si128(reinterpret_cast<__m128i*>(out_part), to_param_out<kOut>(p));
      std::memcpy(param_out + i, out_part, count * sizeof(uint16_t));
    }
  };

  int64_t i = begin;
  if constexpr (kOut != OutKind::kNone) {
    // param_out is the only stream written without being read: non-temporal stores skip its
    // read-for-ownership. They need 16-byte aligned addresses, so a partial head reaches one first.
    const auto address = reinterpret_cast<uintptr_t>(param_out + i);
    if (coef.stream_param_out && address % 2 == 0) {
      const int64_t head = std::min<int64_t>(end - i, static_cast<int64_t>((16 - address % 16) % 16 / 2));
      if (head > 0) update_and_store_partial(i, head);
      for (i += head; i + kLanes <= end; i += kLanes) {
        const __m256 p = kernel.update(grad + i * kGradBytes, param + i, exp_avg + i, exp_avg_sq + i);
        _mm_stream_si128(reinterpret_cast<__m128i*>(param_out + i), to_param_out<kOut>(p));
      }
      _mm_sfence();  // order the weakly-ordered stores before whatever the caller does next
    }
  }
  for (; i + kLanes <= end; i += kLanes) update_and_store(i);
  if (i < end) update_and_store_partial(i, end - i);
}

template <ScalarType kGrad, OutKind kOut>
void adam_chunk_mode(const AdamSpans& spans, const Coefficients& coef, int64_t begin, int64_t end) {
  if (coef.l2) {
    adam_chunk<kGrad, kOut, true>(spans, coef, begin, end);
  } else {
    adam_chunk<kGrad, kOut, false>(spans, coef, begin, end);
  }
}

template <ScalarType kGrad>
void adam_chunk_out(const AdamSpans& spans, const Coefficients& coef, int64_t begin, int64_t end) {
  if (spans.param_out == nullptr) {
    adam_chunk_mode<kGrad, OutKind::kNone>(spans, coef, begin, end);
  } else if (spans.param_out_type == ScalarType::kFloat16) {
    adam_chunk_mode<kGrad, OutKind::kFloat16>(spans, coef, begin, end);
  } else {
    adam_chunk_mode<kGrad, OutKind::kBFloat16>(spans, coef, begin, end);
  }
}

// Non-finite means all exponent bits set, i.e. |bits| >= the exponent mask: an unsigned max per block,
// tested once per block (the early exit); the last partial vector is checked element by element.
template <typename Bits>
bool all_finite_bits(const Bits* data, Bits exponent_mask, int64_t begin, int64_t end) {
  constexpr bool kWide = sizeof(Bits) == 4;
  constexpr int64_t kPerVector = 32 / sizeof(Bits);
  constexpr int64_t kBlock = 4096;
  const __m256i abs_mask = kWide ? _mm256_set1_epi32(0x7FFFFFFF) : _mm256_set1_epi16(0x7FFF);
  const __m256i threshold = kWide ? _mm256_set1_epi32(static_cast<int32_t>(exponent_mask))
                                  : _mm256_set1_epi16(static_cast<int16_t>(exponent_mask));
  const int64_t vector_end = begin + (end - begin) / kPerVector * kPerVector;
  for (int64_t block = begin; block < vector_end; block += kBlock) {
    const int64_t block_end = block + kBlock < vector_end ? block + kBlock : vector_end;
    __m256i largest = _mm256_setzero_si256();
    for (int64_t i = block; i < block_end; i += kPerVector) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + i));
      const __m256i magnitude = _mm256_and_si256(bits, abs_mask);
      largest = kWide ? _mm256_max_epu32(largest, magnitude) : _mm256_max_epu16(largest, magnitude);
    }
    // largest >= threshold exactly when max(largest, threshold) == largest in some lane.
    const __m256i top = kWide ? _mm256_max_epu32(largest, threshold) : _mm256_max_epu16(largest, threshold);
    const __m256i reached = kWide ? _mm256_cmpeq_epi32(top, largest) : _mm256_cmpeq_epi16(top, largest);
    if (_mm256_movemask_epi8(reached) != 0) return false;
  }
  for (int64_t i = vector_end; i < end; ++i) {
    if ((data[i] & exponent_mask) == exponent_mask) return false;
  }
  return true;
}

}  // namespace

void adam_chunk_avx2(const AdamSpans& spans, const Coefficients& coef, int64_t begin, int64_t end) {
  switch (spans.grad_type) {
    case ScalarType::kFloat32: return adam_chunk_out<ScalarType::kFloat32>(spans, coef, begin, end);
    case ScalarType::kBFloat16: return adam_chunk_out<ScalarType::kBFloat16>(spans, coef, begin, end);
    case ScalarType::kFloat16: return adam_chunk_out<ScalarType::kFloat16>(spans, coef, begin, end);
  }
}

bool all_finite_chunk_avx2(const void* grad, ScalarType type, int64_t begin, int64_t end) {
  switch (type) {
    case ScalarType::kFloat32:
      return all_finite_bits<uint32_t>(static_cast<const uint32_t*>(grad), 0x7F800000u, begin, end);
    case ScalarType::kBFloat16:
      return all_finite_bits<uint16_t>(static_cast<const uint16_t*>(grad), 0x7F80u, begin, end);
    case ScalarType::kFloat16:
      return all_finite_bits<uint16_t>(static_cast<const uint16_t*>(grad), 0x7C00u, begin, end);
  }
  return true;
}

}  // namespace kernels
}  // namespace zerocore
