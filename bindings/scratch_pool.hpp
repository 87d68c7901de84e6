// Scratch memory that a strategy's collectives use while in flight, reused from one collective to the next.
//
// Note [Scratch reuse]
// --------------------
// A point-to-point reduce-scatter receives W-1 peers' shards into scratch memory before it sums them. Fresh
// CPU memory of a bucket's size costs a page fault per 4 KiB page on first touch every time it is allocated
// again (glibc returns large blocks to the kernel when they are freed): at DDP's 25 MiB buckets that is
// thousands of faults a bucket, and a few percent of a step on a 2-core machine. So each strategy keeps the
// scratch tensors it handed out and hands one out again once no collective holds it any more (its storage's
// only owner is the pool); at most `kCached` are kept, the rest are allocated and freed as before. On an
// accelerator the caching allocator already reuses memory, so the pool hands out plain allocations there.
#pragma once

#include <cstddef>
#include <vector>

#include <torch/extension.h>

namespace zerocore::bindings {

class ScratchPool {
 public:
  static constexpr size_t kCached = 4;

  // An uninitialized contiguous tensor of `sizes` with `options`.
  at::Tensor take(at::IntArrayRef sizes, const at::TensorOptions& options) {
    int64_t numel = 1;
    for (int64_t s : sizes) numel *= s;
    if (!options.device().is_cpu()) return at::empty(sizes, options);
    int replaceable = -1;
    for (size_t i = 0; i < cached_.size(); ++i) {
      at::Tensor& held = cached_[i];
      if (held.storage().use_count() != 1) continue;  // a collective in flight still uses it
      if (held.scalar_type() == options.dtype().toScalarType() && held.numel() >= numel) {
        return held.narrow(0, 0, numel).view(sizes);
      }
      replaceable = static_cast<int>(i);
    }
    at::Tensor fresh = at::empty({numel}, options);
    if (cached_.size() < kCached) {
      cached_.push_back(fresh);
    } else if (replaceable >= 0) {
      cached_[replaceable] = fresh;  // a free one too small or of another dtype gives way to the new size
    }
    return fresh.view(sizes);
  }

 private:
  std::vector<at::Tensor> cached_;
};

}  // namespace zerocore::bindings
