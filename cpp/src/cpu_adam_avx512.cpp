// The AVX-512 Adam kernel, 16 floats a vector; compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq
// -mfma -mf16c and run only when the CPU has them. No avx512bf16 instructions: not every AVX-512 CPU has
// them, and the integer rounding below is exactly torch's anyway. The tail is one masked iteration, so
// any length and alignment work without a scalar loop.

// GCC 12 reports its own _mm512_undefined_*() placeholders as maybe-uninitialized (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include <algorithm>
#include <cstdint>

#include "cpu_adam_kernels.hpp"

namespace zerocore {
namespace kernels {
namespace {

enum class OutKind { kNone, kBFloat16, kFloat16 };
constexpr int64_t kLanes = 16;

template <ScalarType kGrad>
inline __m512 load_grad(const void* grad, int64_t i, __mmask16 mask) {
  if constexpr (kGrad == ScalarType::kFloat32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(grad) + i);
  } else {
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(grad) + i);
    if constexpr (kGrad == ScalarType::kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    } else {
      return _mm512_cvtph_ps(bits);
    }
  }
}

// torch's round-to-nearest-even in integers, (bits + 0x7FFF + lsb) >> 16 with NaN -> 0x7FC0, taking the
// high 16-bit word of each lane with one vpermw (cheaper than a shift and vpmovdw, slow on AMD).
inline __m256i float_to_bf16(__m512 value) {
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
  rounded = _mm512_mask_blend_epi32(is_nan, rounded, _mm512_set1_epi32(0x7FC00000));
  const __m512i high_words = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
                                              31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi16(high_words, rounded));
}

template <OutKind kOut>
inline __m256i to_param_out(__m512 param) {
  if constexpr (kOut == OutKind::kBFloat16) return float_to_bf16(param);
  return _mm512_cvtps_ph(param, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

template <ScalarType kGrad, OutKind kOut, bool kL2>
void adam_chunk(const AdamSpans& spans, const Coefficients& coef, int64_t begin, int64_t end) {
  float* const param = spans.param;
  float* const exp_avg = spans.exp_avg;
  float* const exp_avg_sq = spans.exp_avg_sq;
  uint16_t* const param_out = static_cast<uint16_t*>(spans.param_out);
  const void* const grad = spans.grad;
  const __m512 grad_scale = _mm512_set1_ps(coef.grad_scale);
  const __m512 decay = _mm512_set1_ps(coef.decay);
  const __m512 l2_weight_decay = _mm512_set1_ps(coef.l2_weight_decay);
  const __m512 one_minus_beta1 = _mm512_set1_ps(coef.one_minus_beta1);
  const __m512 beta2 = _mm512_set1_ps(coef.beta2);
  const __m512 one_minus_beta2 = _mm512_set1_ps(coef.one_minus_beta2);
  const __m512 bias_correction2_sqrt = _mm512_set1_ps(coef.bias_correction2_sqrt);
  const __m512 eps = _mm512_set1_ps(coef.eps);
  const __m512 neg_step_size = _mm512_set1_ps(coef.neg_step_size);

  // Updates param, exp_avg and exp_avg_sq at [i, i + 16) under `mask` and returns the new params.
  // Masked loads never fault on the lanes they skip, so the tail reuses the body with a partial mask.
  auto update = [&](int64_t i, __mmask16 mask) {
    __m512 g = _mm512_mul_ps(load_grad<kGrad>(grad, i, mask), grad_scale);
    __m512 p = _mm512_maskz_loadu_ps(mask, param + i);
    if constexpr (kL2) g = _mm512_fmadd_ps(l2_weight_decay, p, g);  // grad.add(param, alpha=wd)
    __m512 m = _mm512_maskz_loadu_ps(mask, exp_avg + i);
    m = _mm512_fmadd_ps(one_minus_beta1, _mm512_sub_ps(g, m), m);   // lerp_(grad, w), w < 0.5 form
    __m512 v = _mm512_maskz_loadu_ps(mask, exp_avg_sq + i);
    v = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, g), g, _mm512_mul_ps(v, beta2));  // mul_, addcmul_
    // exp_avg_sq.sqrt() / sqrt(bc2) + eps, divided as torch does
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bias_correction2_sqrt), eps);
    const __m512 step = _mm512_div_ps(_mm512_mul_ps(neg_step_size, m), denom);  // addcdiv_(m, denom, -lr/bc1)
    // param.mul_(1 - lr * wd) fused into the update: one rounding fewer than torch, and explicit, so the
    // compiler's own contraction cannot make the AVX2 and AVX-512 results differ.
    p = _mm512_fmadd_ps(p, decay, step);
    _mm512_mask_storeu_ps(param + i, mask, p);
    _mm512_mask_storeu_ps(exp_avg + i, mask, m);
    _mm512_mask_storeu_ps(exp_avg_sq + i, mask, v);
    return p;
  };
  auto update_and_store = [&](int64_t i, __mmask16 mask) {
    const __m512 p = update(i, mask);
    if constexpr (kOut != OutKind::kNone) _mm256_mask_storeu_epi16(param_out + i, mask, to_param_out<kOut>(p));
  };

  int64_t i = begin;
  if constexpr (kOut != OutKind::kNone) {
    // param_out is the only stream written without being read: non-temporal stores skip its
    // read-for-ownership. They need 32-byte aligned addresses, so a masked head reaches one first.
    const auto address = reinterpret_cast<uintptr_t>(param_out + i);
    if (coef.stream_param_out && address % 2 == 0) {
      const int64_t head = std::min<int64_t>(end - i, static_cast<int64_t>((32 - address % 32) % 32 / 2));
      if (head > 0) update_and_store(i, static_cast<__mmask16>((1u << head) - 1u));
      for (i += head; i + kLanes <= end; i += kLanes) {
        const __m512 p = update(i, static_cast<__mmask16>(0xFFFF));
        _mm256_stream_si256(reinterpret_cast<__m256i*>(param_out + i), to_param_out<kOut>(p));
      }
      _mm_sfence();  // order the weakly-ordered stores before whatever the caller does next
    }
  }
  for (; i + kLanes <= end; i += kLanes) update_and_store(i, static_cast<__mmask16>(0xFFFF));
  if (i < end) update_and_store(i, static_cast<__mmask16>((1u << (end - i)) - 1u));
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

// Non-finite means all exponent bits set, i.e. |bits| >= the exponent mask: an unsigned max over each
// block, compared once per block (the early exit). 64 bytes per load whatever the type; the last partial
// vector is a masked load, which never faults on the lanes it skips.
template <bool kWide>
bool all_finite_bits(const void* data, uint32_t exponent_mask, int64_t begin, int64_t end) {
  constexpr int64_t kElementBytes = kWide ? 4 : 2;
  constexpr int64_t kPerVector = 64 / kElementBytes;
  constexpr int64_t kBlock = 4096;
  const char* const base = static_cast<const char*>(data);
  const __m512i abs_mask = kWide ? _mm512_set1_epi32(0x7FFFFFFF) : _mm512_set1_epi16(0x7FFF);
  auto max_magnitude = [&](__m512i largest, __m512i bits) {
    const __m512i magnitude = _mm512_and_si512(bits, abs_mask);
    return kWide ? _mm512_max_epu32(largest, magnitude) : _mm512_max_epu16(largest, magnitude);
  };
  auto load_partial = [&](int64_t i, int64_t count) {
    const void* at = base + i * kElementBytes;
    if constexpr (kWide) return _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << count) - 1u), at);
    return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t{1} << count) - 1u), at);
  };
  auto reaches = [&](__m512i largest) {
    if constexpr (kWide) return _mm512_cmpge_epu32_mask(largest, _mm512_set1_epi32(exponent_mask)) != 0;
    return _mm512_cmpge_epu16_mask(largest, _mm512_set1_epi16(static_cast<int16_t>(exponent_mask))) != 0;
  };
  for (int64_t block = begin; block < end; block += kBlock) {
    const int64_t block_end = std::min(end, block + kBlock);
    __m512i largest = _mm512_setzero_si512();
    int64_t i = block;
    for (; i + kPerVector <= block_end; i += kPerVector) {
      largest = max_magnitude(largest, _mm512_loadu_si512(base + i * kElementBytes));
    }
    if (i < block_end) largest = max_magnitude(largest, load_partial(i, block_end - i));
    if (reaches(largest)) return false;
  }
  return true;
}

}  // namespace

void adam_chunk_avx512(const AdamSpans& spans, const Coefficients& coef, int64_t begin, int64_t end) {
  switch (spans.grad_type) {
    case ScalarType::kFloat32: return adam_chunk_out<ScalarType::kFloat32>(spans, coef, begin, end);
    case ScalarType::kBFloat16: return adam_chunk_out<ScalarType::kBFloat16>(spans, coef, begin, end);
    case ScalarType::kFloat16: return adam_chunk_out<ScalarType::kFloat16>(spans, coef, begin, end);
  }
}

bool all_finite_chunk_avx512(const void* grad, ScalarType type, int64_t begin, int64_t end) {
  switch (type) {
    case ScalarType::kFloat32: return all_finite_bits<true>(grad, 0x7F800000u, begin, end);
    case ScalarType::kBFloat16: return all_finite_bits<false>(grad, 0x7F80u, begin, end);
    case ScalarType::kFloat16: return all_finite_bits<false>(grad, 0x7C00u, begin, end);
  }
  return true;
}

}  // namespace kernels
}  // namespace zerocore
