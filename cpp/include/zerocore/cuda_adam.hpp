// Fused Adam / AdamW and the finite-gradient check on CUDA device memory (cuda/fused_adam.cu).
// Plain C++: no CUDA header is needed to include this, so torch-free and torch code can both call it.
//
// Every function launches asynchronously on `stream` (a cudaStream_t; nullptr = the legacy default
// stream) on the *current* device, which must own every pointer. Nothing synchronises with the host, and
// no function allocates, so the launches can be captured in a CUDA graph. Arguments are validated on the
// host (InvalidArgument); a failed launch throws std::runtime_error with cudaGetErrorString's text.
// Arithmetic: Note [Adam arithmetic] in adam_types.hpp, in fp32 with IEEE sqrt and division.
#pragma once

#include <cstdint>

#include "zerocore/adam_types.hpp"

namespace zerocore {

// Optional device-resident scalars. When a pointer is non-null the kernel reads that value from device
// memory (at run time, so a captured graph picks up new values) instead of AdamHyper's host value.
struct AdamDeviceScalars {
  const float* lr = nullptr;          // overrides AdamHyper::lr
  const float* step = nullptr;        // overrides AdamHyper::step: the 1-based step after this update (>= 1);
                                      // the kernels only read it, the caller increments it
  const float* grad_scale = nullptr;  // overrides AdamHyper::grad_scale (e.g. 1 / loss scale)
  const int32_t* skip = nullptr;      // non-zero: the launch leaves every tensor untouched (e.g. the flag of a
                                      // preceding launch_check_finite on the same stream)
};

// One Adam step over one set of flat spans (any length, any element alignment; 16-byte aligned spans use
// vector loads). param, exp_avg, exp_avg_sq and param_out must not overlap one another.
void launch_fused_adam(const AdamSpans& spans, const AdamHyper& hyper, const AdamDeviceScalars& dev, void* stream);

// The same step over a list of tensors sharing the hyper-parameters, in few launches (pointer tables passed
// as kernel arguments, apex multi_tensor_apply style). Tensors may differ in length, grad_type and
// param_out/param_out_type; empty ones are skipped.
void launch_multi_tensor_adam(const AdamSpans* tensors, int64_t num_tensors, const AdamHyper& hyper,
                              const AdamDeviceScalars& dev, void* stream);

// Sets *found_nonfinite = 1 (a device int32) when any of the n gradients is inf or NaN; never clears it,
// so the caller zeroes it (e.g. cudaMemsetAsync) before the first check of a step.
void launch_check_finite(const void* grad, ScalarType grad_type, int64_t n, int32_t* found_nonfinite,
                         void* stream);

// launch_check_finite over the grad/grad_type/n of every tensor in the list (other fields are ignored).
void launch_multi_tensor_check_finite(const AdamSpans* tensors, int64_t num_tensors, int32_t* found_nonfinite,
                                      void* stream);

}  // namespace zerocore
