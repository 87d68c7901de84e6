// The stream probe's portable kernels, its buffers and its timing loop; see Note [Stream probe accounting].
#include "zerocore/stream_probe.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <new>
#include <utility>

#include "stream_probe_kernels.hpp"
#include "zerocore/error.hpp"

#if defined(__SSE2__)
#include <immintrin.h>
#define ZEROCORE_PORTABLE_NON_TEMPORAL 1
#endif

namespace zerocore {
namespace {

using stream_detail::kStreamGrain;
using stream_detail::StreamArrays;

// Initial values: every kernel keeps them finite and normal over any number of passes (no denormal slow
// paths); the adam kernel reads a1 as a gradient of 0.5, so m and v converge instead of growing.
constexpr float kInitialValues[4] = {1.0f, 0.5f, 0.25f, 0.125f};

inline void adam_element(float& p, float g, float& m, float& v) {
  m += stream_detail::kAdamMomentum * (g - m);
  v = stream_detail::kAdamDecay * v + (1.0f - stream_detail::kAdamDecay) * g * g;
  p -= stream_detail::kAdamStep * m;
}

// Regular stores: plain loops, vectorised by the compiler for whatever ISA this file is built for.
// The pointers are deliberately not __restrict: with them a compiler may turn the copy loop into memcpy,
// whose large-size path uses non-temporal stores of its own and would blur the regular/nt comparison.
void portable_regular(StreamKernel kernel, const StreamArrays& x, int64_t begin, int64_t end) {
  switch (kernel) {
    case StreamKernel::kCopy:
      for (int64_t i = begin; i < end; ++i) x.a0[i] = x.a1[i];
      return;
    case StreamKernel::kTriad:
      for (int64_t i = begin; i < end; ++i) x.a0[i] = x.a1[i] + stream_detail::kTriadScalar * x.a2[i];
      return;
    case StreamKernel::kAdam:
      for (int64_t i = begin; i < end; ++i) adam_element(x.a0[i], x.a1[i], x.a2[i], x.a3[i]);
      return;
  }
}

#if defined(ZEROCORE_PORTABLE_NON_TEMPORAL)
// Non-temporal stores with SSE, part of the x86-64 baseline. `begin` is 64-byte aligned (kStreamGrain).
void portable_non_temporal(StreamKernel kernel, const StreamArrays& x, int64_t begin, int64_t end) {
  const int64_t vector_end = begin + (end - begin) / 4 * 4;
  switch (kernel) {
    case StreamKernel::kCopy:
      for (int64_t i = begin; i < vector_end; i += 4) _mm_stream_ps(x.a0 + i, _mm_load_ps(x.a1 + i));
      break;
    case StreamKernel::kTriad: {
      const __m128 s = _mm_set1_ps(stream_detail::kTriadScalar);
      for (int64_t i = begin; i < vector_end; i += 4) {
        _mm_stream_ps(x.a0 + i, _mm_add_ps(_mm_load_ps(x.a1 + i), _mm_mul_ps(s, _mm_load_ps(x.a2 + i))));
      }
      break;
    }
    case StreamKernel::kAdam: {
      const __m128 momentum = _mm_set1_ps(stream_detail::kAdamMomentum);
      const __m128 decay = _mm_set1_ps(stream_detail::kAdamDecay);
      const __m128 one_minus_decay = _mm_set1_ps(1.0f - stream_detail::kAdamDecay);
      const __m128 step = _mm_set1_ps(stream_detail::kAdamStep);
      for (int64_t i = begin; i < vector_end; i += 4) {
        const __m128 g = _mm_load_ps(x.a1 + i);
        __m128 m = _mm_load_ps(x.a2 + i);
        __m128 v = _mm_load_ps(x.a3 + i);
        m = _mm_add_ps(m, _mm_mul_ps(momentum, _mm_sub_ps(g, m)));
        v = _mm_add_ps(_mm_mul_ps(decay, v), _mm_mul_ps(one_minus_decay, _mm_mul_ps(g, g)));
        _mm_stream_ps(x.a0 + i, _mm_sub_ps(_mm_load_ps(x.a0 + i), _mm_mul_ps(step, m)));
        _mm_stream_ps(x.a2 + i, m);
        _mm_stream_ps(x.a3 + i, v);
      }
      break;
    }
  }
  portable_regular(kernel, x, vector_end, end);
  _mm_sfence();  // non-temporal stores are weakly ordered: make them visible before the pass is timed done
}
#endif

// The shaped streams' portable loops (Note [Shaped streams]); lines of kLineFloats 32-bit words, as in
// stream_range_avx512's shaped kernels. Non-temporal stores write 16 bytes at a time with SSE.
using stream_detail::kLineFloats;

inline int shape_ratio(StreamShape shape) { return shape.reads > 1 ? shape.reads : shape.writes; }

// The portable loops do not prefetch: their prefetching passes are the same as the others.
void portable_shaped(StreamShape shape, StoreKind stores, int64_t /*prefetch_bytes*/, const StreamArrays& x,
                     int64_t begin, int64_t end) {
  const int ratio = shape_ratio(shape);
  const auto* in = reinterpret_cast<const uint32_t*>(x.a1);
  auto* out = reinterpret_cast<uint32_t*>(x.a0);
  for (int64_t j = begin; j < end; ++j) {
    if (shape.reads > 1) {  // shrink: ratio wide lines xor-ed into narrow line j
      uint32_t line[kLineFloats] = {};
      for (int k = 0; k < ratio; ++k) {
        for (int64_t w = 0; w < kLineFloats; ++w) line[w] ^= in[(j * ratio + k) * kLineFloats + w];
      }
#if defined(ZEROCORE_PORTABLE_NON_TEMPORAL)
      if (stores == StoreKind::kNonTemporal) {
        for (int64_t w = 0; w < kLineFloats; w += 4) {
          _mm_stream_si128(reinterpret_cast<__m128i*>(out + j * kLineFloats + w),
                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(line + w)));
        }
        continue;
      }
#endif
      for (int64_t w = 0; w < kLineFloats; ++w) out[j * kLineFloats + w] = line[w];
    } else {  // grow: narrow line j written to ratio wide lines
      for (int k = 0; k < ratio; ++k) {
        uint32_t* dst = out + (j * ratio + k) * kLineFloats;
        const uint32_t* src = in + j * kLineFloats;
#if defined(ZEROCORE_PORTABLE_NON_TEMPORAL)
        if (stores == StoreKind::kNonTemporal) {
          for (int64_t w = 0; w < kLineFloats; w += 4) {
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + w),
                             _mm_load_si128(reinterpret_cast<const __m128i*>(src + w)));
          }
          continue;
        }
#endif
        for (int64_t w = 0; w < kLineFloats; ++w) dst[w] = src[w];
      }
    }
  }
#if defined(ZEROCORE_PORTABLE_NON_TEMPORAL)
  if (stores == StoreKind::kNonTemporal) _mm_sfence();
#endif
  (void)stores;
}

double median_of(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// AlignedBuffer
// ---------------------------------------------------------------------------------------------------------

AlignedBuffer::AlignedBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  // std::aligned_alloc wants a size that is a multiple of the alignment.
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  data_ = std::aligned_alloc(kAlignment, rounded);
  if (data_ == nullptr) throw std::bad_alloc();
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

// ---------------------------------------------------------------------------------------------------------
// Names
// ---------------------------------------------------------------------------------------------------------

const char* stream_kernel_name(StreamKernel kernel) {
  switch (kernel) {
    case StreamKernel::kCopy: return "copy";
    case StreamKernel::kTriad: return "triad";
    case StreamKernel::kAdam: return "adam";
  }
  return "unknown";
}

StreamKernel parse_stream_kernel(const std::string& name) {
  for (StreamKernel kernel : {StreamKernel::kCopy, StreamKernel::kTriad, StreamKernel::kAdam}) {
    if (name == stream_kernel_name(kernel)) return kernel;
  }
  throw InvalidArgument("unknown stream kernel '" + name + "'; expected one of: copy, triad, adam");
}

int stream_kernel_arrays(StreamKernel kernel) {
  switch (kernel) {
    case StreamKernel::kCopy: return 2;
    case StreamKernel::kTriad: return 3;
    case StreamKernel::kAdam: return 4;
  }
  return 4;
}

int64_t stream_kernel_bytes_per_element(StreamKernel kernel) {
  constexpr int64_t kFloat = sizeof(float);
  switch (kernel) {
    case StreamKernel::kCopy: return (1 + 1) * kFloat;
    case StreamKernel::kTriad: return (2 + 1) * kFloat;
    case StreamKernel::kAdam: return (4 + 3) * kFloat;
  }
  return 0;
}

std::string stream_shape_name(StreamShape shape) {
  return std::to_string(shape.reads) + ":" + std::to_string(shape.writes);
}

void check_stream_shape(StreamShape shape) {
  const bool ratio_ok = [](int r) { return r == 1 || r == 2 || r == 4 || r == 8; }(shape.reads > 1 ? shape.reads
                                                                                                  : shape.writes);
  ZC_CHECK_ARG(ratio_ok && (shape.reads == 1 || shape.writes == 1),
               "unknown stream shape ", stream_shape_name(shape),
               " (lines read : lines written); expected one of 1:1, 2:1, 4:1, 8:1, 1:2, 1:4, 1:8");
}

const char* store_kind_name(StoreKind stores) { return stores == StoreKind::kNonTemporal ? "nt" : "regular"; }

SimdPath stream_probe_path(SimdPath requested) {
#if defined(ZEROCORE_HAVE_AVX512)
  if (requested == SimdPath::kAvx512 && cpu_supports(SimdPath::kAvx512)) return SimdPath::kAvx512;
#endif
  (void)requested;
  return SimdPath::kScalar;
}

bool stream_supports_non_temporal(SimdPath path) {
#if defined(ZEROCORE_HAVE_AVX512)
  if (path == SimdPath::kAvx512) return true;
#endif
#if defined(ZEROCORE_PORTABLE_NON_TEMPORAL)
  return path == SimdPath::kScalar;
#else
  return false;
#endif
}

const StreamResult& fastest_stream_result(const std::vector<StreamResult>& results) {
  ZC_CHECK_ARG(!results.empty(), "fastest_stream_result needs at least one result");
  return *std::max_element(results.begin(), results.end(), [](const StreamResult& a, const StreamResult& b) {
    return a.best_gbps() < b.best_gbps();
  });
}

// ---------------------------------------------------------------------------------------------------------
// StreamProbe
// ---------------------------------------------------------------------------------------------------------

StreamProbe::StreamProbe(int64_t elements, ThreadPool* pool, SimdPath path)
    : elements_(elements), pool_(pool), path_(stream_probe_path(path)) {
  ZC_CHECK_ARG(elements >= 1, "stream probe elements must be >= 1, got ", elements);
  ZC_CHECK_ARG(static_cast<uint64_t>(elements) <= SIZE_MAX / sizeof(float),
               "stream probe elements too large for this address space: ", elements);
}

int StreamProbe::threads() const { return pool_ != nullptr ? pool_->num_threads() : 1; }

void StreamProbe::ensure_arrays(int count) {
  const int first_new = static_cast<int>(arrays_.size());
  if (first_new >= count) return;
  for (int i = first_new; i < count; ++i) arrays_.emplace_back(static_cast<size_t>(elements_) * sizeof(float));
  // First touch with the kernels' own partition: each page is faulted in by the thread that streams it.
  auto touch = [&](int64_t begin, int64_t end) {
    for (int i = first_new; i < count; ++i) {
      float* array = arrays_[i].as<float>();
      std::fill(array + begin, array + end, kInitialValues[i]);
    }
  };
  if (pool_ != nullptr) {
    pool_->parallel_for(elements_, kStreamGrain, touch);
  } else {
    touch(0, elements_);
  }
}

void StreamProbe::check_stores(StoreKind stores) const {
  ZC_CHECK_ARG(stores == StoreKind::kRegular || stream_supports_non_temporal(path_),
               "non-temporal stores are not available on the '", simd_path_name(path_), "' stream path");
}

void StreamProbe::pass(StreamKernel kernel, StoreKind stores) {
  ensure_arrays(stream_kernel_arrays(kernel));
  const StreamArrays arrays{arrays_[0].as<float>(), arrays_[1].as<float>(),
                            arrays_.size() > 2 ? arrays_[2].as<float>() : nullptr,
                            arrays_.size() > 3 ? arrays_[3].as<float>() : nullptr};
  void (*range_kernel)(StreamKernel, StoreKind, const StreamArrays&, int64_t, int64_t) = nullptr;
#if defined(ZEROCORE_HAVE_AVX512)
  if (path_ == SimdPath::kAvx512) range_kernel = &stream_detail::stream_range_avx512;
#endif
  if (range_kernel == nullptr) {
    range_kernel = [](StreamKernel k, StoreKind s, const StreamArrays& x, int64_t begin, int64_t end) {
#if defined(ZEROCORE_PORTABLE_NON_TEMPORAL)
      if (s == StoreKind::kNonTemporal) return portable_non_temporal(k, x, begin, end);
#endif
      (void)s;
      portable_regular(k, x, begin, end);
    };
  }
  auto body = [&](int64_t begin, int64_t end) { range_kernel(kernel, stores, arrays, begin, end); };
  if (pool_ != nullptr) {
    pool_->parallel_for(elements_, kStreamGrain, body);
  } else {
    body(0, elements_);
  }
}

double StreamProbe::time_pass(StreamKernel kernel, StoreKind stores) {
  check_stores(stores);
  ensure_arrays(stream_kernel_arrays(kernel));  // first touch is not part of the pass
  const auto start = std::chrono::steady_clock::now();
  pass(kernel, stores);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int64_t StreamProbe::shaped_lines(StreamShape shape) const {
  check_stream_shape(shape);
  return elements_ / (kLineFloats * shape_ratio(shape));
}

int64_t StreamProbe::shaped_pass_bytes(StreamShape shape) const {
  const int64_t narrow_bytes = shaped_lines(shape) * kLineFloats * static_cast<int64_t>(sizeof(float));
  return narrow_bytes * (1 + shape_ratio(shape));
}

void StreamProbe::shaped_pass(StreamShape shape, StoreKind stores, int64_t prefetch_bytes) {
  const int64_t lines = shaped_lines(shape);
  const StreamArrays arrays{arrays_[0].as<float>(), arrays_[1].as<float>(), nullptr, nullptr};
  void (*range_kernel)(StreamShape, StoreKind, int64_t, const StreamArrays&, int64_t, int64_t) = &portable_shaped;
#if defined(ZEROCORE_HAVE_AVX512)
  if (path_ == SimdPath::kAvx512) range_kernel = &stream_detail::shaped_range_avx512;
#endif
  auto body = [&](int64_t begin, int64_t end) { range_kernel(shape, stores, prefetch_bytes, arrays, begin, end); };
  // A grain of 64 narrow lines: every range starts on a 4 KiB page of both arrays.
  const int64_t grain = std::max<int64_t>(1, kStreamGrain / kLineFloats);
  if (pool_ != nullptr) {
    pool_->parallel_for(lines, grain, body);
  } else {
    body(0, lines);
  }
}

double StreamProbe::time_shaped_pass(StreamShape shape, StoreKind stores, int64_t prefetch_bytes) {
  ZC_CHECK_ARG(prefetch_bytes >= 0 && prefetch_bytes % 64 == 0,
               "shaped stream prefetch distance must be a non-negative multiple of 64 bytes, got ", prefetch_bytes);
  check_stores(stores);
  check_stream_shape(shape);
  ensure_arrays(2);  // first touch is not part of the pass
  const auto start = std::chrono::steady_clock::now();
  shaped_pass(shape, stores, prefetch_bytes);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

StreamResult StreamProbe::run(StreamKernel kernel, StoreKind stores, int repeats) {
  ZC_CHECK_ARG(repeats >= 1, "stream probe repeats must be >= 1, got ", repeats);
  check_stores(stores);
  StreamResult result;
  result.kernel = kernel;
  result.stores = stores;
  result.path = path_;
  result.threads = threads();
  result.elements = elements_;
  result.bytes_per_pass = elements_ * stream_kernel_bytes_per_element(kernel);
  time_pass(kernel, stores);  // warm-up: wakes the workers and brings the TLB and prefetchers to steady state
  for (int r = 0; r < repeats; ++r) result.seconds.push_back(time_pass(kernel, stores));
  result.best_seconds = *std::min_element(result.seconds.begin(), result.seconds.end());
  result.median_seconds = median_of(result.seconds);
  return result;
}

std::vector<StreamResult> StreamProbe::run_all_stores(StreamKernel kernel, int repeats) {
  std::vector<StreamResult> results{run(kernel, StoreKind::kRegular, repeats)};
  if (stream_supports_non_temporal(path_)) results.push_back(run(kernel, StoreKind::kNonTemporal, repeats));
  return results;
}

}  // namespace zerocore
