// adam_step / all_finite and their multi-tensor forms: argument validation, the per-call coefficients (in
// double, rounded to fp32 once as torch does), the split over the pool, and the dispatch to the chosen ISA's
// chunk kernel.
#include "zerocore/cpu_adam.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cpu_adam_kernels.hpp"
#include "zerocore/error.hpp"

namespace zerocore {
namespace {

// Chunk boundaries fall on multiples of 64 elements from the start: whole 64-byte lines of every fp32
// and 16-bit stream when the spans are aligned, so two threads never write the same cache line.
constexpr int64_t kChunkAlignment = 64;
// Below this many elements per thread the handoff to a worker costs more than the work it saves.
constexpr int64_t kMinElementsPerThread = 32 * 1024;
// From this many elements on (30 MB moved, a last-level cache's worth) param_out is written with
// non-temporal stores: skipping its read-for-ownership saves 2 of the 30 bytes per element, and the copy
// would leave the cache before anyone reads it anyway. Measured on a 2-core AVX-512 VM: 6-11% faster from
// 2M to 100M elements, even at 1M. Smaller outputs may still be in cache for the next consumer.
constexpr int64_t kStreamParamOutMinElements = int64_t{1} << 20;
// all_finite checks a flag between blocks of this many elements so that every thread stops soon after
// any of them finds an inf/NaN.
constexpr int64_t kFiniteBlock = 64 * 1024;

using AdamChunkFn = void (*)(const AdamSpans&, const kernels::Coefficients&, int64_t, int64_t);
using FiniteChunkFn = bool (*)(const void*, ScalarType, int64_t, int64_t);

AdamChunkFn adam_kernel(SimdPath path) {
  switch (path) {
    case SimdPath::kScalar: return kernels::adam_chunk_scalar;
#if defined(ZEROCORE_HAVE_AVX2)
    case SimdPath::kAvx2: return kernels::adam_chunk_avx2;
#endif
#if defined(ZEROCORE_HAVE_AVX512)
    case SimdPath::kAvx512: return kernels::adam_chunk_avx512;
#endif
    default: break;
  }
  throw InvalidArgument(detail::concat("no Adam kernel for SIMD path '", simd_path_name(path), "'"));
}

FiniteChunkFn finite_kernel(SimdPath path) {
  switch (path) {
    case SimdPath::kScalar: return kernels::all_finite_chunk_scalar;
#if defined(ZEROCORE_HAVE_AVX2)
    case SimdPath::kAvx2: return kernels::all_finite_chunk_avx2;
#endif
#if defined(ZEROCORE_HAVE_AVX512)
    case SimdPath::kAvx512: return kernels::all_finite_chunk_avx512;
#endif
    default: break;
  }
  throw InvalidArgument(detail::concat("no all_finite kernel for SIMD path '", simd_path_name(path), "'"));
}

// Runs fn over [0, n): on the calling thread when the work is small, otherwise as one contiguous,
// 64-aligned range per thread (balanced to within 64 elements).
template <typename Fn>
void split_over_pool(int64_t n, ThreadPool* pool, const Fn& fn) {
  const int64_t threads = pool == nullptr ? 1 : pool->num_threads();
  const int64_t useful_threads = std::min(threads, std::max<int64_t>(1, n / kMinElementsPerThread));
  if (useful_threads <= 1) {
    fn(0, n);
    return;
  }
  const int64_t per_thread = (n + useful_threads - 1) / useful_threads;
  const int64_t grain = (per_thread + kChunkAlignment - 1) / kChunkAlignment * kChunkAlignment;
  pool->parallel_for(n, grain, fn);
}

// `where` prefixes every message: "adam_step: " or "multi_tensor_adam_step: tensors[3]: ".
void validate_spans(const AdamSpans& spans, const std::string& where) {
  const int64_t n = spans.n;
  ZC_CHECK_ARG(n >= 0, where, "n must be >= 0, got ", n);
  if (n > 0) {
    ZC_CHECK_ARG(spans.param != nullptr, where, "param must not be null when n > 0 (n = ", n, ")");
    ZC_CHECK_ARG(spans.grad != nullptr, where, "grad must not be null when n > 0 (n = ", n, ")");
    ZC_CHECK_ARG(spans.exp_avg != nullptr, where, "exp_avg must not be null when n > 0 (n = ", n, ")");
    ZC_CHECK_ARG(spans.exp_avg_sq != nullptr, where, "exp_avg_sq must not be null when n > 0 (n = ", n, ")");
  }
  ZC_CHECK_ARG(is_float_type(spans.grad_type), where, "grad_type must be float32, bfloat16 or float16, got ",
               static_cast<int>(spans.grad_type));
  // The output type only matters when there is an output (the bindings leave the default otherwise).
  ZC_CHECK_ARG(spans.param_out == nullptr || spans.param_out_type == ScalarType::kBFloat16 ||
                   spans.param_out_type == ScalarType::kFloat16,
               where, "param_out_type must be bfloat16 or float16, got ", static_cast<int>(spans.param_out_type));
}

void validate_hyper(const AdamHyper& hyper, const char* caller) {
  ZC_CHECK_ARG(hyper.step >= 1, caller, ": step must be >= 1, got ", hyper.step);
  // Comparisons with NaN are false, so a NaN fails these checks too; an inf lr, grad_scale, eps or
  // weight_decay would write inf/NaN into every parameter.
  ZC_CHECK_ARG(hyper.lr >= 0 && std::isfinite(hyper.lr), caller, ": lr must be a finite number >= 0, got ", hyper.lr);
  ZC_CHECK_ARG(hyper.beta1 >= 0 && hyper.beta1 < 1, caller, ": beta1 must be in [0, 1), got ", hyper.beta1);
  ZC_CHECK_ARG(hyper.beta2 >= 0 && hyper.beta2 < 1, caller, ": beta2 must be in [0, 1), got ", hyper.beta2);
  ZC_CHECK_ARG(hyper.eps >= 0 && std::isfinite(hyper.eps), caller, ": eps must be a finite number >= 0, got ",
               hyper.eps);
  ZC_CHECK_ARG(hyper.weight_decay >= 0 && std::isfinite(hyper.weight_decay), caller,
               ": weight_decay must be a finite number >= 0, got ", hyper.weight_decay);
  ZC_CHECK_ARG(std::isfinite(hyper.grad_scale), caller, ": grad_scale must be finite, got ", hyper.grad_scale);
}

std::string tensor_prefix(const char* caller, int64_t index) {
  return detail::concat(caller, ": tensors[", index, "]: ");
}

void check_tensor_list(const AdamSpans* tensors, int64_t num_tensors, const char* caller) {
  ZC_CHECK_ARG(num_tensors >= 0, caller, ": num_tensors must be >= 0, got ", num_tensors);
  ZC_CHECK_ARG(num_tensors == 0 || tensors != nullptr, caller, ": tensors must not be null when num_tensors > 0 (",
               num_tensors, ")");
}

// Where each span starts when the spans are laid end to end: offsets[i] for span i, offsets[num] the total.
// Call after validating every n >= 0.
std::vector<int64_t> span_offsets(const AdamSpans* tensors, int64_t num_tensors, const char* caller) {
  std::vector<int64_t> offsets(static_cast<size_t>(num_tensors) + 1, 0);
  for (int64_t i = 0; i < num_tensors; ++i) {
    ZC_CHECK_ARG(tensors[i].n <= std::numeric_limits<int64_t>::max() - offsets[i], caller,
                 ": the spans hold more than 2^63 - 1 elements together (at tensors[", i, "])");
    offsets[i + 1] = offsets[i] + tensors[i].n;
  }
  return offsets;
}

// Calls fn(i, local_begin, local_end) for every non-empty piece of span i that [begin, end) of the
// concatenated index space covers, in order, until fn returns false; returns false when fn did.
template <typename Fn>
bool for_each_piece(const std::vector<int64_t>& offsets, int64_t begin, int64_t end, const Fn& fn) {
  const auto num_tensors = static_cast<int64_t>(offsets.size()) - 1;
  // The last span starting at or before `begin`: offsets[i] <= begin < offsets[i + 1], so it is not empty.
  int64_t i = (std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin()) - 1;
  for (; i < num_tensors && offsets[i] < end; ++i) {
    const int64_t local_begin = std::max(begin, offsets[i]) - offsets[i];
    const int64_t local_end = std::min(end, offsets[i + 1]) - offsets[i];
    if (local_begin < local_end && !fn(i, local_begin, local_end)) return false;
  }
  return true;
}

// The scalars torch's AdamW computes as Python floats, each rounded to fp32 once like its CPU kernels do.
kernels::Coefficients make_coefficients(const AdamHyper& hyper) {
  kernels::Coefficients coef;
  coef.grad_scale = static_cast<float>(hyper.grad_scale);
  coef.decay = hyper.adamw ? static_cast<float>(1.0 - hyper.lr * hyper.weight_decay) : 1.0f;
  // torch.optim.Adam skips the add when weight_decay == 0, which matters for inf params (0 * inf = NaN).
  coef.l2 = !hyper.adamw && hyper.weight_decay != 0.0;
  coef.l2_weight_decay = static_cast<float>(hyper.weight_decay);
  coef.one_minus_beta1 = static_cast<float>(1.0 - hyper.beta1);
  coef.beta2 = static_cast<float>(hyper.beta2);
  coef.one_minus_beta2 = static_cast<float>(1.0 - hyper.beta2);
  coef.eps = static_cast<float>(hyper.eps);
  if (hyper.bias_correction) {
    const double step = static_cast<double>(hyper.step);
    const double bias_correction1 = 1.0 - std::pow(hyper.beta1, step);
    const double bias_correction2 = 1.0 - std::pow(hyper.beta2, step);
    coef.neg_step_size = static_cast<float>(-(hyper.lr / bias_correction1));
    coef.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  } else {
    coef.neg_step_size = static_cast<float>(-hyper.lr);
    coef.bias_correction2_sqrt = 1.0f;
  }
  return coef;
}

}  // namespace

void adam_step(const AdamSpans& spans, const AdamHyper& hyper, ThreadPool* pool, SimdPath path) {
  validate_spans(spans, "adam_step: ");
  validate_hyper(hyper, "adam_step");
  check_simd_path(path, "adam_step");
  const AdamChunkFn kernel = adam_kernel(path);
  if (spans.n == 0) return;
  kernels::Coefficients coef = make_coefficients(hyper);
  coef.stream_param_out = spans.n >= kStreamParamOutMinElements;
  split_over_pool(spans.n, pool, [&](int64_t begin, int64_t end) { kernel(spans, coef, begin, end); });
}

bool all_finite(const void* grad, ScalarType grad_type, int64_t n, ThreadPool* pool, SimdPath path) {
  ZC_CHECK_ARG(n >= 0, "all_finite: n must be >= 0, got ", n);
  ZC_CHECK_ARG(n == 0 || grad != nullptr, "all_finite: grad must not be null when n > 0 (n = ", n, ")");
  ZC_CHECK_ARG(is_float_type(grad_type), "all_finite: grad_type must be float32, bfloat16 or float16, got ",
               static_cast<int>(grad_type));
  check_simd_path(path, "all_finite");
  const FiniteChunkFn kernel = finite_kernel(path);
  if (n == 0) return true;
  std::atomic<bool> found_non_finite{false};
  split_over_pool(n, pool, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; block += kFiniteBlock) {
      if (found_non_finite.load(std::memory_order_relaxed)) return;
      if (!kernel(grad, grad_type, block, std::min(end, block + kFiniteBlock))) {
        found_non_finite.store(true, std::memory_order_relaxed);
        return;
      }
    }
  });
  return !found_non_finite.load(std::memory_order_relaxed);
}

void multi_tensor_adam_step(const AdamSpans* tensors, int64_t num_tensors, const AdamHyper& hyper,
                            ThreadPool* pool, SimdPath path) {
  constexpr const char* kCaller = "multi_tensor_adam_step";
  check_tensor_list(tensors, num_tensors, kCaller);
  for (int64_t i = 0; i < num_tensors; ++i) validate_spans(tensors[i], tensor_prefix(kCaller, i));
  validate_hyper(hyper, kCaller);
  check_simd_path(path, kCaller);
  const AdamChunkFn kernel = adam_kernel(path);
  const std::vector<int64_t> offsets = span_offsets(tensors, num_tensors, kCaller);
  if (offsets.back() == 0) return;
  // Non-temporal param_out stores are decided per span, by its own size, exactly as adam_step decides.
  kernels::Coefficients cached = make_coefficients(hyper);
  cached.stream_param_out = false;
  kernels::Coefficients streamed = cached;
  streamed.stream_param_out = true;
  split_over_pool(offsets.back(), pool, [&](int64_t begin, int64_t end) {
    for_each_piece(offsets, begin, end, [&](int64_t i, int64_t local_begin, int64_t local_end) {
      const AdamSpans& spans = tensors[i];
      kernel(spans, spans.n >= kStreamParamOutMinElements ? streamed : cached, local_begin, local_end);
      return true;
    });
  });
}

bool multi_tensor_all_finite(const AdamSpans* tensors, int64_t num_tensors, ThreadPool* pool, SimdPath path) {
  constexpr const char* kCaller = "multi_tensor_all_finite";
  check_tensor_list(tensors, num_tensors, kCaller);
  for (int64_t i = 0; i < num_tensors; ++i) {
    const AdamSpans& spans = tensors[i];
    ZC_CHECK_ARG(spans.n >= 0, kCaller, ": tensors[", i, "]: n must be >= 0, got ", spans.n);
    ZC_CHECK_ARG(spans.n == 0 || spans.grad != nullptr, kCaller, ": tensors[", i,
                 "]: grad must not be null when n > 0 (n = ", spans.n, ")");
    ZC_CHECK_ARG(is_float_type(spans.grad_type), kCaller, ": tensors[", i,
                 "]: grad_type must be float32, bfloat16 or float16, got ", static_cast<int>(spans.grad_type));
  }
  check_simd_path(path, kCaller);
  const FiniteChunkFn kernel = finite_kernel(path);
  const std::vector<int64_t> offsets = span_offsets(tensors, num_tensors, kCaller);
  if (offsets.back() == 0) return true;
  std::atomic<bool> found_non_finite{false};
  split_over_pool(offsets.back(), pool, [&](int64_t begin, int64_t end) {
    for_each_piece(offsets, begin, end, [&](int64_t i, int64_t local_begin, int64_t local_end) {
      const AdamSpans& spans = tensors[i];
      for (int64_t block = local_begin; block < local_end; block += kFiniteBlock) {
        if (found_non_finite.load(std::memory_order_relaxed)) return false;
        if (!kernel(spans.grad, spans.grad_type, block, std::min(local_end, block + kFiniteBlock))) {
          found_non_finite.store(true, std::memory_order_relaxed);
          return false;
        }
      }
      return true;
    });
  });
  return !found_non_finite.load(std::memory_order_relaxed);
}

}  // namespace zerocore
