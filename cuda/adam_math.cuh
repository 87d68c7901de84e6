// The per-element Adam / AdamW update shared by the CUDA kernels. See Note [Adam arithmetic] in
// cpp/include/zerocore/adam_types.hpp.
//
// Every fp32 operation is spelled with an explicit-rounding intrinsic (__fmul_rn, __fmaf_rn, __fdiv_rn,
// __fsqrt_rn, ...) so the result does not depend on -prec-div/-prec-sqrt or FMA contraction. Do not build
// with --use_fast_math: its -ftz=true would still flush denormals. The sequence mirrors
// torch.optim.AdamW's single-tensor path as compiled by CUDA torch:
//   param.mul_(1 - lr*wd)                       p = p * decay                      (AdamW)
//   grad = grad.add(param, alpha=wd)            g = fma(wd, p, g)                  (L2 / torch.optim.Adam)
//   exp_avg.lerp_(grad, 1 - beta1)              torch's lerp (two branches on the weight)
//   exp_avg_sq.mul_(beta2)                      v = v * beta2
//             .addcmul_(grad, grad, 1 - beta2)  v = fma(1 - beta2, g * g, v)
//   denom = sqrt(exp_avg_sq) / bc2_sqrt + eps   IEEE sqrt and division (torch multiplies by 1/bc2_sqrt)
//   param.addcdiv_(exp_avg, denom, -step_size)  p = fma(-step_size, m / denom, p)
// The per-call scalars are derived in double and rounded to fp32 once (make_adam_coeffs), on the host or,
// when lr/step/grad_scale live in device memory, on the device with the same code.
#pragma once

#include <cuda_runtime.h>

namespace zerocore {
namespace cuda_detail {

enum class AdamMode { kAdamW, kL2 };

// The fp32 per-call scalars of one Adam step.
struct AdamCoeffs {
  float decay;             // 1 - lr * weight_decay (AdamW mode)
  float l2;                // weight_decay (L2 mode)
  float lerp_weight;       // 1 - beta1
  float lerp_weight_comp;  // 1 - lerp_weight, in fp32 as torch's lerp computes it
  float beta2;
  float one_minus_beta2;
  float neg_step_size;     // -(lr / (1 - beta1^step)), or -lr without bias correction
  float bc2_sqrt;          // sqrt(1 - beta2^step), or 1 without bias correction
  float eps;
  float grad_scale;
};

// Derives the fp32 scalars in double, as torch does in Python floats. step >= 1.
__host__ __device__ inline AdamCoeffs make_adam_coeffs(double lr, double beta1, double beta2, double eps,
                                                       double weight_decay, double step, double grad_scale,
                                                       bool bias_correction) {
  AdamCoeffs c;
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.l2 = static_cast<float>(weight_decay);
  c.lerp_weight = static_cast<float>(1.0 - beta1);
  c.lerp_weight_comp = 1.0f - c.lerp_weight;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  double step_size = lr;
  double bc2_sqrt = 1.0;
  if (bias_correction) {
    step_size = lr / (1.0 - ::pow(beta1, step));
    bc2_sqrt = ::sqrt(1.0 - ::pow(beta2, step));
  }
  c.neg_step_size = static_cast<float>(-step_size);
  c.bc2_sqrt = static_cast<float>(bc2_sqrt);
  c.eps = static_cast<float>(eps);
  c.grad_scale = static_cast<float>(grad_scale);
  return c;
}

// One element: updates p (fp32 master param), m (exp_avg) and v (exp_avg_sq) in place from the raw
// gradient g (already converted to fp32, not yet scaled). inf/NaN propagate as in torch.
template <AdamMode Mode>
__device__ __forceinline__ void adam_update(float& p, float& m, float& v, float g, const AdamCoeffs& c) {
  g = __fmul_rn(g, c.grad_scale);
  if constexpr (Mode == AdamMode::kAdamW) {
    p = __fmul_rn(p, c.decay);
  } else {
    g = __fmaf_rn(c.l2, p, g);
  }
  // torch's lerp: weight < 0.5 ? self + w * (end - self) : end - (end - self) * (1 - w)
  const float diff = __fsub_rn(g, m);
  m = fabsf(c.lerp_weight) < 0.5f ? __fmaf_rn(c.lerp_weight, diff, m) : __fmaf_rn(-diff, c.lerp_weight_comp, g);
  v = __fmaf_rn(c.one_minus_beta2, __fmul_rn(g, g), __fmul_rn(v, c.beta2));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.bc2_sqrt), c.eps);
  p = __fmaf_rn(c.neg_step_size, __fdiv_rn(m, denom), p);
}

}  // namespace cuda_detail
}  // namespace zerocore
