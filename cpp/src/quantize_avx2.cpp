// The AVX2 quantization kernels, 8 elements a vector; compiled with -mavx2 -mfma -mf16c and run only when the
// CPU has them. AVX2 has no masked byte/16-bit loads and stores, so a group's tail (< 8 elements) goes
// through small zero-filled stack buffers and the same vector code. The rounding is the AVX-512 path's:
// t = x * (1 / scale) rounded half to even, corrected by one from the exact FMA residual (Note [Quantization
// arithmetic]), so both paths, and the scalar one, write the same bytes.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

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
  __m256 prescale, scale, inverse, half, neg_half;

  explicit Rounder(const WorkingScale& w)
      : prescale(_mm256_set1_ps(w.prescale)),
        scale(_mm256_set1_ps(w.scale)),
        inverse(_mm256_set1_ps(w.inverse)),
        half(_mm256_set1_ps(w.half)),
        neg_half(_mm256_set1_ps(-w.half)) {}

  // round_half_even(x / scale), exactly.
  inline __m256i quantize(__m256 x) const {
    const __m256 xs = kLift ? _mm256_mul_ps(x, prescale) : x;
    const __m256 rounded = _mm256_round_ps(_mm256_mul_ps(xs, inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i q = _mm256_cvttps_epi32(rounded);  // exact: rounded is a small integer
    // xs - q * scale: exact, or rounded where that cannot change the decision (Note [Quantization arithmetic])
    const __m256 r = _mm256_fnmadd_ps(rounded, scale, xs);
    // |r| < scale / 2: q is right (nearly always: one compare). Otherwise fix the lanes past or on a half.
    const __m256 abs_r = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), r);
    if (_mm256_movemask_ps(_mm256_cmp_ps(abs_r, half, _CMP_GE_OQ)) == 0) return q;
    return correct(q, r);
  }

  // q + 1 where r > scale / 2 or r == scale / 2 with q odd; q - 1 where r < -scale / 2 or r == -scale / 2
  // with q odd (the even neighbour wins a tie).
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

// max |x| bits accumulated 8 elements at a time, alongside the quantize loop (see quantize_group).
template <ScalarType kIn>
struct AbsMax {
  __m256i wide = _mm256_setzero_si256();  // fp32: |x| bits per lane
  __m128i half = _mm_setzero_si128();     // bf16 / fp16: |x| bits per 16-bit lane

  // Elements [i, i + count) of the input, count <= 8.
  inline void add(const void* input, int64_t i, int64_t count) {
    if constexpr (kIn == ScalarType::kFloat32) {
      const __m256i bits = _mm256_castps_si256(load_in<kIn>(input, i, count));
      wide = _mm256_max_epu32(wide, _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(kF32AbsMask))));
    } else {
      __m128i bits;
      const char* const at = static_cast<const char*>(input) + i * 2;
      if (count >= kLanes) {
        bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
      } else {
        alignas(16) uint16_t buffer[kLanes] = {};
        std::memcpy(buffer, at, static_cast<size_t>(count) * 2);
        bits = _mm_load_si128(reinterpret_cast<const __m128i*>(buffer));
      }
      half = _mm_max_epu16(half, _mm_and_si128(bits, _mm_set1_epi16(0x7FFF)));
    }
  }

  // As fp32 bits, like group_absmax_bits.
  inline uint32_t bits() const {
    if constexpr (kIn == ScalarType::kFloat32) return reduce_max_epu32(wide);
    const uint16_t largest = reduce_max_epu16(_mm256_zextsi128_si256(half));
    return float_bits(kIn == ScalarType::kBFloat16 ? bf16_to_float(largest) : half_to_float(largest));
  }
};

// Quantizes `range` and, in the same loop, finds max |x| of `next` (the following group, never longer; empty
// when there is none), whose bits it returns, so that memory streams the next group while this one is
// converted, with a prefetch into L2 4 KiB ahead of that stream; see the AVX-512 path's quantize_group.
template <ScalarType kIn, int kBits, typename R>
uint32_t quantize_group(const QuantizeArgs& args, GroupRange range, GroupRange next, const R& rounder) {
  constexpr int64_t kPrefetchElements = 4096 / type_bytes<kIn>();
  uint8_t* const q = args.q + q_byte_offset(kBits, range.begin);
  const char* const input = static_cast<const char*>(args.input);
  AbsMax<kIn> next_max;
  const int64_t next_offset = next.begin - range.begin;
  for (int64_t i = range.begin; i < range.end; i += kLanes) {
    const int64_t ahead = i + next_offset;
    if (ahead < next.end) next_max.add(args.input, ahead, next.end - ahead);
    if (ahead + kPrefetchElements < args.n) {
      _mm_prefetch(input + (ahead + kPrefetchElements) * type_bytes<kIn>(), _MM_HINT_T1);
    }
    const int64_t count = range.end - i;
    store_q<kBits>(q + q_byte_offset(kBits, i - range.begin), rounder.quantize(load_in<kIn>(args.input, i, count)),
                   count);
  }
  return next_max.bits();
}

template <ScalarType kIn, int kBits>
QuantizeResult quantize_groups(const QuantizeArgs& args, int64_t group_begin, int64_t group_end) {
  QuantizeResult result;
  if (group_begin >= group_end) return result;
  uint32_t absmax_bits = group_absmax_bits<kIn>(args.input, group_range(args.n, args.group_size, group_begin));
  for (int64_t g = group_begin; g < group_end; ++g) {
    const GroupRange range = group_range(args.n, args.group_size, g);
    const GroupRange next = g + 1 < group_end ? group_range(args.n, args.group_size, g + 1) : GroupRange{0, 0};
    auto next_absmax = [&] { return next.begin < next.end ? group_absmax_bits<kIn>(args.input, next) : 0u; };
    if (absmax_bits >= kF32ExponentMask) {
      flag_nonfinite_group<kIn>(args, g, range, result);
      absmax_bits = next_absmax();
      continue;
    }
    const float scale = group_scale(absmax_bits, kBits == 8 ? 127 : 7);
    if (scale == 0.0f) {
      write_zero_group(args, g, range);
      absmax_bits = next_absmax();
      continue;
    }
    args.scales[g] = scale;
    const WorkingScale working = working_scale(scale);
    if (working.prescale == 1.0f) {
      absmax_bits = quantize_group<kIn, kBits>(args, range, next, Rounder<false>(working));
    } else {
      absmax_bits = quantize_group<kIn, kBits>(args, range, next, Rounder<true>(working));
    }
  }
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

// Round to nearest even, (bits + 0x7FFF + lsb) >> 16, for values that are not NaN (a group with a NaN
// scale is dequantized by dequantize_group_scalar); a byte shuffle gathers the high 16-bit word of each lane.
inline __m128i float_to_bf16(__m256 value) {
  const __m256i bits = _mm256_castps_si256(value);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
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

template <ScalarType kOut, int kBits>
void dequantize_groups(const DequantizeArgs& args, int64_t group_begin, int64_t group_end) {
  // As on the AVX-512 path: q prefetched 1 KiB ahead, and a large output written with non-temporal stores
  // wherever a whole vector's address is aligned.
  constexpr int64_t kQAhead = 1024;
  constexpr int64_t kOutBytes = kOut == ScalarType::kFloat32 ? 4 : 2;
  const int64_t q_end = q_byte_offset(kBits, args.n + 1);
  const bool stream = args.n >= kStreamMinElements;
  for (int64_t g = group_begin; g < group_end; ++g) {
    if (args.scales[g] != args.scales[g]) {  // NaN: a group quantize flagged
      dequantize_group_scalar<kOut>(args, g);
      continue;
    }
    const GroupRange range = group_range(args.n, args.group_size, g);
    const __m256 scale = _mm256_set1_ps(args.scales[g]);
    const uint8_t* const q = args.q + q_byte_offset(kBits, range.begin);
    for (int64_t i = range.begin; i < range.end; i += kLanes) {
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
