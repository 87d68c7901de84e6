// Internal to the stream probe: what stream_probe.cpp (portable loops, dispatch) shares with the
// per-ISA translation units such as stream_probe_avx512.cpp.
#pragma once

#include <cstdint>

#include "zerocore/stream_probe.hpp"

namespace zerocore {
namespace stream_detail {

// The probe's arrays. Roles by kernel: copy a0 = a1; triad a0 = a1 + kTriadScalar * a2;
// adam: param a0, grad a1, exp_avg a2, exp_avg_sq a3 (a0, a2, a3 updated in place).
struct StreamArrays {
  float* a0;
  float* a1;
  float* a2;
  float* a3;
};

constexpr float kTriadScalar = 3.0f;
// The adam-shaped update: m += kAdamMomentum * (g - m); v = kAdamDecay * v + (1 - kAdamDecay) * g * g;
// p -= kAdamStep * m. A few FMAs, no sqrt or divide, so the kernel stays memory bound on any SIMD width.
constexpr float kAdamMomentum = 0.1f;
constexpr float kAdamDecay = 0.999f;
constexpr float kAdamStep = 1e-3f;

// Every range handed to a kernel starts at a multiple of this many elements: a 4 KiB page of fp32, so
// first touch places whole pages, and a multiple of 16 so ranges start on a 64-byte line (non-temporal
// stores need it).
constexpr int64_t kStreamGrain = 1024;

// fp32 per 64-byte cache line: a shaped stream's unit (Note [Shaped streams]).
constexpr int64_t kLineFloats = 16;

#if defined(ZEROCORE_HAVE_AVX512)
// Runs `kernel` on [begin, end); begin is a multiple of kStreamGrain. Call only when
// cpu_supports(SimdPath::kAvx512).
void stream_range_avx512(StreamKernel kernel, StoreKind stores, const StreamArrays& arrays, int64_t begin,
                         int64_t end);
// Runs a shaped stream over narrow-side lines [begin, end): for shrinking shapes (reads > 1) a1 is the wide
// input and a0 the narrow output, for growing ones (writes > 1) a1 is the narrow input and a0 the wide
// output. prefetch_bytes > 0: a software prefetch into L2 that far ahead of every line read. Call only when
// cpu_supports(SimdPath::kAvx512).
void shaped_range_avx512(StreamShape shape, StoreKind stores, int64_t prefetch_bytes, const StreamArrays& arrays,
                         int64_t begin, int64_t end);
#endif

}  // namespace stream_detail
}  // namespace zerocore
