// The quantization kernels on tensors' memory, on the tensors' device (the CPU's SIMD core or CUDA on torch's
// current stream), for C++ callers that have checked their arguments: the _C.quantize / _C.dequantize
// bindings and the quantized collective strategies. Call without the GIL.
#pragma once

#include <cstdint>

#include <torch/extension.h>

#include "zerocore/quantize.hpp"

namespace zerocore::bindings {

// Quantizes input (contiguous fp32/bf16/fp16, input.numel() elements) into q (quantized_bytes bytes) and
// scales (one fp32 per group), both on input's device. On CUDA it synchronises with the current stream to
// read the non-finite count back, unless `read_back` is false (then the result says nothing: the collectives,
// whose non-finite groups arrive as NaN anyway, quantize many pieces and need no sync per piece).
QuantizeResult quantize_tensor(const at::Tensor& input, int bits, int64_t group_size, uint8_t* q, float* scales,
                               bool read_back = true);

// Writes the n values q * scale into out (contiguous fp32/bf16/fp16, n elements, on q's device).
void dequantize_into(const uint8_t* q, const float* scales, int64_t n, int bits, int64_t group_size,
                     const at::Tensor& out);

}  // namespace zerocore::bindings
