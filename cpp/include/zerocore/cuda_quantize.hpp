// Symmetric blockwise int8 / int4 quantization on CUDA device memory (cuda/quantize.cu): the bytes of
// zerocore/quantize.hpp's CPU kernels (Note [Quantization arithmetic]), q, scales and dequantized values alike.
// Plain C++: no CUDA header is needed to include this, so torch-free and torch code can both call it.
//
// Both functions launch asynchronously on `stream` (a cudaStream_t; nullptr = the legacy default stream) on
// the *current* device, which must own every pointer. Nothing synchronises with the host and nothing is
// allocated, so the launches can be captured in a CUDA graph. Arguments are validated on the host
// (InvalidArgument: the CPU functions' check_quantize_args, then the pointers); a failed launch throws std::runtime_error with
// cudaGetErrorString's text.
#pragma once

#include <cstdint>

#include "zerocore/adam_types.hpp"

namespace zerocore {

// Quantizes input[0, n) (in_dtype) into q (quantized_bytes(n, bits) bytes) and scales
// (quantize_num_groups(n, group_size) floats). `nonfinite` is a device array of two int64 that the launch
// first resets (on the stream) and the kernel then fills: nonfinite[0] = how many inputs are inf or NaN,
// nonfinite[1] = the smallest such index (meaningless when nonfinite[0] == 0). As on the CPU, a group with
// a non-finite input gets scale NaN and q = 0; the caller reads nonfinite and must raise when it is not 0.
void launch_quantize_symmetric(const void* input, ScalarType in_dtype, int64_t n, int bits, int64_t group_size,
                               uint8_t* q, float* scales, int64_t* nonfinite, void* stream);

// Writes q_i * scale_g (fp32, then rounded to nearest even to out_dtype) for i in [0, n) into out, and
// nothing else (out may be a slice of a larger buffer). A NaN scale gives the dtype's canonical quiet NaN.
void launch_dequantize_symmetric(const uint8_t* q, const float* scales, int64_t n, int bits, int64_t group_size,
                                 void* out, ScalarType out_dtype, void* stream);

}  // namespace zerocore
