// The stream probe's AVX-512 kernels: 64-byte loads and stores, one cache line per instruction, which is
// the widest path and the one the AVX-512 Adam kernel streams with. Built with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mfma -mf16c; called only when cpu_supports(SimdPath::kAvx512).
#include <immintrin.h>

#include "stream_probe_kernels.hpp"

namespace zerocore {
namespace stream_detail {
namespace {

constexpr int64_t kLane = 16;  // fp32 per 512-bit register

template <bool kNonTemporal>
inline void store_line(float* dst, __m512 value) {
  if constexpr (kNonTemporal) {
    _mm512_stream_ps(dst, value);  // needs a 64-byte aligned dst: ranges start on kStreamGrain
  } else {
    _mm512_store_ps(dst, value);
  }
}

// The last partial register: masked loads and stores (never non-temporal, a handful of elements).
inline __mmask16 tail_mask(int64_t count) { return static_cast<__mmask16>((1u << count) - 1u); }

// One cache line per iteration in every kernel: measured on Zen 5, unrolling by 2 or 4 lines (loads
// grouped before stores) lost 3-10% of the bandwidth, and the out-of-order core already keeps enough
// lines in flight. The Adam kernels are not unrolled either, so the comparison stays like for like.
template <bool kNonTemporal>
void copy_range(const StreamArrays& x, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + kLane <= end; i += kLane) store_line<kNonTemporal>(x.a0 + i, _mm512_load_ps(x.a1 + i));
  if (i < end) {
    const __mmask16 mask = tail_mask(end - i);
    _mm512_mask_storeu_ps(x.a0 + i, mask, _mm512_maskz_loadu_ps(mask, x.a1 + i));
  }
}

template <bool kNonTemporal>
void triad_range(const StreamArrays& x, int64_t begin, int64_t end) {
  const __m512 s = _mm512_set1_ps(kTriadScalar);
  auto triad = [&](int64_t i) { return _mm512_fmadd_ps(s, _mm512_load_ps(x.a2 + i), _mm512_load_ps(x.a1 + i)); };
  int64_t i = begin;
  for (; i + kLane <= end; i += kLane) store_line<kNonTemporal>(x.a0 + i, triad(i));
  if (i < end) {
    const __mmask16 mask = tail_mask(end - i);
    const __m512 r = _mm512_fmadd_ps(s, _mm512_maskz_loadu_ps(mask, x.a2 + i), _mm512_maskz_loadu_ps(mask, x.a1 + i));
    _mm512_mask_storeu_ps(x.a0 + i, mask, r);
  }
}

struct AdamConstants {
  __m512 momentum = _mm512_set1_ps(kAdamMomentum);
  __m512 decay = _mm512_set1_ps(kAdamDecay);
  __m512 one_minus_decay = _mm512_set1_ps(1.0f - kAdamDecay);
  __m512 step = _mm512_set1_ps(kAdamStep);
};

// One register of the adam-shaped update, in place; p, m, v in and out.
inline void adam_update(const AdamConstants& c, __m512 g, __m512& p, __m512& m, __m512& v) {
  m = _mm512_fmadd_ps(c.momentum, _mm512_sub_ps(g, m), m);
  v = _mm512_fmadd_ps(c.one_minus_decay, _mm512_mul_ps(g, g), _mm512_mul_ps(c.decay, v));
  p = _mm512_fnmadd_ps(c.step, m, p);
}

template <bool kNonTemporal>
void adam_range(const StreamArrays& x, int64_t begin, int64_t end) {
  const AdamConstants c;
  int64_t i = begin;
  for (; i + kLane <= end; i += kLane) {
    // Streams in Adam's order: grad, param, exp_avg, exp_avg_sq.
    const __m512 g = _mm512_load_ps(x.a1 + i);
    __m512 p = _mm512_load_ps(x.a0 + i);
    __m512 m = _mm512_load_ps(x.a2 + i);
    __m512 v = _mm512_load_ps(x.a3 + i);
    adam_update(c, g, p, m, v);
    store_line<kNonTemporal>(x.a0 + i, p);
    store_line<kNonTemporal>(x.a2 + i, m);
    store_line<kNonTemporal>(x.a3 + i, v);
  }
  if (i < end) {
    const __mmask16 mask = tail_mask(end - i);
    __m512 p = _mm512_maskz_loadu_ps(mask, x.a0 + i);
    __m512 m = _mm512_maskz_loadu_ps(mask, x.a2 + i);
    __m512 v = _mm512_maskz_loadu_ps(mask, x.a3 + i);
    adam_update(c, _mm512_maskz_loadu_ps(mask, x.a1 + i), p, m, v);
    _mm512_mask_storeu_ps(x.a0 + i, mask, p);
    _mm512_mask_storeu_ps(x.a2 + i, mask, m);
    _mm512_mask_storeu_ps(x.a3 + i, mask, v);
  }
}

template <bool kNonTemporal>
void run_range(StreamKernel kernel, const StreamArrays& x, int64_t begin, int64_t end) {
  switch (kernel) {
    case StreamKernel::kCopy: copy_range<kNonTemporal>(x, begin, end); break;
    case StreamKernel::kTriad: triad_range<kNonTemporal>(x, begin, end); break;
    case StreamKernel::kAdam: adam_range<kNonTemporal>(x, begin, end); break;
  }
}

// A line's load, after a prefetch into L2 (T1, as the quantize kernels do) `ahead` floats further on when
// kPrefetch.
template <bool kPrefetch>
inline __m512i load_line(const float* src, int64_t ahead) {
  if constexpr (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(src + ahead), _MM_HINT_T1);
  return _mm512_load_si512(src);
}

// A shrinking shaped stream: kRatio wide lines xor-ed into each narrow line.
template <bool kNonTemporal, bool kPrefetch, int kRatio>
void shrink_lines(const StreamArrays& x, int64_t begin, int64_t end, int64_t ahead) {
  for (int64_t j = begin; j < end; ++j) {
    const float* in = x.a1 + j * kRatio * kLineFloats;
    __m512i v = load_line<kPrefetch>(in, ahead);
    for (int k = 1; k < kRatio; ++k) v = _mm512_xor_si512(v, load_line<kPrefetch>(in + k * kLineFloats, ahead));
    store_line<kNonTemporal>(x.a0 + j * kLineFloats, _mm512_castsi512_ps(v));
  }
}

// A growing shaped stream: each narrow line written to kRatio wide lines.
template <bool kNonTemporal, bool kPrefetch, int kRatio>
void grow_lines(const StreamArrays& x, int64_t begin, int64_t end, int64_t ahead) {
  for (int64_t j = begin; j < end; ++j) {
    const __m512 v = _mm512_castsi512_ps(load_line<kPrefetch>(x.a1 + j * kLineFloats, ahead));
    float* out = x.a0 + j * kRatio * kLineFloats;
    for (int k = 0; k < kRatio; ++k) store_line<kNonTemporal>(out + k * kLineFloats, v);
  }
}

template <bool kNonTemporal, bool kPrefetch>
void run_shaped(StreamShape shape, const StreamArrays& x, int64_t begin, int64_t end, int64_t ahead) {
  const bool shrinks = shape.reads > 1;
  switch (shrinks ? shape.reads : shape.writes) {
    case 1: return grow_lines<kNonTemporal, kPrefetch, 1>(x, begin, end, ahead);
    case 2:
      return shrinks ? shrink_lines<kNonTemporal, kPrefetch, 2>(x, begin, end, ahead)
                     : grow_lines<kNonTemporal, kPrefetch, 2>(x, begin, end, ahead);
    case 4:
      return shrinks ? shrink_lines<kNonTemporal, kPrefetch, 4>(x, begin, end, ahead)
                     : grow_lines<kNonTemporal, kPrefetch, 4>(x, begin, end, ahead);
    default:
      return shrinks ? shrink_lines<kNonTemporal, kPrefetch, 8>(x, begin, end, ahead)
                     : grow_lines<kNonTemporal, kPrefetch, 8>(x, begin, end, ahead);
  }
}

}  // namespace

void shaped_range_avx512(StreamShape shape, StoreKind stores, int64_t prefetch_bytes, const StreamArrays& arrays,
                         int64_t begin, int64_t end) {
  const int64_t ahead = prefetch_bytes / static_cast<int64_t>(sizeof(float));
  const bool prefetch = prefetch_bytes > 0;
  if (stores == StoreKind::kNonTemporal) {
    prefetch ? run_shaped<true, true>(shape, arrays, begin, end, ahead)
             : run_shaped<true, false>(shape, arrays, begin, end, ahead);
    _mm_sfence();
  } else {
    prefetch ? run_shaped<false, true>(shape, arrays, begin, end, ahead)
             : run_shaped<false, false>(shape, arrays, begin, end, ahead);
  }
}

void stream_range_avx512(StreamKernel kernel, StoreKind stores, const StreamArrays& arrays, int64_t begin,
                         int64_t end) {
  if (stores == StoreKind::kNonTemporal) {
    run_range<true>(kernel, arrays, begin, end);
    _mm_sfence();  // non-temporal stores are weakly ordered: make them visible before the pass is timed done
  } else {
    run_range<false>(kernel, arrays, begin, end);
  }
}

}  // namespace stream_detail
}  // namespace zerocore
