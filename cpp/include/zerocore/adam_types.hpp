// Arguments shared by the CPU and CUDA Adam kernels.
// Note [Adam arithmetic]
// ----------------------
// Per element, with g = grad * grad_scale (and g += weight_decay * p in L2 mode):
//   p       *= 1 - lr * weight_decay                       (AdamW / decoupled mode only)
//   m        = m + (1 - beta1) * (g - m)                   (torch's lerp)
//   v        = beta2 * v + (1 - beta2) * g * g
//   denom    = sqrt(v) / sqrt(1 - beta2^step) + eps        (bias correction off: sqrt(v) + eps)
//   p       -= lr / (1 - beta1^step) * m / denom           (bias correction off: lr * m / denom)
// which is torch.optim.AdamW's (and, in L2 mode, torch.optim.Adam's) single-tensor formula. Bias-correction
// factors are computed in double once per call. NaN/inf in gradients propagate as in torch.
#pragma once

#include <cstdint>

namespace zerocore {

enum class ScalarType { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Whether `type` is one of the values above: a ScalarType cast from an int (by the bindings, say) may not be.
constexpr bool is_float_type(ScalarType type) {
  return type == ScalarType::kFloat32 || type == ScalarType::kBFloat16 || type == ScalarType::kFloat16;
}

struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw = true;            // decoupled weight decay (AdamW); false: L2 added to the gradient (Adam)
  bool bias_correction = true;
  int64_t step = 1;             // 1-based step count after this update; must be >= 1
  double grad_scale = 1.0;      // multiplies the gradient before anything else
};

struct AdamSpans {
  float* param = nullptr;            // fp32 master params, updated in place
  const void* grad = nullptr;        // gradients of type grad_type
  ScalarType grad_type = ScalarType::kFloat32;
  float* exp_avg = nullptr;          // fp32 first moment, updated in place
  float* exp_avg_sq = nullptr;       // fp32 second moment, updated in place
  void* param_out = nullptr;         // optional: receives the updated params as param_out_type
  ScalarType param_out_type = ScalarType::kBFloat16;  // kBFloat16 or kFloat16 (round to nearest even)
  int64_t n = 0;                     // elements in every span
};

}  // namespace zerocore
