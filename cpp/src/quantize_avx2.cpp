// The AVX2 quantization kernels, 8 elements a vector; compiled with -mavx2 -mfma -mf16c and run only when the
// CPU has them. AVX2 has no masked byte/16-bit loads and stores, so a group's tail (< 8 elements) goes
// through small zero-filled stack buffers and the same vector code. The rounding is the AVX-512 path's:
// t = x * (1 / scale) rounded half to even, corrected by one from the exact FMA residual (Note [Quantization
// arithmetic]), so both paths, and the scalar one, write the same bytes.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "quantize_kernels.hpp"

namespace zerocore {
namespace kernels {
namespace {

constexpr int64_t kLanes = 8;

template <ScalarType kType>
constexpr int64_t type_bytes() {
  return kType == ScalarType::kFloat32 ? 4 : 2;
}

// 8 elements at `data`.
template <ScalarType kIn>
inline __m256 load_in(const void* data) {
  if constexpr (kIn == ScalarType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(data));
  } else {
    const __m128i bits = _mm_loadu_si128(static_cast<const __m128i*>(data));
    if constexpr (kIn == ScalarType::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    } else {
      return _mm256_cvtph_ps(bits);
    }
  }
}

// Elements [i, i + count) of `data` (count <= 8), zeros after them.
template <ScalarType kIn>
inline __m256 load_in(const void* data, int64_t i, int64_t count) {
  const char* const at = static_cast<const char*>(data) + i * type_bytes<kIn>();
  if (count >= kLanes) return load_in<kIn>(at);
  alignas(32) unsigned char buffer[kLanes * 4] = {};
  std::memcpy(buffer, at, static_cast<size_t>(count * type_bytes<kIn>()));
  return load_in<kIn>(buffer);
}

// The largest of 8 unsigned 32-bit lanes.
inline uint32_t reduce_max_epu32(__m256i v) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

// The largest of 16 unsigned 16-bit lanes.
inline uint16_t reduce_max_epu16(__m256i v) {
  __m128i h = _mm_max_epu16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_max_epu16(h, _mm_srli_si128(h, 8));
  h = _mm_max_epu16(h, _mm_srli_si128(h, 4));
  h = _mm_max_epu16(h, _mm_srli_si128(h, 2));
  return static_cast<uint16_t>(_mm_cvtsi128_si32(h));
}

// max |x| over the group as fp32 bits without the sign: compared as integers, so inf and NaN sort above
// every finite value. 16-bit inputs are compared in their own format (16 per vector, no conversion; both
// formats order their magnitudes like integers) and only the maximum is widened. Values past the last full
// vector are compared one by one.
template <ScalarType kIn>
uint32_t group_absmax_bits(const void* input, GroupRange range) {
  constexpr int64_t kPerVector = 32 / type_bytes<kIn>();
  constexpr uint32_t kAbsMask = kIn == ScalarType::kFloat32 ? kF32AbsMask : 0x7FFFu;
  const __m256i abs_mask = kIn == ScalarType::kFloat32 ? _mm256_set1_epi32(static_cast<int>(kF32AbsMask))
                                                       : _mm256_set1_epi16(0x7FFF);
  const char* const x = static_cast<const char*>(input);
  auto max = [](__m256i a, __m256i b) {
    return kIn == ScalarType::kFloat32 ? _mm256_max_epu32(a, b) : _mm256_max_epu16(a, b);
  };
  auto load = [&](int64_t i) {
    return _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * type_bytes<kIn>())), abs_mask);
  };
  __m256i m0 = _mm256_setzero_si256();
  __m256i m1 = _mm256_setzero_si256();
  int64_t i = range.begin;
  for (; i + 2 * kPerVector <= range.end; i += 2 * kPerVector) {
    m0 = max(m0, load(i));
    m1 = max(m1, load(i + kPerVector));
  }
  if (i + kPerVector <= range.end) {
    m0 = max(m0, load(i));
    i += kPerVector;
  }
  uint32_t largest = kIn == ScalarType::kFloat32 ? reduce_max_epu32(max(m0, m1)) : reduce_max_epu16(max(m0, m1));
  for (; i < range.end; ++i) {
    uint32_t bits;
    if constexpr (kIn == ScalarType::kFloat32) {
      std::memcpy(&bits, x + i * 4, 4);
    } else {
      uint16_t half;
      std::memcpy(&half, x + i * 2, 2);
      bits = half;
    }
    largest = std::max(largest, bits & kAbsMask);
  }
  if constexpr (kIn == ScalarType::kFloat32) return largest;
  const auto top = static_cast<uint16_t>(largest);
  return float_bits(kIn == ScalarType::kBFloat16 ? bf16_to_float(top) : half_to_float(top));
}

// kLift: the group's scale is tiny and runs lifted by 2^64 (WorkingScale).
template <bool kLift>
struct Rounder {
  __m256 prescale, scale, inverse, half, neg_half, magic;

  static constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  static constexpr int kMagicBits = 0x4B400000;

  explicit Rounder(const WorkingScale& w)
      : prescale(_mm256_set1_ps(w.prescale)),
        scale(_mm256_set1_ps(w.scale)),
        inverse(_mm256_set1_ps(w.inverse)),
        half(_mm256_set1_ps(w.half)),
        neg_half(_mm256_set1_ps(-w.half)),
        magic(_mm256_set1_ps(kMagic)) {}

  // round_half_even(x / scale), exactly (the tails: one vector at a time).
  inline __m256i quantize(__m256 x) const {
    const __m256 one[1] = {x};
    __m256i bits[1];
    quantize_n<1>(one, bits);
    return to_int(bits[0]);
  }

  // The guess as the AVX-512 path makes it: t = xs * (1 / scale) + 1.5 * 2^23 in one FMA rounds the product
  // half to even to an integer (fp32's spacing there is 1) and leaves q in the low mantissa bits (t's bits
  // are 0x4B400000 + q), at most one off; r = xs - q * scale, exact or rounded where that cannot change the
  // decision (Note [Quantization arithmetic]). Returns t's bits.
  inline __m256i guess(__m256 x, __m256* r) const {
    __m256 q;
    return _mm256_castps_si256(guess_biased(x, magic, &q, r));
  }

  // guess's t with 1.5 * 2^23 + an even bias in place of 1.5 * 2^23 (still a sum rounded half to even to an
  // integer: t = bias + 1.5 * 2^23 + q), q exactly as a float, and r. Returns t.
  inline __m256 guess_biased(__m256 x, __m256 biased_magic, __m256* q, __m256* r) const {
    const __m256 xs = kLift ? _mm256_mul_ps(x, prescale) : x;
    const __m256 t = _mm256_fmadd_ps(xs, inverse, biased_magic);
    *q = _mm256_sub_ps(t, biased_magic);
    *r = _mm256_fnmadd_ps(*q, scale, xs);
    return t;
  }

  // K vectors' guesses, corrected: |r| < scale / 2 means q is right (nearly always), so one test on the largest
  // |r| of all of them, and only past or on a half are the lanes fixed.
  template <int K>
  inline void quantize_n(const __m256 (&x)[K], __m256i (&bits)[K]) const {
    __m256 r[K];
    for (int k = 0; k < K; ++k) bits[k] = guess(x[k], &r[k]);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 largest = _mm256_andnot_ps(sign, r[0]);
    for (int k = 1; k < K; ++k) largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, r[k]));
    if (__builtin_expect(_mm256_movemask_ps(_mm256_cmp_ps(largest, half, _CMP_GE_OQ)) == 0, 1)) return;
    for (int k = 0; k < K; ++k) bits[k] = correct(bits[k], r[k]);
  }

  // q + 1 where r > scale / 2 or r == scale / 2 with q odd; q - 1 where r < -scale / 2 or r == -scale / 2
  // with q odd (the even neighbour wins a tie). On q or on a guess's bits: 1.5 * 2^23 is even, so bit 0 is
  // q's parity either way, and +-1 stays inside the mantissa.
  inline __m256i correct(__m256i q, __m256 r) const {
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i odd = _mm256_cmpeq_epi32(_mm256_and_si256(q, one), one);
    const __m256i up = _mm256_or_si256(_mm256_castps_si256(_mm256_cmp_ps(r, half, _CMP_GT_OQ)),
                                       _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(r, half, _CMP_EQ_OQ)), odd));
    const __m256i down =
        _mm256_or_si256(_mm256_castps_si256(_mm256_cmp_ps(r, neg_half, _CMP_LT_OQ)),
                        _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(r, neg_half, _CMP_EQ_OQ)), odd));
    return _mm256_add_epi32(_mm256_sub_epi32(q, up), down);  // masks are -1: q + 1 where up, q - 1 where down
  }

  // q of a guess's bits as int32.
  static inline __m256i to_int(__m256i bits) { return _mm256_sub_epi32(bits, _mm256_set1_epi32(kMagicBits)); }
};

// Stores `count` (<= 8) q values: int8 bytes, or int4 pairs packed low nibble first (ceil(count / 2) bytes).
template <int kBits>
inline void store_q(uint8_t* out, __m256i q, int64_t count) {
  if constexpr (kBits == 8) {
    // The low byte of each int32 (exact: |q| <= 127), lane 0's four at bytes 0-3 and lane 1's at 4-7.
    const __m256i picked = _mm256_shuffle_epi8(
        q, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                            -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m128i bytes = _mm_or_si128(_mm256_castsi256_si128(picked), _mm256_extracti128_si256(picked, 1));
    if (count >= kLanes) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out), bytes);
    } else {
      alignas(16) uint8_t buffer[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(buffer), bytes);
      std::memcpy(out, buffer, static_cast<size_t>(count));
    }
  } else {
    // Each 64-bit lane holds (q_even, q_odd): shifting the lane right by 28 puts q_odd's nibble at bits 4-7.
    const __m256i nibbles = _mm256_and_si256(q, _mm256_set1_epi32(0xF));
    const __m256i packed = _mm256_or_si256(nibbles, _mm256_srli_epi64(nibbles, 28));
    const __m256i picked = _mm256_shuffle_epi8(
        packed, _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                 -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m128i bytes = _mm_or_si128(_mm256_castsi256_si128(picked), _mm256_extracti128_si256(picked, 1));
    const uint32_t word = static_cast<uint32_t>(_mm_cvtsi128_si32(bytes));
    if (count >= kLanes) {
      std::memcpy(out, &word, 4);  // a constant size: one store, not a call
    } else {
      std::memcpy(out, &word, static_cast<size_t>((count + 1) / 2));
    }
  }
}

// A block: the elements whose q fill one 32-byte vector (32 int8 values, 64 int4 values).
template <int kBits>
constexpr int64_t kBlockElements = kBits == 8 ? 32 : 64;

// Four vectors of int32 values in [-128, 127] as 32 signed bytes, a's first: two packs give, per 128-bit lane,
// elements 4d..4d+3 of each vector in turn, and one dword permute puts them in order.
inline __m256i pack_bytes_in_order(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i lanes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(lanes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 32 q bytes in element order (int8 values) as 16 int4 pairs per 128 bits: word w = byte 2w's nibble low,
// byte 2w + 1's above it, as 0..255.
inline __m256i nibble_pairs(__m256i bytes) {
  const __m256i w = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F0F));
  return _mm256_and_si256(_mm256_or_si256(w, _mm256_srli_epi16(w, 4)), _mm256_set1_epi16(0x00FF));
}

// q of 16 bf16 elements as one int32 per pair of elements (2j, 2j + 1): the even element's q in bits 0-7
// (int8) or 0-3 (int4), the odd one's sign-extended above it, so the int32 is the pair's bytes as an int16
// (int8) or its packed byte as an int8 (int4), kept exact by signed packs. bf16 widens to fp32 as the even
// elements shifted up by 16 and the odd ones with the low 16 bits cleared: no shuffle, and q comes out in
// the pairs the output wants.
template <int kBits, typename R>
inline __m256i q_pairs_bf16(const void* input, int64_t i, const R& rounder) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(input) + i));
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256 values[2] = {_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)),
                            _mm256_castsi256_ps(_mm256_and_si256(raw, odd_mask))};
  __m256i bits[2];
  rounder.template quantize_n<2>(values, bits);
  constexpr int kShift = kBits == 8 ? 8 : 4;
  const __m256i keep = _mm256_set1_epi32(kBits == 8 ? 0xFF : 0xF);
  return _mm256_or_si256(_mm256_and_si256(bits[0], keep), _mm256_slli_epi32(R::to_int(bits[1]), kShift));
}

// The fast path of a bf16 block, 16 elements: each pair (2j, 2j + 1)'s output bits in the low byte (int4) or
// 16 bits (int8) of an int32, the rest of it zero, unless a guess may be off: `largest` takes the pairs' |r|
// and the caller checks it once per block. The even element's t carries a bias of kBias * (1 + kShift), so
// fma(q_odd, kShift, t_even) = 1.5 * 2^23 + (q_even + kBias) + kShift * (q_odd + kBias) exactly (an integer
// below 2^24): both biased values lie in [1, 2 * kBias - 1], so neither borrows from the other, and xor with
// kBias in each field turns them into two's complement. One FMA and one xor per pair, where shifting and
// masking two q vectors took four.
template <int kBits, typename R>
inline __m256i pair_bits_bf16(const void* input, int64_t i, const R& rounder, __m256* largest) {
  constexpr int kShift = kBits == 8 ? 256 : 16;
  constexpr int kBias = kShift / 2;
  constexpr int kBiasBits = kBias * (1 + kShift);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(input) + i));
  const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  __m256 q_even, q_odd, r_even, r_odd;
  const __m256 t_even =
      rounder.guess_biased(even, _mm256_set1_ps(R::kMagic + static_cast<float>(kBiasBits)), &q_even, &r_even);
  rounder.guess_biased(odd, rounder.magic, &q_odd, &r_odd);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  *largest = _mm256_max_ps(*largest, _mm256_max_ps(_mm256_andnot_ps(sign, r_even), _mm256_andnot_ps(sign, r_odd)));
  const __m256 pair = _mm256_fmadd_ps(q_odd, _mm256_set1_ps(static_cast<float>(kShift)), t_even);
  return _mm256_xor_si256(_mm256_castps_si256(pair), _mm256_set1_epi32(R::kMagicBits + kBiasBits));
}

// One bf16 block's 32 bytes of q, in order, if no guess in it may be off (true); else nothing written.
template <int kBits, typename R>
inline bool quantize_block_bf16_fast(const void* input, int64_t i, const R& rounder, __m256i* bytes) {
  __m256 largest = _mm256_setzero_ps();
  if constexpr (kBits == 8) {
    const __m256i first = pair_bits_bf16<8>(input, i, rounder, &largest);
    const __m256i second = pair_bits_bf16<8>(input, i + 2 * kLanes, rounder, &largest);
    if (__builtin_expect(_mm256_movemask_ps(_mm256_cmp_ps(largest, rounder.half, _CMP_GE_OQ)) != 0, 0)) return false;
    // per lane, pairs 4d..4d+3 of the first 16 elements, then of the second; the qwords in order
    *bytes = _mm256_permute4x64_epi64(_mm256_packus_epi32(first, second), 0xD8);
  } else {
    __m256i p[4];
    for (int k = 0; k < 4; ++k) p[k] = pair_bits_bf16<4>(input, i + k * 2 * kLanes, rounder, &largest);
    if (__builtin_expect(_mm256_movemask_ps(_mm256_cmp_ps(largest, rounder.half, _CMP_GE_OQ)) != 0, 0)) return false;
    // as pack_bytes_in_order, unsigned: each int32 is a byte 0..255
    const __m256i lanes = _mm256_packus_epi16(_mm256_packus_epi32(p[0], p[1]), _mm256_packus_epi32(p[2], p[3]));
    *bytes = _mm256_permutevar8x32_epi32(lanes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  return true;
}

// One bf16 block's 32 bytes of q, in order, each guess corrected where it may be off: the rare case of
// quantize_block_bf16_fast (a tie, or a product within fp32 rounding of one), out of line so that the fast
// loop keeps its registers.
template <int kBits, typename R>
__attribute__((noinline)) __m256i quantize_block_bf16_exact(const void* input, int64_t i, const R& rounder) {
  if constexpr (kBits == 8) {
    // Per lane, pairs 4d..4d+3 of the first 16 elements, then of the second; the qwords in order.
    const __m256i first = q_pairs_bf16<8>(input, i, rounder);
    const __m256i second = q_pairs_bf16<8>(input, i + 2 * kLanes, rounder);
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(first, second), 0xD8);
  } else {
    __m256i p[4];
    for (int k = 0; k < 4; ++k) p[k] = q_pairs_bf16<4>(input, i + k * 2 * kLanes, rounder);
    return pack_bytes_in_order(p[0], p[1], p[2], p[3]);
  }
}

// One block's 32 bytes of q, in order.
template <ScalarType kIn, int kBits, typename R>
inline __m256i quantize_block(const void* input, int64_t i, const R& rounder) {
  if constexpr (kIn == ScalarType::kBFloat16) {
    __m256i bytes;
    if (__builtin_expect(quantize_block_bf16_fast<kBits>(input, i, rounder, &bytes), 1)) return bytes;
    return quantize_block_bf16_exact<kBits>(input, i, rounder);
  } else {
    // Two fp32 vectors at a time: four, with their r and q, spilled some of AVX2's 16 registers (on the
    // AVX2-only EPYC VM, one thread, in L2, three alternating runs: from fp32 int8 33.4 -> 36.5 GB/s, int4
    // 25.0 -> 27.4).
    auto q32 = [&](int64_t at) {
      __m256i bits[4];
      for (int half = 0; half < 2; ++half) {
        __m256 x[2];
        __m256i b[2];
        for (int k = 0; k < 2; ++k) {
          x[k] = load_in<kIn>(static_cast<const char*>(input) + (at + (2 * half + k) * kLanes) * type_bytes<kIn>());
        }
        rounder.template quantize_n<2>(x, b);
        bits[2 * half] = b[0];
        bits[2 * half + 1] = b[1];
      }
      return pack_bytes_in_order(R::to_int(bits[0]), R::to_int(bits[1]), R::to_int(bits[2]), R::to_int(bits[3]));
    };
    if constexpr (kBits == 8) {
      return q32(i);
    } else {
      const __m256i first = nibble_pairs(q32(i));  // elements 0-31 as 16 int4 pairs
      const __m256i second = nibble_pairs(q32(i + 4 * kLanes));
      return _mm256_permute4x64_epi64(_mm256_packus_epi16(first, second), 0xD8);
    }
  }
}

// How far ahead of the conversion quantize prefetches its input, and how (as the AVX-512 path does, see
// there): the group's max pass and then its conversion read the group from the cache, where a non-temporal
// prefetch issued from the conversion loop, one per 64-byte line, has put it. On the AVX2-only EPYC VM (three
// runs alternating, 1 and 2 threads): 8 KiB ahead matched 16 KiB or beat it in every case (int8 from fp32,
// one thread, median fraction of the shaped roofline 0.82 -> 0.99), 4 KiB and 32 KiB slower, T0 no better.
constexpr int64_t kPrefetchBytes = 8192;

inline void prefetch_input(const char* at) { _mm_prefetch(at, _MM_HINT_NTA); }

// Quantizes `range` (max |x| already known): whole 32-byte blocks of q, then the tail 8 elements at a time.
template <ScalarType kIn, int kBits, typename R>
void quantize_group(const QuantizeArgs& args, GroupRange range, const R& rounder, bool stream) {
  constexpr int64_t kBytes = type_bytes<kIn>();
  constexpr int64_t kBlock = kBlockElements<kBits>;
  constexpr int64_t kLine = 64 / kBytes;
  constexpr int64_t kAhead = kPrefetchBytes / kBytes;
  // In locals: q's stores are through uint8_t, which may alias anything.
  const void* const input = args.input;
  const int64_t n = args.n;
  uint8_t* const q = args.q + q_byte_offset(kBits, range.begin);
  const char* const input_bytes = static_cast<const char*>(input);
  int64_t i = range.begin;
  for (; i + kBlock <= range.end; i += kBlock) {
    for (int64_t v = 0; v < kBlock; v += kLine) {
      if (i + v + kAhead < n) prefetch_input(input_bytes + (i + v + kAhead) * kBytes);
    }
    const __m256i bytes = quantize_block<kIn, kBits>(input, i, rounder);
    uint8_t* const at = q + q_byte_offset(kBits, i - range.begin);
    if (stream && reinterpret_cast<uintptr_t>(at) % 32 == 0) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(at), bytes);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), bytes);
    }
  }
  for (; i < range.end; i += kLanes) {
    const int64_t count = range.end - i;
    store_q<kBits>(q + q_byte_offset(kBits, i - range.begin), rounder.quantize(load_in<kIn>(input, i, count)), count);
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

// 8 q values starting at `q` (count of them valid, zeros after), sign-extended to int32.
template <int kBits>
inline __m256i load_q(const uint8_t* q, int64_t count) {
  // Constant-size copies for whole vectors (one load each); only a group's tail copies a variable size.
  if constexpr (kBits == 8) {
    uint64_t word = 0;
    if (count >= kLanes) {
      std::memcpy(&word, q, 8);
    } else {
      std::memcpy(&word, q, static_cast<size_t>(count));
    }
    return _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(word)));
  } else {
    uint32_t word = 0;
    if (count >= kLanes) {
      std::memcpy(&word, q, 4);
    } else {
      std::memcpy(&word, q, static_cast<size_t>((count + 1) / 2));
    }
    const __m256i widened = _mm256_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(word)));
    // Lane j takes byte j / 2, shifted so its nibble (low for even j, high for odd j) tops the lane, then
    // shifted back arithmetically: the sign-extended nibble.
    const __m256i pairs = _mm256_permutevar8x32_epi32(widened, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    const __m256i shifts = _mm256_setr_epi32(28, 24, 28, 24, 28, 24, 28, 24);
    return _mm256_srai_epi32(_mm256_sllv_epi32(pairs, shifts), 28);
  }
}

// bf16 bits of values that are not NaN (a group with a NaN scale is dequantized by dequantize_group_scalar),
// rounded to nearest even, (bits + 0x7FFF + lsb) >> 16, in the high half of each 32-bit lane.
inline __m256i bf16_high(__m256 value) {
  const __m256i bits = _mm256_castps_si256(value);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
}

// bf16_high's result (its low halves zero) in three floating-point operations instead of four integer ones,
// for a normal value below 2^111 under round-to-nearest (dequantize_groups checks both): Veltkamp's split with
// the constant 2^16 + 1 leaves c - (c - value) = value rounded to fp32's top 8 significant bits, to nearest
// even (checked against bf16_high for every fp32 of a binade, ties included, when written; test_quantize checks
// every q at arbitrary scales against the scalar path), and on Zen 3 the integer ports were where int8 to bf16
// queued.
inline __m256i bf16_high_split(__m256 value) {
  __m256 c = _mm256_mul_ps(value, _mm256_set1_ps(65537.0f));
  asm("" : "+x"(c));  // c rounded on its own: contracted into c - value as an FMA, the split is no split
  return _mm256_castps_si256(_mm256_sub_ps(c, _mm256_sub_ps(c, value)));
}

// 8 bf16 values: bf16_high's, a byte shuffle gathering the high 16-bit word of each lane.
inline __m128i float_to_bf16(__m256 value) {
  const __m256i rounded = bf16_high(value);
  const __m256i high_words = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                              2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(rounded, high_words), 0x08);
  return _mm256_castsi256_si128(packed);
}

// Stores `count` (<= 8) output elements at out[i, i + count).
template <ScalarType kOut>
inline void store_out(void* out, int64_t i, __m256 value, int64_t count) {
  if constexpr (kOut == ScalarType::kFloat32) {
    float* const at = static_cast<float*>(out) + i;
    if (count >= kLanes) {
      _mm256_storeu_ps(at, value);
    } else {
      alignas(32) float buffer[kLanes];
      _mm256_store_ps(buffer, value);
      std::memcpy(at, buffer, static_cast<size_t>(count) * sizeof(float));
    }
  } else {
    const __m128i bits = kOut == ScalarType::kBFloat16
                             ? float_to_bf16(value)
                             : _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    uint16_t* const at = static_cast<uint16_t*>(out) + i;
    if (count >= kLanes) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at), bits);
    } else {
      alignas(16) uint16_t buffer[kLanes];
      _mm_store_si128(reinterpret_cast<__m128i*>(buffer), bits);
      std::memcpy(at, buffer, static_cast<size_t>(count) * sizeof(uint16_t));
    }
  }
}

template <bool kNonTemporal>
inline void store_vector(void* at, __m256i value) {
  if constexpr (kNonTemporal) {
    _mm256_stream_si256(static_cast<__m256i*>(at), value);
  } else {
    _mm256_storeu_si256(static_cast<__m256i*>(at), value);
  }
}

// How far ahead dequantize prefetches q, a thin stream beside the output's (as on the AVX-512 path).
constexpr int64_t kQAhead = 1024;

// The smallest scale dequantize_vectors takes: int8 to bf16 multiplies q * 2^24 by scale * 2^-24, exact (and
// so rounded as q * scale) only while scale * 2^-24 is a normal fp32 number. 0 for the other cases.
template <ScalarType kOut, int kBits>
constexpr float kVectorMinScale = kBits == 8 && kOut == ScalarType::kBFloat16 ? 0x1p-98f : 0.0f;
// And the largest: int8 to bf16 rounds with bf16_high_split, whose 128 * scale * (2^16 + 1) must stay finite.
template <ScalarType kOut, int kBits>
constexpr float kVectorMaxScale =
    kBits == 8 && kOut == ScalarType::kBFloat16 ? 0x1p100f : std::numeric_limits<float>::max();

// A group's whole 32-byte vectors of q (32 int8 or 64 int4 values) to fp32, bf16 or fp16, for a finite scale
// >= kVectorMinScale, with no tail test per vector; returns the first element not written. Every output value
// is the scalar path's: q * scale in fp32, then rounded to the output dtype (int4 to bf16 or fp16 looks its 16
// possible values up in a table computed that way).
template <ScalarType kOut, int kBits, bool kNonTemporal>
int64_t dequantize_vectors(const DequantizeArgs& args, GroupRange range, float scale_value) {
  constexpr int64_t kVector = kBits == 8 ? 32 : 64;  // elements per 32 bytes of q
  const uint8_t* const q = args.q + q_byte_offset(kBits, range.begin);
  const int64_t q_end = q_byte_offset(kBits, args.n + 1);
  // int4 to bf16 or fp16: the output of each nibble (0-7, then -8 to -1), its low bytes and its high bytes as
  // two byte tables, in both 128-bit lanes for vpshufb.
  __m256i table_low = _mm256_setzero_si256(), table_high = _mm256_setzero_si256();
  if constexpr (kBits == 4 && kOut != ScalarType::kFloat32) {
    const __m256 scale = _mm256_set1_ps(scale_value);
    const __m256 nonneg = _mm256_mul_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), scale);
    const __m256 neg = _mm256_mul_ps(_mm256_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1), scale);
    __m256i words;  // the 16 outputs in nibble order
    if constexpr (kOut == ScalarType::kBFloat16) {
      // packus keeps each bf16 (< 2^16) and orders them per lane; the permute fixes the order
      words = _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_srli_epi32(bf16_high(nonneg), 16),
                                                           _mm256_srli_epi32(bf16_high(neg), 16)),
                                       0xD8);
    } else {
      words = _mm256_set_m128i(_mm256_cvtps_ph(neg, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                               _mm256_cvtps_ph(nonneg, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // low bytes of the 16 words, then high bytes, per 128-bit lane; then each table in both lanes
    const __m256i split = _mm256_permute4x64_epi64(
        _mm256_shuffle_epi8(words, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,  //
                                                    0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)),
        0xD8);  // qword order: low bytes of words 0-7, of 8-15, high bytes of 0-7, of 8-15
    table_low = _mm256_permute4x64_epi64(split, 0x44);   // qwords 0, 1, 0, 1
    table_high = _mm256_permute4x64_epi64(split, 0xEE);  // qwords 2, 3, 2, 3
  }
  int64_t i = range.begin;
  for (; i + kVector <= range.end; i += kVector) {
    const int64_t at = q_byte_offset(kBits, i);
    if (at % 64 == 0 && at + kQAhead < q_end) {
      _mm_prefetch(reinterpret_cast<const char*>(args.q + at + kQAhead), _MM_HINT_T0);
    }
    const uint8_t* const src = q + q_byte_offset(kBits, i - range.begin);
    if constexpr (kBits == 8 && kOut == ScalarType::kFloat32) {
      const __m256 scale = _mm256_set1_ps(scale_value);
      float* const out = static_cast<float*>(args.out) + i;
      for (int k = 0; k < 4; ++k) {
        const __m256i values = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * k)));
        store_vector<kNonTemporal>(out + 8 * k, _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(values), scale)));
      }
    } else if constexpr (kBits == 8 && kOut == ScalarType::kFloat16) {
      const __m256 scale = _mm256_set1_ps(scale_value);
      uint16_t* const out = static_cast<uint16_t*>(args.out) + i;
      auto halves = [&](const uint8_t* at) {
        const __m256i values = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)));
        return _mm256_cvtps_ph(_mm256_mul_ps(_mm256_cvtepi32_ps(values), scale),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      };
      for (int k = 0; k < 2; ++k) {
        store_vector<kNonTemporal>(out + 16 * k, _mm256_set_m128i(halves(src + 16 * k + 8), halves(src + 16 * k)));
      }
    } else if constexpr (kBits == 8) {
      // Word d of 16 q bytes, sign-extended to 32 bits: shifted left by 24 it is q_2d * 2^24, with its low byte
      // cleared q_2d+1 * 2^8; the scales make up for the shifts (kVectorMinScale). The two bf16 halves merge
      // with no shuffle.
      const __m256 scale_even = _mm256_set1_ps(scale_value * 0x1p-24f);
      const __m256 scale_odd = _mm256_set1_ps(scale_value * 0x1p-8f);
      const __m256i high_bytes = _mm256_set1_epi32(static_cast<int>(0xFFFFFF00u));
      uint16_t* const out = static_cast<uint16_t*>(args.out) + i;
      for (int k = 0; k < 2; ++k) {
        const __m256i words = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * k)));
        const __m256 even = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_slli_epi32(words, 24)), scale_even);
        const __m256 odd = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(words, high_bytes)), scale_odd);
        store_vector<kNonTemporal>(out + 16 * k, _mm256_blend_epi16(_mm256_srli_epi32(bf16_high_split(even), 16),
                                                                    bf16_high_split(odd), 0xAA));
      }
    } else if constexpr (kOut == ScalarType::kFloat32) {
      // Output vector k is q dword k's eight nibbles: each lane shifts its nibble to the top, then back down
      // arithmetically (sign-extended), as load_q does.
      const __m256 scale = _mm256_set1_ps(scale_value);
      const __m256i shifts = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
      float* const out = static_cast<float*>(args.out) + i;
      for (int k = 0; k < 8; ++k) {
        int32_t dword;
        std::memcpy(&dword, src + 4 * k, 4);
        const __m256i values = _mm256_srai_epi32(_mm256_sllv_epi32(_mm256_set1_epi32(dword), shifts), 28);
        store_vector<kNonTemporal>(out + 8 * k, _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(values), scale)));
      }
    } else {
      // 16 outputs (32 bytes) from 8 q bytes: output byte p comes from q byte p / 4 (both lanes hold the 8 q
      // bytes), from its low nibble for p % 4 < 2 and its high nibble otherwise (the odd words shifted right
      // by 4), and is the low or high byte of that nibble's output (p even or odd).
      const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,  //
                                              4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
      const __m256i odd_bytes = _mm256_set1_epi16(static_cast<short>(0xFF00));
      const __m256i nibble = _mm256_set1_epi8(0x0F);
      uint16_t* const out = static_cast<uint16_t*>(args.out) + i;
      for (int k = 0; k < 4; ++k) {
        int64_t qword;
        std::memcpy(&qword, src + 8 * k, 8);
        const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi64x(qword), spread);
        const __m256i nibbles = _mm256_and_si256(_mm256_blend_epi16(bytes, _mm256_srli_epi16(bytes, 4), 0xAA), nibble);
        const __m256i low = _mm256_shuffle_epi8(table_low, nibbles);
        const __m256i high = _mm256_shuffle_epi8(table_high, nibbles);
        store_vector<kNonTemporal>(out + 16 * k, _mm256_blendv_epi8(low, high, odd_bytes));
      }
    }
  }
  return i;
}

template <ScalarType kOut, int kBits>
void dequantize_groups(const DequantizeArgs& args, int64_t group_begin, int64_t group_end) {
  // q prefetched kQAhead ahead, and a large output written with non-temporal stores wherever a whole vector's
  // address is aligned.
  constexpr int64_t kOutBytes = kOut == ScalarType::kFloat32 ? 4 : 2;
  const int64_t q_end = q_byte_offset(kBits, args.n + 1);
  const bool stream = args.n >= kStreamMinElements;
  // int8 to bf16's vectors round in floating point (bf16_high_split), right only under round-to-nearest; in
  // another MXCSR mode every group takes the loop below, whose rounding is integer
  const bool vectors_round_right =
      !(kBits == 8 && kOut == ScalarType::kBFloat16) || (_mm_getcsr() & _MM_ROUND_MASK) == _MM_ROUND_NEAREST;
  for (int64_t g = group_begin; g < group_end; ++g) {
    const float scale_value = args.scales[g];
    if (scale_value != scale_value) {  // NaN: a group quantize flagged
      dequantize_group_scalar<kOut>(args, g);
      continue;
    }
    const GroupRange range = group_range(args.n, args.group_size, g);
    int64_t i = range.begin;
    if (vectors_round_right && scale_value >= kVectorMinScale<kOut, kBits> &&
        scale_value <= kVectorMaxScale<kOut, kBits>) {
      const auto address = reinterpret_cast<uintptr_t>(static_cast<char*>(args.out) + range.begin * kOutBytes);
      i = stream && address % 32 == 0 ? dequantize_vectors<kOut, kBits, true>(args, range, scale_value)
                                      : dequantize_vectors<kOut, kBits, false>(args, range, scale_value);
    }
    // The rest, 8 at a time: what is left after the whole vectors, and scales the vectors do not take.
    const __m256 scale = _mm256_set1_ps(scale_value);
    const uint8_t* const q = args.q + q_byte_offset(kBits, range.begin);
    for (; i < range.end; i += kLanes) {
      const int64_t at = q_byte_offset(kBits, i);
      if (at + kQAhead < q_end) _mm_prefetch(reinterpret_cast<const char*>(args.q + at + kQAhead), _MM_HINT_T0);
      const int64_t count = range.end - i;
      const __m256 value =
          _mm256_mul_ps(_mm256_cvtepi32_ps(load_q<kBits>(q + q_byte_offset(kBits, i - range.begin), count)), scale);
      char* const out = static_cast<char*>(args.out) + i * kOutBytes;
      if (stream && count >= kLanes && reinterpret_cast<uintptr_t>(out) % (kLanes * kOutBytes) == 0) {
        if constexpr (kOut == ScalarType::kFloat32) {
          _mm256_stream_ps(reinterpret_cast<float*>(out), value);
        } else if constexpr (kOut == ScalarType::kBFloat16) {
          _mm_stream_si128(reinterpret_cast<__m128i*>(out), float_to_bf16(value));
        } else {
          _mm_stream_si128(reinterpret_cast<__m128i*>(out),
                           _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
      } else {
        store_out<kOut>(args.out, i, value, count);
      }
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

QuantizeResult quantize_groups_avx2(const QuantizeArgs& args, int64_t group_begin, int64_t group_end) {
  if (args.bits == 8) return quantize_bits<8>(args, group_begin, group_end);
  return quantize_bits<4>(args, group_begin, group_end);
}

void dequantize_groups_avx2(const DequantizeArgs& args, int64_t group_begin, int64_t group_end) {
  if (args.bits == 8) {
    dequantize_bits<8>(args, group_begin, group_end);
  } else {
    dequantize_bits<4>(args, group_begin, group_end);
  }
}

}  // namespace kernels
}  // namespace zerocore
