// Stages 1-2: gathers parameters' gradients into bucket buffers and reduce-scatters each bucket as soon
// as it is complete and its turn has come (Note [Bucket launch order] in ready_tracker.hpp), then
// deposits this rank's reduced shard into the caller's shard tensors.
//
// Note [Reducer memory]
// ---------------------
// Bucket buffers come from a small pool, in the reduce dtype. A bucket takes the smallest free buffer that
// holds it when its first gradient arrives and returns it once its reduce-scatter completed and its shard was
// deposited. When none fits, the oldest bucket in flight is completed first; only when nothing in flight
// frees one that fits does the pool grow, by a buffer of the second-largest bucket's size (or the bucket's
// own, for the largest), so that every bucket but the largest fits every buffer and stage 3's blocks do not
// each take a buffer of the root unit's size. (Letting two reductions travel while a third bucket fills was
// measured: no faster beyond this machine's noise, and one more bucket of peak memory.) With gradients
// arriving roughly in reverse layout order (the launch order), two or three buffers are live at a time,
// whatever the model size. A module registered after modules it runs before breaks that (Hugging Face's Llama
// and Qwen layers register their norms after the projections): the buckets of the layer fill while the one
// holding its first-run norm waits for its gradient, which comes last, so the pool grows to a layer's buckets
// (eight buffers with 2,000-element buckets on a 64-wide Llama; about three with buckets of a few layers).
// DDP rebuilds its buckets in the first iteration's arrival order for this; stages 1-2 here launch, from the
// second reducing backward on, in the order rank 0's first one completed the buckets (Note [Bucket launch
// order]), and drop the pool's buffers then: a 256-wide, 4-layer Llama with 50,000-element buckets holds 2.0 MB
// of pool from then on instead of 7.2 MB (peak_buffer_bytes keeps the first backward's).
// A pool buffer is never zeroed as a whole: each gradient is written into its slot once, scaled by the
// prescale in the same pass where the dtypes agree, and at launch only the padding and the slots of
// parameters without a gradient are zeroed (a bucket costs one pass over its gradients, not a zeroing, a copy
// and a scaling). When the reduce dtype is fp32 and the algorithm sums at the receiver (Note
// [Widening reduce-scatter]), buckets stay in the gradients' dtype (16-bit or fp32): a gradient is copied
// unscaled, and the receiver scales, sums in fp32 and deposits into the shard, bitwise as if the bucket had
// been widened and scaled first.
#pragma once

#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "comm.hpp"
#include "zerocore/ready_tracker.hpp"

namespace zerocore::bindings {

// The dtype gradient buckets travel in (Note [Widening reduce-scatter]): the gradients' own when the reduction
// is fp32, there is someone to exchange with, and the algorithm sums at the receiver (which then also scales and
// deposits); otherwise the reduce dtype. The GradReducer decides with it, and the memory estimate plans with it.
at::ScalarType reduction_wire_dtype(at::ScalarType reduce_dtype, at::ScalarType grad_dtype, int world_size,
                                    bool algorithm_widens);

struct ReducerGeometry {
  std::vector<int64_t> bucket_padded_size;  // per bucket: elements, padded (divisible by world size)
  std::vector<int64_t> param_bucket;        // per parameter: its bucket
  std::vector<int64_t> param_offset;        // per parameter: its first element inside its bucket
  std::vector<int64_t> param_numel;         // per parameter: elements
  std::vector<int64_t> launch_order;        // a permutation of the buckets
};

class GradReducer {
 public:
  // shard_destinations[b]: a tensor of bucket b's shard size that receives this rank's reduced shard.
  // prescale multiplies each bucket before the reduction (1 / world_size averages as DDP does). Without
  // overlap (DeepSpeed's overlap_comm=false) each bucket's reduction is waited for as soon as it is launched.
  // in_place[b], when defined, is bucket b's whole region of a gradient buffer that already holds the
  // gradients (stage 1, gradients in the dtype they travel in: wire_dtype()): the bucket is reduced right
  // there, with no copy in or out, and a parameter that got no gradient keeps what it accumulated there.
  // grad_dtype: the dtype of the gradients mark_ready() is handed, which sets the wire dtype; unset, the
  // destinations' (they differ where 16-bit gradients accumulate into fp32 shards).
  GradReducer(std::shared_ptr<Comm> comm, ReducerGeometry geometry, std::vector<at::Tensor> shard_destinations,
              at::ScalarType reduce_dtype, double prescale, bool overlap = true,
              std::vector<std::optional<at::Tensor>> in_place = {},
              std::optional<at::ScalarType> grad_dtype = std::nullopt);

  // Starts a backward pass whose shards are added to (accumulate) or copied over the destinations.
  // full_width: this backward hands over gradients wider than a widening wire (fp32 sums of no_sync()
  // backwards, Note [fp32 gradient accumulation] in _sharded_buffer.py), so its buckets travel in the reduce
  // dtype, reduced as without widening; every rank passes the same value.
  void begin_backward(bool accumulate, bool full_width = false);
  // Copies `grad` (undefined = no gradient, zeros) into parameter `param`'s slot and launches every bucket
  // whose turn has come.
  void mark_ready(int64_t param, const at::Tensor& grad);
  // Launches the buckets not launched yet (zeros for parameters that got no gradient), waits for all and
  // deposits every shard. The destinations are final when it returns.
  void finalize();

  bool in_backward() const { return tracker_.state() == ReadyTracker::State::kInBackward; }
  // The parameters not marked ready in this backward, in index order.
  std::vector<int64_t> unmarked_params() const;
  // Whether parameter `param` got its gradient (or a zero fill) in the backward in progress.
  bool is_marked(int64_t param) const { return tracker_.is_marked(param); }
  // The dtype buckets travel in: the reduce dtype, or the gradients' when the reduction widens them.
  at::ScalarType wire_dtype() const { return wire_dtype_; }
  int64_t buffer_bytes() const;       // bytes of the pool now
  int64_t peak_buffer_bytes() const;  // the most the pool ever held
  const ReadyTracker& tracker() const { return tracker_; }
  // The order this backward completed the buckets in (ReadyTracker::completion_order; all after finalize()).
  const std::vector<int64_t>& completion_order() const { return tracker_.completion_order(); }
  const std::vector<int64_t>& launch_order() const { return tracker_.launch_order(); }
  // Launches in `order` from the next backward on (Note [Bucket launch order]): between backwards, with nothing
  // in flight, the same order on every rank. The pool's free buffers go: the old order sized the pool.
  void set_launch_order(std::vector<int64_t> order);

 private:
  at::Tensor& ensure_buffer(int64_t bucket);
  void launch(int64_t bucket);
  void complete_oldest();

  std::shared_ptr<Comm> comm_;
  ReducerGeometry geometry_;
  std::vector<at::Tensor> destinations_;
  std::vector<at::Tensor> in_place_;  // per bucket: a gradient buffer region reduced in place, or undefined
  at::ScalarType reduce_dtype_;
  at::ScalarType wire_dtype_;
  // The receiver scales, sums in fp32 and deposits (Note [Widening reduce-scatter]); gradients travel in
  // wire_dtype_, their own dtype.
  bool widening_ = false;
  bool widening_now_ = false;           // widening_, unless this backward is full_width
  at::ScalarType bucket_dtype_;         // what this backward's pool buffers hold: wire_dtype_ or reduce_dtype_
  double prescale_;
  at::Tensor prescale_tensor_;  // prescale_ as a wrapped 0-dim CPU tensor (a scalar operand for mul_out)
  bool overlap_;
  at::TensorOptions buffer_options_;
  ReadyTracker tracker_;
  bool accumulate_ = false;

  enum class SlotState : uint8_t { kEmpty, kCopied, kScaled };  // a parameter's slot in its bucket's pool buffer
  std::vector<SlotState> slot_state_;                  // per parameter
  std::vector<std::vector<int64_t>> params_by_offset_;  // per bucket: its parameters in slot order
  std::vector<std::vector<int64_t>> bucket_cuts_;       // per bucket: where its parameters' slots begin and end
  std::vector<at::Tensor> bucket_view_;  // per bucket: its view into a pool buffer, or undefined
  std::vector<at::Tensor> bucket_base_;  // per bucket: the pool buffer the view belongs to
  std::vector<at::Tensor> free_buffers_;
  std::deque<PendingCollective> in_flight_;  // launched, in launch order
  int64_t common_bucket_ = 0;       // the second-largest bucket: the size of every pool buffer but one
  int64_t pool_bytes_ = 0;          // of every pool buffer, free or in use
  int64_t peak_pool_bytes_ = 0;
};

}  // namespace zerocore::bindings
