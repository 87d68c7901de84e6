// Adam / AdamW on raw CPU spans, SIMD per ISA and split over a ThreadPool. See Note [Adam arithmetic].
#pragma once

#include <cstdint>

#include "zerocore/adam_types.hpp"
#include "zerocore/simd.hpp"
#include "zerocore/thread_pool.hpp"

namespace zerocore {

// One Adam step over the spans, split across `pool` (nullptr: the calling thread only) on `path`.
// Throws InvalidArgument for bad hyper-parameters or spans.
void adam_step(const AdamSpans& spans, const AdamHyper& hyper, ThreadPool* pool, SimdPath path);

// True when every one of the n gradients is finite. Reads only the gradients.
bool all_finite(const void* grad, ScalarType grad_type, int64_t n, ThreadPool* pool, SimdPath path);

// adam_step over each of the num_tensors spans, in one call: the results are bit for bit those of calling
// adam_step on every span, but the work is split over `pool` once, as one index space (the spans end to
// end; each thread takes one contiguous, 64-element-aligned range of it). Spans may differ in length (0 is
// fine), grad_type and param_out/param_out_type; no two spans' buffers may overlap. Every span is
// validated (errors name its index) before anything is written.
void multi_tensor_adam_step(const AdamSpans* tensors, int64_t num_tensors, const AdamHyper& hyper,
                            ThreadPool* pool, SimdPath path);

// True when every gradient of every span is finite. Reads only grad, grad_type and n of each span.
bool multi_tensor_all_finite(const AdamSpans* tensors, int64_t num_tensors, ThreadPool* pool, SimdPath path);

}  // namespace zerocore
