// The AVX-512 quantization kernels, 16 elements a vector; compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512dq -mfma -mf16c and run only when the CPU has them. Tails are masked iterations of the body, so
// any group size and alignment work without a scalar loop. The rounding of x / scale is exact (Note
// [Quantization arithmetic]): x * (1 / scale) is rounded half to even (by adding 1.5 * 2^23 in the same FMA),
// then moved by one where the residual r = x - q * scale (one FMA) says the rounded reciprocal put it on the
// wrong side of a half.

// GCC 12 reports its own _mm512_undefined_*() placeholders as (maybe-)uninitialized wherever intrinsics such
// as _mm512_max_epu32 are inlined (GCC bug 105593), so for this whole file.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "quantize_kernels.hpp"

namespace zerocore {
namespace kernels {
namespace {

constexpr int64_t kLanes = 16;

inline __mmask16 lanes_mask(int64_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

template <ScalarType kIn>
inline __m512 load_in(const void* data, int64_t i, __mmask16 mask) {
  if constexpr (kIn == ScalarType::kFloat32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(data) + i);
  } else {
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(data) + i);
    if constexpr (kIn == ScalarType::kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    } else {
      return _mm512_cvtph_ps(bits);
    }
  }
}

// max |x| over the group as fp32 bits without the sign: compared as integers, so inf and NaN sort above
// every finite value. 16-bit inputs are compared in their own format (32 per vector, no conversion; both
// formats order their magnitudes like integers) and only the maximum is widened.
template <ScalarType kIn>
uint32_t group_absmax_bits(const void* input, GroupRange range) {
  if constexpr (kIn == ScalarType::kFloat32) {
    const float* const x = static_cast<const float*>(input);
    const __m512i abs_mask = _mm512_set1_epi32(static_cast<int>(kF32AbsMask));
    __m512i m0 = _mm512_setzero_si512();
    __m512i m1 = _mm512_setzero_si512();
    int64_t i = range.begin;
    for (; i + 2 * kLanes <= range.end; i += 2 * kLanes) {
      m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_loadu_si512(x + i), abs_mask));
      m1 = _mm512_max_epu32(m1, _mm512_and_si512(_mm512_loadu_si512(x + i + kLanes), abs_mask));
    }
    for (; i < range.end; i += kLanes) {
      m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_maskz_loadu_epi32(lanes_mask(range.end - i), x + i), abs_mask));
    }
    return _mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1));
  } else {
    constexpr int64_t kHalves = 32;
    const uint16_t* const x = static_cast<const uint16_t*>(input);
    const __m512i abs_mask = _mm512_set1_epi16(0x7FFF);
    __m512i m0 = _mm512_setzero_si512();
    __m512i m1 = _mm512_setzero_si512();
    int64_t i = range.begin;
    for (; i + 2 * kHalves <= range.end; i += 2 * kHalves) {
      m0 = _mm512_max_epu16(m0, _mm512_and_si512(_mm512_loadu_si512(x + i), abs_mask));
      m1 = _mm512_max_epu16(m1, _mm512_and_si512(_mm512_loadu_si512(x + i + kHalves), abs_mask));
    }
    for (; i < range.end; i += kHalves) {
      const int64_t count = range.end - i;
      const __mmask32 mask = count >= kHalves ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << count) - 1u);
      m0 = _mm512_max_epu16(m0, _mm512_and_si512(_mm512_maskz_loadu_epi16(mask, x + i), abs_mask));
    }
    m0 = _mm512_max_epu16(m0, m1);
    __m256i m = _mm256_max_epu16(_mm512_castsi512_si256(m0), _mm512_extracti64x4_epi64(m0, 1));
    __m128i h = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epu16(h, _mm_srli_si128(h, 8));
    h = _mm_max_epu16(h, _mm_srli_si128(h, 4));
    h = _mm_max_epu16(h, _mm_srli_si128(h, 2));
    const auto largest = static_cast<uint16_t>(_mm_cvtsi128_si32(h));
    return float_bits(kIn == ScalarType::kBFloat16 ? bf16_to_float(largest) : half_to_float(largest));
  }
}

// round_half_even(x / scale), exactly, for a group's scale (see the file comment). kLift: the group's scale
// is tiny and runs lifted by 2^64 (WorkingScale).
//
// The guess is t = xs * (1 / scale) + 1.5 * 2^23 in one FMA: fp32's spacing there is 1, so the sum is the
// product (exact in the FMA, within 2^-17 of the quotient for |q| <= 127) rounded half to even to an integer,
// at most one off as the Note requires, and it leaves q in the low mantissa bits (the bits of t are
// 0x4B400000 + q): q's low byte or nibble is there as it is, q as an int32 is one subtraction away, and q as
// a float one subtraction too (t - 1.5 * 2^23, exact). cvtps2dq and cvtdq2ps, which did this before, run only
// on one of the two 512-bit ports; these run on either. The sum rounds in the caller's MXCSR mode, not an
// embedded one: a directed mode leaves the guess within one too, which the correction fixes as any other.
template <bool kLift>
struct Rounder {
  __m512 prescale, scale, inverse, half, neg_half, magic;

  explicit Rounder(const WorkingScale& w)
      : prescale(_mm512_set1_ps(w.prescale)),
        scale(_mm512_set1_ps(w.scale)),
        inverse(_mm512_set1_ps(w.inverse)),
        half(_mm512_set1_ps(w.half)),
        neg_half(_mm512_set1_ps(-w.half)),
        magic(_mm512_set1_ps(kMagic)) {}

  static constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  static constexpr int kMagicBits = 0x4B400000;

  // The guess's bits, and r = xs - q * scale: exact, or rounded where that cannot change the decision (Note
  // [Quantization arithmetic]).
  inline __m512i guess(__m512 x, __m512* r) const {
    const __m512 xs = kLift ? _mm512_mul_ps(x, prescale) : x;
    const __m512 t = _mm512_fmadd_ps(xs, inverse, magic);
    *r = _mm512_fnmadd_ps(_mm512_sub_ps(t, magic), scale, xs);
    return _mm512_castps_si512(t);
  }

  // q + 1 where r > scale / 2 or r == scale / 2 with q odd; q - 1 where r < -scale / 2 or r == -scale / 2
  // with q odd (the even neighbour wins a tie). On the guess's bits: 1.5 * 2^23 is even, so bit 0 is q's
  // parity, and +-1 stays inside the mantissa.
  inline __m512i correct(__m512i bits, __m512 r) const {
    const __mmask16 odd = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(1));
    const __mmask16 up = _mm512_cmp_ps_mask(r, half, _CMP_GT_OQ) | (_mm512_cmp_ps_mask(r, half, _CMP_EQ_OQ) & odd);
    const __mmask16 down =
        _mm512_cmp_ps_mask(r, neg_half, _CMP_LT_OQ) | (_mm512_cmp_ps_mask(r, neg_half, _CMP_EQ_OQ) & odd);
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i raised = _mm512_mask_add_epi32(bits, up, bits, one);
    return _mm512_mask_sub_epi32(raised, down, raised, one);
  }

  // q of a guess's bits as int32.
  static inline __m512i to_int(__m512i bits) { return _mm512_sub_epi32(bits, _mm512_set1_epi32(kMagicBits)); }

  // One vector's q as int32 (the tails).
  inline __m512i quantize(__m512 x) const {
    __m512 r;
    const __m512i bits = guess(x, &r);
    // |r| < scale / 2: q is right (nearly always). Otherwise fix the lanes past or on a half.
    if (_mm512_cmp_ps_mask(_mm512_abs_ps(r), half, _CMP_GE_OQ) == 0) return to_int(bits);
    return to_int(correct(bits, r));
  }

  // K vectors' guesses as bits, corrected: one test for all of them, on the largest |r| (vrangeps with imm
  // 0xB: the operand of larger magnitude, sign cleared), instead of an abs, a compare and a mask test each.
  // K = 4: eight at once, with their r and q, would not fit in the 32 registers (GCC spilled them).
  template <int K>
  inline void quantize_n(const __m512 (&x)[K], __m512i (&bits)[K]) const {
    static_assert(K == 2 || K == 4, "a range tree over K / 2 pairs");
    __m512 r[K];
    for (int k = 0; k < K; ++k) bits[k] = guess(x[k], &r[k]);
    __m512 largest[K / 2];
    for (int k = 0; k < K / 2; ++k) largest[k] = _mm512_range_ps(r[2 * k], r[2 * k + 1], 0xB);
    for (int width = K / 2; width > 1; width /= 2) {
      for (int k = 0; k < width / 2; ++k) largest[k] = _mm512_range_ps(largest[2 * k], largest[2 * k + 1], 0xB);
    }
    if (__builtin_expect(_mm512_cmp_ps_mask(largest[0], half, _CMP_GE_OQ) == 0, 1)) return;
    for (int k = 0; k < K; ++k) bits[k] = correct(bits[k], r[k]);
  }
};

// Stores 16 (or `count`) q values: int8 bytes, or int4 pairs packed low nibble first.
template <int kBits>
inline void store_q(uint8_t* out, __m512i q, int64_t count) {
  if constexpr (kBits == 8) {
    _mm512_mask_cvtepi32_storeu_epi8(out, lanes_mask(count), q);
  } else {
    // Each 64-bit lane holds (q_even, q_odd): shifting the lane right by 28 puts q_odd's nibble at bits 4-7.
    const __m512i nibbles = _mm512_and_si512(q, _mm512_set1_epi32(0xF));
    const __m512i packed = _mm512_or_si512(nibbles, _mm512_srli_epi64(nibbles, 28));
    const int64_t bytes = (count + 1) / 2;
    const __mmask8 mask = bytes >= 8 ? static_cast<__mmask8>(0xFF) : static_cast<__mmask8>((1u << bytes) - 1u);
    _mm512_mask_cvtepi64_storeu_epi8(out, mask, packed);
  }
}

// A block: the elements whose q fill one 64-byte vector (64 int8 values, 128 int4 values).
template <int kBits>
constexpr int64_t kBlockElements = kBits == 8 ? 64 : 128;

// q of 16 * K elements from 16 to a vector (fp32, fp16) as guess bits (Rounder).
template <ScalarType kIn, int K, typename R>
inline void q_vectors(const void* input, int64_t i, const R& rounder, __m512i (&bits)[K]) {
  __m512 x[K];
  for (int k = 0; k < K; ++k) x[k] = load_in<kIn>(input, i + k * kLanes, 0xFFFF);
  rounder.template quantize_n<K>(x, bits);
}

// Four vectors of q (from bits[at]) as signed bytes, not yet in order: per 128-bit lane k, elements 4k..4k+3
// of each vector in turn (four shuffle-unit instructions for the four vectors, where vpmovdb would take two
// each; exact: |q| <= 127).
template <typename R, int K>
inline __m512i pack4_lane_order(const __m512i (&bits)[K], int at) {
  return _mm512_packs_epi16(_mm512_packs_epi32(R::to_int(bits[at]), R::to_int(bits[at + 1])),
                            _mm512_packs_epi32(R::to_int(bits[at + 2]), R::to_int(bits[at + 3])));
}

// q of 32 * P bf16 elements as one int32 per pair of elements (2j, 2j + 1): bits 0-7 (int8) or 0-3 (int4)
// q_2j, above them q_2j+1 sign-extended, so the int32 is the q byte pair (int8: an int16) or the packed byte
// (int4: an int8 in [-112, 127]) and a signed pack keeps it exact. bf16 widens to fp32 as the even elements
// shifted up by 16 and the odd ones with the low 16 bits cleared: no shuffle (an unpack, or a zero-extend,
// puts every element through the one shuffle port), and q comes out in pairs, as the output wants it.
template <int kBits, int P, typename R>
inline void q_pairs_bf16(const void* input, int64_t i, const R& rounder, __m512i (&pairs)[P]) {
  const uint16_t* const x = static_cast<const uint16_t*>(input) + i;
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 values[2 * P];
  for (int p = 0; p < P; ++p) {
    const __m512i raw = _mm512_loadu_si512(x + p * 2 * kLanes);
    values[2 * p] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    values[2 * p + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, odd_mask));
  }
  __m512i bits[2 * P];
  rounder.template quantize_n<2 * P>(values, bits);
  // The even element's guess bits below (its low byte / nibble is q's), the odd one's q shifted above them:
  // a bitwise select (vpternlog 0xE4: mask ? first : second).
  constexpr int kShift = kBits == 8 ? 8 : 4;
  const __m512i keep = _mm512_set1_epi32(kBits == 8 ? 0xFF : 0xF);
  for (int p = 0; p < P; ++p) {
    pairs[p] = _mm512_ternarylogic_epi32(bits[2 * p], _mm512_slli_epi32(R::to_int(bits[2 * p + 1]), kShift), keep,
                                         0xE4);
  }
}

// One block's 64 bytes of q, in order.
template <ScalarType kIn, int kBits, typename R>
inline __m512i quantize_block(const void* input, int64_t i, const R& rounder) {
  // dword m of the result from dword 4 * (m % 4) + m / 4: undoes the lane order of four vectors packed to bytes
  const __m512i dword_order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  if constexpr (kIn == ScalarType::kBFloat16) {
    if constexpr (kBits == 8) {
      // Lane k of the pack: pairs 4k..4k+3 of the first 32 elements, then of the second: qword 2k and 2k + 1.
      __m512i p[2];
      q_pairs_bf16<8>(input, i, rounder, p);
      return _mm512_permutexvar_epi64(_mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0), _mm512_packs_epi32(p[0], p[1]));
    } else {
      // Two halves of four vectors each: eight at once (x, r and q for each) would not fit in the 32 registers.
      __m512i low[2], high[2];
      q_pairs_bf16<4>(input, i, rounder, low);
      q_pairs_bf16<4>(input, i + 4 * kLanes, rounder, high);
      return _mm512_permutexvar_epi32(dword_order, _mm512_packs_epi16(_mm512_packs_epi32(low[0], low[1]),
                                                                       _mm512_packs_epi32(high[0], high[1])));
    }
  } else {
    if constexpr (kBits == 8) {
      __m512i bits[4];
      q_vectors<kIn>(input, i, rounder, bits);
      return _mm512_permutexvar_epi32(dword_order, pack4_lane_order<R>(bits, 0));
    } else {
      // Adjacent bytes are still pairs (2j, 2j + 1) in the lane order, so the nibbles are merged first, one
      // word at a time: bits 0-3 from the word, the rest from it shifted right arithmetically by 4 (q_2j+1's
      // nibble, then its sign: the word is the packed byte as an int16). One pack of the two halves and one
      // word permute put the 64 pairs in order: lane k of the pack holds words (pairs 2k and 2k + 1 of the 8
      // in each 16 elements) of the eight vectors, so output word p is source word 8 (p % 4) + p / 4.
      const __m512i nibble = _mm512_set1_epi16(0x000F);
      // Two halves of four vectors each, as for bf16.
      __m512i low[4], high[4];
      q_vectors<kIn>(input, i, rounder, low);
      q_vectors<kIn>(input, i + 4 * kLanes, rounder, high);
      const __m512i b0 = pack4_lane_order<R>(low, 0);
      const __m512i b1 = pack4_lane_order<R>(high, 0);
      const __m512i m0 = _mm512_ternarylogic_epi32(b0, _mm512_srai_epi16(b0, 4), nibble, 0xE4);
      const __m512i m1 = _mm512_ternarylogic_epi32(b1, _mm512_srai_epi16(b1, 4), nibble, 0xE4);
      const __m512i word_order = _mm512_set_epi16(31, 23, 15, 7, 30, 22, 14, 6, 29, 21, 13, 5, 28, 20, 12, 4,
                                                  27, 19, 11, 3, 26, 18, 10, 2, 25, 17, 9, 1, 24, 16, 8, 0);
      return _mm512_permutexvar_epi16(word_order, _mm512_packs_epi16(m0, m1));
    }
  }
}

// How far ahead of the conversion quantize prefetches its input, and how. The group's max pass and then its
// conversion read the group from L1, where a non-temporal prefetch (one per 64-byte line, issued from the
// conversion loop) has put it. The kernel this replaced read the next group's lines (its max) as demand loads
// from memory inside the current group's conversion loop, with a T1 prefetch 4 KiB ahead: it ran at about
// the serial sum of its compute time and its memory time. How far ahead depends on the core (the distance
// covers the memory's latency at the rate the conversion consumes lines), and the two AVX-512 hosts we have
// measured disagree (bench/RESULTS.md): on Zen 5, 16 KiB (0.60 -> 0.72 of the shaped roofline for fp32 int8
// on one thread against the old kernel; 8 KiB too short, 24-32 KiB and T0 no better); on Zen 4, 8 KiB (five
// rounds alternating 16, 12 and 8 KiB, one thread, median 0.68 -> 0.73 fp32 int8, 0.69 -> 0.83 fp32 int4,
// 0.71 -> 0.79 bf16 int8; 12 KiB in between). Other CPUs take 8 KiB, the AVX2 path's distance.
int64_t choose_prefetch_bytes() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return 8192;
  const unsigned base_family = (eax >> 8) & 0xF;
  const unsigned family = base_family == 0xF ? base_family + ((eax >> 20) & 0xFF) : base_family;
  constexpr unsigned kZen5Family = 0x1A;
  return family == kZen5Family ? 16384 : 8192;
}

const int64_t kPrefetchBytes = choose_prefetch_bytes();

inline void prefetch_input(const char* at) { _mm_prefetch(at, _MM_HINT_NTA); }

// Quantizes `range` (max |x| already known) and prefetches the input kPrefetchBytes ahead of it.
template <ScalarType kIn, int kBits, typename R>
void quantize_group(const QuantizeArgs& args, GroupRange range, const R& rounder, bool stream) {
  constexpr int64_t kBytes = kIn == ScalarType::kFloat32 ? 4 : 2;
  constexpr int64_t kBlock = kBlockElements<kBits>;
  constexpr int64_t kLine = 64 / kBytes;
  const int64_t ahead = kPrefetchBytes / kBytes;
  // In locals: q's stores are through uint8_t, which may alias anything, so args' fields would be reloaded
  // after every store.
  const void* const input = args.input;
  const int64_t n = args.n;
  uint8_t* const q = args.q + q_byte_offset(kBits, range.begin);
  const char* const input_bytes = static_cast<const char*>(input);
  // Whole blocks, each 64 bytes of q. A large input's q is stored non-temporally: it leaves the cache before
  // the collective reads it anyway, and skipping the read-for-ownership saves a read per byte written.
  int64_t i = range.begin;
  for (; i + kBlock <= range.end; i += kBlock) {
    for (int64_t v = 0; v < kBlock; v += kLine) {
      if (i + v + ahead < n) prefetch_input(input_bytes + (i + v + ahead) * kBytes);
    }
    const __m512i bytes = quantize_block<kIn, kBits>(input, i, rounder);
    uint8_t* const at = q + q_byte_offset(kBits, i - range.begin);
    if (stream && reinterpret_cast<uintptr_t>(at) % 64 == 0) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(at), bytes);
    } else {
      _mm512_storeu_si512(at, bytes);
    }
  }
  for (; i < range.end; i += kLanes) {
    const __m512i values = rounder.quantize(load_in<kIn>(input, i, lanes_mask(range.end - i)));
    store_q<kBits>(q + q_byte_offset(kBits, i - range.begin), values, range.end - i);
  }
}

template <ScalarType kIn, int kBits>
QuantizeResult quantize_groups(const QuantizeArgs& args, int64_t group_begin, int64_t group_end) {
  const bool stream = args.n >= kStreamMinElements;
  const QuantizeResult result = quantize_group_loop<kIn, kBits>(
      args, group_begin, group_end, stream, kPrefetchBytes,
      [&](GroupRange range) { return group_absmax_bits<kIn>(args.input, range); }, prefetch_input,
      [&](GroupRange range, const WorkingScale& working, bool streaming) {
        if (working.prescale == 1.0f) {
          quantize_group<kIn, kBits>(args, range, Rounder<false>(working), streaming);
        } else {
          quantize_group<kIn, kBits>(args, range, Rounder<true>(working), streaming);
        }
      });
  if (stream) _mm_sfence();  // order the weakly-ordered stores before whatever the caller does next
  return result;
}

// 16 q values from q + offset (count of them valid), sign-extended to int32.
template <int kBits>
inline __m512i load_q(const uint8_t* q, int64_t count) {
  if constexpr (kBits == 8) {
    return _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(lanes_mask(count), q));
  } else {
    const int64_t bytes = (count + 1) / 2;
    const __m512i widened = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes_mask(bytes), q));
    // Lane j takes byte j / 2, shifted so its nibble (low for even j, high for odd j) tops the lane, then
    // shifted back arithmetically: the sign-extended nibble.
    const __m512i pairs = _mm512_permutexvar_epi32(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                                   widened);
    const __m512i shifts = _mm512_set_epi32(24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28);
    return _mm512_srai_epi32(_mm512_sllv_epi32(pairs, shifts), 28);
  }
}

// Round to nearest even, (bits + 0x7FFF + lsb) >> 16, for values that are not NaN (a group with a NaN
// scale is dequantized by dequantize_group_scalar); inf stays inf and overflow rounds to it.
// The bf16 bits in the low half of each 32-bit lane.
inline __m512i bf16_lanes(__m512 value) {
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_srli_epi32(rounded, 16);
}

inline __m256i float_to_bf16(__m512 value) { return _mm512_cvtepi32_epi16(bf16_lanes(value)); }

// 32 bf16 values from two vectors: one pack and one permute (two shuffles) instead of two vpmovdw (four).
inline __m512i float_to_bf16_x2(__m512 low, __m512 high) {
  const __m512i packed = _mm512_packus_epi32(bf16_lanes(low), bf16_lanes(high));  // per 128 bits: 4 low, 4 high
  return _mm512_permutexvar_epi64(_mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0), packed);
}

template <ScalarType kOut>
inline void store_out(void* out, int64_t i, __m512 value, __mmask16 mask) {
  if constexpr (kOut == ScalarType::kFloat32) {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + i, mask, value);
  } else if constexpr (kOut == ScalarType::kBFloat16) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + i, mask, float_to_bf16(value));
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + i, mask,
                             _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// A whole vector of output with a non-temporal store; `at` is aligned to the vector's size.
template <ScalarType kOut>
inline void stream_out(void* out, int64_t i, __m512 value) {
  if constexpr (kOut == ScalarType::kFloat32) {
    _mm512_stream_ps(static_cast<float*>(out) + i, value);
  } else if constexpr (kOut == ScalarType::kBFloat16) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), float_to_bf16(value));
  } else {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                        _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// bf16 bits of a finite fp32 vector, rounded to nearest even as bf16_lanes rounds, in the high half of each
// 32-bit lane: bits + 0x7FFF, plus one where bit 16 (the bf16 lsb) is set (a test and a masked add measured
// faster than bf16_lanes' shift, and and add).
inline __m512i bf16_high(__m512 value) {
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i biased = _mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF));
  return _mm512_mask_add_epi32(biased, _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x10000)), biased,
                               _mm512_set1_epi32(1));
}

// 32 bf16 values, in order, from the even elements (`even`) and the odd ones (`odd`) of 32 consecutive ones:
// lane d holds elements 2d and 2d + 1, so the two high halves merge with no shuffle (vpternlog 0xE4:
// mask ? first : second).
inline __m512i bf16_pairs(__m512 even, __m512 odd) {
  return _mm512_ternarylogic_epi32(bf16_high(odd), _mm512_srli_epi32(bf16_high(even), 16),
                                   _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)), 0xE4);
}

template <bool kNonTemporal>
inline void store_vector(void* at, __m512i value) {
  if constexpr (kNonTemporal) {
    _mm512_stream_si512(static_cast<__m512i*>(at), value);
  } else {
    _mm512_storeu_si512(at, value);
  }
}

// The smallest scale dequantize_vectors takes: int8 to bf16 multiplies q * 2^24 by scale * 2^-24, exact
// (and so rounded as q * scale) only while scale * 2^-24 is a normal fp32 number. 0 for the other cases.
template <ScalarType kOut, int kBits>
constexpr float kVectorMinScale = kBits == 8 && kOut == ScalarType::kBFloat16 ? 0x1p-98f : 0.0f;

// A group's whole 64-byte vectors of q (64 int8 or 128 int4 values) to fp32 or bf16, for a finite scale
// >= kVectorMinScale; returns the first element not written. The per-vector loop below it took one masked
// load, a prefetch test and a store test per 16 elements, and int4 to bf16 ran at 31 GB/s in L2 on the
// Zen 5 VM (int4 to fp32 60, int8 to fp32 126): now about 160, 180 and 190. int4 looks its 16 possible
// values up in a table of the group's outputs (vpermps, vpermw) computed as the scalar path computes each
// element (q * scale in fp32, then rounded to bf16), instead of converting, multiplying and rounding every
// element. int8 to bf16 has no such table in a register and computes.
template <ScalarType kOut, int kBits, bool kNonTemporal>
int64_t dequantize_vectors(const DequantizeArgs& args, GroupRange range, float scale_value) {
  constexpr int64_t kVector = kBits == 8 ? 64 : 128;  // elements per 64 bytes of q
  const uint8_t* const q = args.q + q_byte_offset(kBits, range.begin);
  const int64_t q_end = q_byte_offset(kBits, args.n + 1);
  constexpr int64_t kQAhead = 1024;  // as in dequantize_group
  // int4: the output of each nibble, 0-7 then -8 to -1 (bf16: in words 0-15 and again in 16-31).
  __m512i table = _mm512_setzero_si512();
  if constexpr (kBits == 4) {
    const __m512 values = _mm512_mul_ps(_mm512_set_ps(-1, -2, -3, -4, -5, -6, -7, -8, 7, 6, 5, 4, 3, 2, 1, 0),
                                        _mm512_set1_ps(scale_value));
    if constexpr (kOut == ScalarType::kFloat32) {
      table = _mm512_castps_si512(values);
    } else {
      table = _mm512_broadcast_i64x4(_mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_high(values), 16)));
    }
  }
  int64_t i = range.begin;
  for (; i + kVector <= range.end; i += kVector) {
    const int64_t at = q_byte_offset(kBits, i);
    if (at + kQAhead < q_end) _mm_prefetch(reinterpret_cast<const char*>(args.q + at + kQAhead), _MM_HINT_T0);
    const uint8_t* const src = q + q_byte_offset(kBits, i - range.begin);
    if constexpr (kBits == 8 && kOut == ScalarType::kFloat32) {
      const __m512 scale = _mm512_set1_ps(scale_value);
      float* const out = static_cast<float*>(args.out) + i;
      for (int k = 0; k < 4; ++k) {
        const __m512i values = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * k)));
        store_vector<kNonTemporal>(out + 16 * k,
                                   _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(values), scale)));
      }
    } else if constexpr (kBits == 8) {
      // Word d of 32 q bytes, sign-extended: shifted left by 24 it is q_2d * 2^24, with its low byte cleared
      // q_2d+1 * 2^8; no shift back down, the scales make up for it (kVectorMinScale).
      const __m512 scale_even = _mm512_set1_ps(scale_value * 0x1p-24f);
      const __m512 scale_odd = _mm512_set1_ps(scale_value * 0x1p-8f);
      const __m512i high_bytes = _mm512_set1_epi32(static_cast<int>(0xFFFFFF00u));
      uint16_t* const out = static_cast<uint16_t*>(args.out) + i;
      for (int k = 0; k < 2; ++k) {
        const __m512i words =
            _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * k)));
        const __m512 even = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_slli_epi32(words, 24)), scale_even);
        const __m512 odd = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(words, high_bytes)), scale_odd);
        store_vector<kNonTemporal>(out + 32 * k, bf16_pairs(even, odd));
      }
    } else if constexpr (kOut == ScalarType::kFloat32) {
      // Lane j of output vector k: dword 2k + j / 8 of the 64 bytes, shifted right so that its nibble j % 8
      // is in the low 4 bits, the only ones vpermps reads of an index.
      const __m512i bytes = _mm512_loadu_si512(src);
      const __m512i first = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
      const __m512i shifts = _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
      float* const out = static_cast<float*>(args.out) + i;
      for (int k = 0; k < 8; ++k) {
        const __m512i lanes = _mm512_permutexvar_epi32(_mm512_add_epi32(first, _mm512_set1_epi32(2 * k)), bytes);
        store_vector<kNonTemporal>(out + 16 * k, _mm512_permutexvar_epi32(_mm512_srlv_epi32(lanes, shifts), table));
      }
    } else {
      // Byte d of 16 q bytes zero-extended to dword d and or-ed with itself shifted left by 12: the low word's
      // low 5 bits (all vpermw reads of an index) are the low nibble and a bit that picks the table's
      // identical second half, the high word is the high nibble. So elements 2d and 2d + 1, in order.
      uint16_t* const out = static_cast<uint16_t*>(args.out) + i;
      for (int c = 0; c < 4; ++c) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * c)));
        store_vector<kNonTemporal>(out + 32 * c,
                                   _mm512_permutexvar_epi16(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), table));
      }
    }
  }
  return i;
}

template <ScalarType kOut, int kBits, bool kStream>
void dequantize_group(const DequantizeArgs& args, int64_t g) {
  const GroupRange range = group_range(args.n, args.group_size, g);
  const __m512 scale = _mm512_set1_ps(args.scales[g]);
  const uint8_t* const q = args.q + q_byte_offset(kBits, range.begin);
  constexpr uintptr_t kVectorBytes = kLanes * (kOut == ScalarType::kFloat32 ? 4 : 2);
  const char* const out_bytes = static_cast<const char*>(args.out);
  // q is a thin stream next to the output's: ask for the next group's q lines while this one is converted,
  // or the loads wait on memory (int4 to bf16 from DRAM: 3x slower without).
  const int64_t q_end = q_byte_offset(kBits, args.n + 1);
  constexpr int64_t kQAhead = 1024;
  auto load_values = [&](int64_t i, int64_t count) {
    const int64_t at = q_byte_offset(kBits, i);
    if (at + kQAhead < q_end) _mm_prefetch(reinterpret_cast<const char*>(args.q + at + kQAhead), _MM_HINT_T0);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(load_q<kBits>(q + q_byte_offset(kBits, i - range.begin), count)), scale);
  };
  int64_t i = range.begin;
  if constexpr (kOut != ScalarType::kFloat16) {
    const float scale_value = args.scales[g];
    if (scale_value >= kVectorMinScale<kOut, kBits> && scale_value <= std::numeric_limits<float>::max()) {
      const auto address =
          reinterpret_cast<uintptr_t>(out_bytes + range.begin * static_cast<int64_t>(kVectorBytes / kLanes));
      i = kStream && address % 64 == 0 ? dequantize_vectors<kOut, kBits, true>(args, range, scale_value)
                                       : dequantize_vectors<kOut, kBits, false>(args, range, scale_value);
    }
  }
  // The rest: what is left of a group after its whole 64-byte q vectors, fp16 output, and groups whose scale
  // dequantize_vectors does not take.
  if constexpr (kOut == ScalarType::kBFloat16) {
    for (; i + 2 * kLanes <= range.end; i += 2 * kLanes) {
      const __m512i bits = float_to_bf16_x2(load_values(i, kLanes), load_values(i + kLanes, kLanes));
      uint16_t* const at = static_cast<uint16_t*>(args.out) + i;
      if (kStream && reinterpret_cast<uintptr_t>(at) % 64 == 0) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(at), bits);
      } else {
        _mm512_storeu_si512(at, bits);
      }
    }
  }
  for (; i < range.end; i += kLanes) {
    const int64_t count = range.end - i;
    const __m512 value = load_values(i, count);
    const auto address = reinterpret_cast<uintptr_t>(out_bytes + i * static_cast<int64_t>(kVectorBytes / kLanes));
    if (kStream && count >= kLanes && address % kVectorBytes == 0) {
      stream_out<kOut>(args.out, i, value);
    } else {
      store_out<kOut>(args.out, i, value, lanes_mask(count));
    }
  }
}

template <ScalarType kOut, int kBits>
void dequantize_groups(const DequantizeArgs& args, int64_t group_begin, int64_t group_end) {
  const bool stream = args.n >= kStreamMinElements;
  for (int64_t g = group_begin; g < group_end; ++g) {
    const float scale = args.scales[g];
    if (scale != scale) {
      dequantize_group_scalar<kOut>(args, g);
    } else if (stream) {
      dequantize_group<kOut, kBits, true>(args, g);
    } else {
      dequantize_group<kOut, kBits, false>(args, g);
    }
  }
  if (stream) _mm_sfence();  // order the weakly-ordered stores before whatever the caller does next
}

template <int kBits>
QuantizeResult quantize_bits(const QuantizeArgs& args, int64_t group_begin, int64_t group_end) {
  switch (args.in_type) {
    case ScalarType::kFloat32: return quantize_groups<ScalarType::kFloat32, kBits>(args, group_begin, group_end);
    case ScalarType::kBFloat16: return quantize_groups<ScalarType::kBFloat16, kBits>(args, group_begin, group_end);
    case ScalarType::kFloat16: return quantize_groups<ScalarType::kFloat16, kBits>(args, group_begin, group_end);
  }
  return {};
}

template <int kBits>
void dequantize_bits(const DequantizeArgs& args, int64_t group_begin, int64_t group_end) {
  switch (args.out_type) {
    case ScalarType::kFloat32: return dequantize_groups<ScalarType::kFloat32, kBits>(args, group_begin, group_end);
    case ScalarType::kBFloat16: return dequantize_groups<ScalarType::kBFloat16, kBits>(args, group_begin, group_end);
    case ScalarType::kFloat16: return dequantize_groups<ScalarType::kFloat16, kBits>(args, group_begin, group_end);
  }
}

}  // namespace

QuantizeResult quantize_groups_avx512(const QuantizeArgs& args, int64_t group_begin, int64_t group_end) {
  if (args.bits == 8) return quantize_bits<8>(args, group_begin, group_end);
  return quantize_bits<4>(args, group_begin, group_end);
}

void dequantize_groups_avx512(const DequantizeArgs& args, int64_t group_begin, int64_t group_end) {
  if (args.bits == 8) {
    dequantize_bits<8>(args, group_begin, group_end);
  } else {
    dequantize_bits<4>(args, group_begin, group_end);
  }
}

}  // namespace kernels
}  // namespace zerocore
