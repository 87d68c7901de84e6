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

}  // namespace zerocore
