// The portable Adam kernel: plain C++ compiled without ISA flags. Where the SIMD paths use an FMA (torch's
// lerp, addcmul, the L2 add and the decayed update), this path forms the product exactly in double and
// rounds the sum back to fp32, which equals the FMA result except in rare double-rounding ties. Without
// that, the extra roundings push its moment errors noticeably above torch's (see Note [Adam arithmetic]).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_adam_kernels.hpp"

namespace zerocore {
namespace kernels {
namespace {

enum class OutKind { kNone, kBFloat16, kFloat16 };

template <ScalarType kGrad>
inline float load_grad(const void* grad, int64_t i) {
  if constexpr (kGrad == ScalarType::kFloat32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (kGrad == ScalarType::kBFloat16) {
    return bf16_to_float(static_cast<const uint16_t*>(grad)[i]);
  } else {
    return half_to_float(static_cast<const uint16_t*>(grad)[i]);
  }
}

// a * b + c with the product exact (24-bit significands multiply exactly in double) and the sum rounded
// twice, to double and then to fp32.
inline float fused_multiply_add(float a, float b, float c) {
  return static_cast<float>(static_cast<double>(a) * static_cast<double>(b) + static_cast<double>(c));
}

// The element loop, mirroring torch's single-tensor AdamW sequence operation by operation.
template <ScalarType kGrad, OutKind kOut, bool kL2>
void adam_chunk(const AdamSpans& spans, const Coefficients& coef, int64_t begin, int64_t end) {
  float* __restrict param = spans.param;
  float* __restrict exp_avg = spans.exp_avg;
  float* __restrict exp_avg_sq = spans.exp_avg_sq;
  uint16_t* __restrict param_out = static_cast<uint16_t*>(spans.param_out);
  const void* grad = spans.grad;
  // Local copies let the compiler keep the coefficients in registers despite the stores.
  const Coefficients c = coef;
  for (int64_t i = begin; i < end; ++i) {
    float g = load_grad<kGrad>(grad, i) * c.grad_scale;
    float p = param[i];
    if constexpr (kL2) g = fused_multiply_add(c.l2_weight_decay, p, g);  // Adam: grad.add(param, alpha=wd)
    float m = exp_avg[i];
    m = fused_multiply_add(c.one_minus_beta1, g - m, m);  // exp_avg.lerp_(grad, 1 - beta1)
    float v = exp_avg_sq[i];
    v = fused_multiply_add(c.one_minus_beta2 * g, g, v * c.beta2);  // mul_(beta2).addcmul_(g, g, 1 - beta2)
    const float denom = std::sqrt(v) / c.bias_correction2_sqrt + c.eps;
    const float update = c.neg_step_size * m / denom;      // addcdiv_(exp_avg, denom, -step_size)
    p = fused_multiply_add(p, c.decay, update);           // AdamW's param.mul_(1 - lr * wd), fused
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (kOut == OutKind::kBFloat16) param_out[i] = float_to_bf16_rne(p);
    if constexpr (kOut == OutKind::kFloat16) param_out[i] = float_to_half_rne(p);
  }
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

// Non-finite means all exponent bits set. The block loop is branch-free so it vectorizes; the check
// between blocks gives the early exit.
template <typename Bits>
bool all_finite_bits(const Bits* data, Bits exponent_mask, int64_t begin, int64_t end) {
  constexpr int64_t kBlock = 4096;
  for (int64_t block = begin; block < end; block += kBlock) {
    const int64_t block_end = std::min(end, block + kBlock);
    Bits bad = 0;
    for (int64_t i = block; i < block_end; ++i) bad |= static_cast<Bits>((data[i] & exponent_mask) == exponent_mask);
    if (bad != 0) return false;
  }
  return true;
}

}  // namespace

void adam_chunk_scalar(const AdamSpans& spans, const Coefficients& coef, int64_t begin, int64_t end) {
  switch (spans.grad_type) {
    case ScalarType::kFloat32: return adam_chunk_out<ScalarType::kFloat32>(spans, coef, begin, end);
    case ScalarType::kBFloat16: return adam_chunk_out<ScalarType::kBFloat16>(spans, coef, begin, end);
    case ScalarType::kFloat16: return adam_chunk_out<ScalarType::kFloat16>(spans, coef, begin, end);
  }
}

bool all_finite_chunk_scalar(const void* grad, ScalarType type, int64_t begin, int64_t end) {
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
