#include "grad_reducer.hpp"

#include <algorithm>

#include <ATen/ScalarOps.h>

#include "zerocore/bucket_geometry.hpp"
#include "zerocore/error.hpp"

namespace zerocore::bindings {

at::ScalarType reduction_wire_dtype(at::ScalarType reduce_dtype, at::ScalarType grad_dtype, int world_size,
                                    bool algorithm_widens) {
  const bool summable = grad_dtype == at::kBFloat16 || grad_dtype == at::kHalf || grad_dtype == at::kFloat;
  return world_size > 1 && reduce_dtype == at::kFloat && algorithm_widens && summable ? grad_dtype : reduce_dtype;
}

GradReducer::GradReducer(std::shared_ptr<Comm> comm, ReducerGeometry geometry,
                         std::vector<at::Tensor> shard_destinations, at::ScalarType reduce_dtype, double prescale,
                         bool overlap, std::vector<std::optional<at::Tensor>> in_place,
                         std::optional<at::ScalarType> grad_dtype)
    : comm_(std::move(comm)),
      geometry_(std::move(geometry)),
      destinations_(std::move(shard_destinations)),
      reduce_dtype_(reduce_dtype),
      wire_dtype_(reduce_dtype),
      bucket_dtype_(reduce_dtype),
      prescale_(prescale),
      prescale_tensor_(at::native::wrapped_scalar_tensor(prescale)),
      overlap_(overlap),
      tracker_(geometry_.param_bucket, static_cast<int64_t>(geometry_.bucket_padded_size.size()),
               geometry_.launch_order) {
  const size_t buckets = geometry_.bucket_padded_size.size();
  const size_t params = geometry_.param_bucket.size();
  ZC_CHECK_ARG(destinations_.size() == buckets, "shard_destinations must hold one tensor per bucket (", buckets,
               "), got ", destinations_.size());
  ZC_CHECK_ARG(geometry_.param_offset.size() == params && geometry_.param_numel.size() == params,
               "param_offset and param_numel must have one entry per parameter (", params, ")");
  const int world = comm_->world_size();
  for (size_t b = 0; b < buckets; ++b) {
    const int64_t padded = geometry_.bucket_padded_size[b];
    ZC_CHECK_ARG(padded % world == 0, "bucket ", b, " of ", padded, " elements is not divisible by world size ",
                 world);
    ZC_CHECK_ARG(destinations_[b].numel() == padded / world && destinations_[b].is_contiguous(),
                 "shard_destinations[", b, "] must be a contiguous tensor of ", padded / world, " elements");
  }
  for (size_t i = 0; i < params; ++i) {
    const int64_t b = geometry_.param_bucket[i];
    ZC_CHECK_ARG(geometry_.param_offset[i] >= 0 &&
                     geometry_.param_offset[i] + geometry_.param_numel[i] <= geometry_.bucket_padded_size[b],
                 "parameter ", i, " does not fit inside bucket ", b);
  }
  // Where the algorithm sums at the receiver, it also scales and deposits there (one pass fewer over every
  // bucket), and 16-bit gradients reduced in fp32 travel in 16 bits (Note [Widening reduce-scatter]).
  if (!destinations_.empty() && world > 1 && reduce_dtype_ == at::kFloat && comm_->reduce_scatter_widens()) {
    const at::ScalarType deposits = destinations_.front().scalar_type();
    const at::ScalarType grads = grad_dtype.value_or(deposits);
    bool uniform = true;
    for (const at::Tensor& d : destinations_) uniform = uniform && d.scalar_type() == deposits;
    if (uniform) wire_dtype_ = reduction_wire_dtype(reduce_dtype_, grads, world, true);
    widening_ = uniform && wire_dtype_ == grads;
  }
  widening_now_ = widening_;
  bucket_dtype_ = wire_dtype_;
  ZC_CHECK_ARG(in_place.empty() || in_place.size() == buckets, "in_place must be empty or hold one entry per bucket (",
               buckets, "), got ", in_place.size());
  in_place_.resize(buckets);
  for (size_t b = 0; b < in_place.size(); ++b) {
    if (!in_place[b]) continue;
    const at::Tensor& region = *in_place[b];
    ZC_CHECK_ARG(region.dim() == 1 && region.is_contiguous() && region.numel() == geometry_.bucket_padded_size[b] &&
                     region.scalar_type() == wire_dtype_,
                 "in_place[", b, "] must be a contiguous 1-D ", wire_dtype_, " tensor of ",
                 geometry_.bucket_padded_size[b], " elements (the dtype gradients travel in)");
    const int64_t shard = geometry_.bucket_padded_size[b] / world;
    ZC_CHECK_ARG(destinations_[b].data_ptr() == region.narrow(0, comm_->rank() * shard, shard).data_ptr(),
                 "in_place[", b, "]: this rank's shard of it must be shard_destinations[", b, "]");
    in_place_[b] = region;
  }
  // (their device: each pool buffer names its dtype, bucket_dtype_)
  buffer_options_ = destinations_.empty() ? at::TensorOptions() : destinations_.front().options();
  bucket_view_.resize(buckets);
  bucket_base_.resize(buckets);
  // Every bucket but the largest fits a buffer of the second-largest size: the pool then needs one buffer of
  // the largest size at most, whatever order the buckets fill in (stage 3: the root unit and the blocks).
  std::vector<int64_t> sizes(geometry_.bucket_padded_size);
  std::sort(sizes.begin(), sizes.end());
  common_bucket_ = sizes.size() >= 2 ? sizes[sizes.size() - 2] : (sizes.empty() ? 0 : sizes.back());
  slot_state_.assign(params, SlotState::kEmpty);
  params_by_offset_.resize(buckets);
  for (size_t i = 0; i < params; ++i) params_by_offset_[geometry_.param_bucket[i]].push_back(static_cast<int64_t>(i));
  for (auto& in_bucket : params_by_offset_) {
    std::sort(in_bucket.begin(), in_bucket.end(),
              [this](int64_t a, int64_t b) { return geometry_.param_offset[a] < geometry_.param_offset[b]; });
  }
  // where each parameter's slot begins and ends: a quantizing reduce-scatter (qgZ) gives no two parameters one
  // scale (Note [Quantized collectives])
  bucket_cuts_ = bucket_cuts(static_cast<int64_t>(buckets), geometry_.param_bucket, geometry_.param_offset,
                             geometry_.param_numel);
}

void GradReducer::begin_backward(bool accumulate, bool full_width) {
  ZC_CHECK(in_flight_.empty(), "begin_backward() while reductions of the previous backward are in flight; "
                               "finalize() must run at the end of every backward");
  tracker_.reset();
  accumulate_ = accumulate;
  widening_now_ = widening_ && !full_width;
  const at::ScalarType dtype = widening_now_ ? wire_dtype_ : reduce_dtype_;
  if (dtype != bucket_dtype_) {  // the pool's buffers of the other dtype would only be kept for later
    for (const at::Tensor& buffer : free_buffers_) pool_bytes_ -= buffer.numel() * buffer.element_size();
    free_buffers_.clear();
    bucket_dtype_ = dtype;
  }
}

at::Tensor& GradReducer::ensure_buffer(int64_t bucket) {
  at::Tensor& view = bucket_view_[bucket];
  if (view.defined()) return view;
  if (in_place_[bucket].defined()) {  // the gradients are already there: no pool buffer, no zeroing
    view = in_place_[bucket];
    return view;
  }
  const int64_t need = geometry_.bucket_padded_size[bucket];
  auto smallest_fitting = [&]() {
    int64_t best = -1;
    for (size_t i = 0; i < free_buffers_.size(); ++i) {
      const int64_t size = free_buffers_[i].numel();
      if (size >= need && (best < 0 || size < free_buffers_[best].numel())) best = static_cast<int64_t>(i);
    }
    return best;
  };
  int64_t found = smallest_fitting();
  while (found < 0 && !in_flight_.empty()) {  // Note [Reducer memory]
    complete_oldest();
    found = smallest_fitting();
  }
  at::Tensor base;
  if (found >= 0) {
    base = std::move(free_buffers_[found]);
    free_buffers_.erase(free_buffers_.begin() + found);
  } else {
    const int64_t size = std::max(need, common_bucket_);
    base = at::empty({size}, buffer_options_.dtype(bucket_dtype_));
    pool_bytes_ += size * static_cast<int64_t>(c10::elementSize(bucket_dtype_));
    peak_pool_bytes_ = std::max(peak_pool_bytes_, pool_bytes_);
  }
  view = base.narrow(0, 0, need);
  // Not zeroed: every slot is written once (by its gradient, or by launch()'s zeros), and launch() zeroes
  // the padding (Note [Reducer memory]).
  for (int64_t param : params_by_offset_[bucket]) slot_state_[param] = SlotState::kEmpty;
  bucket_base_[bucket] = std::move(base);
  return view;
}

void GradReducer::mark_ready(int64_t param, const at::Tensor& grad) {
  // Everything that can reject this call is checked before a buffer is taken or the gradient is copied: a
  // rejected duplicate must not overwrite the gradient already in the slot.
  tracker_.check_can_mark(param);
  ZC_CHECK_ARG(!grad.defined() || grad.numel() == geometry_.param_numel[param], "gradient of parameter ", param,
               " has ", grad.numel(), " elements, expected ", geometry_.param_numel[param]);
  const int64_t bucket = geometry_.param_bucket[param];
  at::Tensor& view = ensure_buffer(bucket);
  if (grad.defined()) {
    at::Tensor slot = view.narrow(0, geometry_.param_offset[param], geometry_.param_numel[param]);
    if (grad.data_ptr() != slot.data_ptr()) {  // in place: already there, scaled at launch with the bucket
      // One pass where the dtypes agree (the product is computed in the reduce dtype either way, so the
      // values are those of a copy followed by the scaling); a widening copy is scaled at launch instead.
      if (prescale_ != 1.0 && grad.scalar_type() == reduce_dtype_ && !widening_now_) {
        // The prescale as a tensor: mul_out with a Scalar is a composite that multiplies into a fresh
        // tensor and copies that into `slot` (a gradient-sized allocation, its page faults and a second pass
        // for every gradient); with a 0-dim tensor the kernel writes into `slot` directly, computing the
        // same products in the gradient's dtype.
        at::mul_out(slot, grad.reshape({-1}), prescale_tensor_);
        slot_state_[param] = SlotState::kScaled;
      } else {
        slot.copy_(grad.reshape({-1}));
        slot_state_[param] = SlotState::kCopied;
      }
    }
  }
  std::vector<int64_t> ready;
  tracker_.mark_ready(param, ready);
  for (int64_t b : ready) launch(b);
}

void GradReducer::launch(int64_t bucket) {
  at::Tensor& view = ensure_buffer(bucket);
  if (in_place_[bucket].defined()) {
    if (prescale_ != 1.0 && !widening_now_) view.mul_(prescale_);  // widening: the receiver scales
  } else {
    // A pool buffer: its padding and the slots of parameters without a gradient reduce as zeros, copied
    // gradients are scaled now.
    int64_t cursor = 0;
    for (int64_t param : params_by_offset_[bucket]) {
      const int64_t offset = geometry_.param_offset[param];
      const int64_t numel = geometry_.param_numel[param];
      if (offset > cursor) view.narrow(0, cursor, offset - cursor).zero_();
      at::Tensor slot = view.narrow(0, offset, numel);
      if (slot_state_[param] == SlotState::kEmpty) {
        slot.zero_();
      } else if (slot_state_[param] == SlotState::kCopied && prescale_ != 1.0 && !widening_now_) {
        slot.mul_(prescale_);
      }
      cursor = std::max(cursor, offset + numel);
    }
    if (view.numel() > cursor) view.narrow(0, cursor, view.numel() - cursor).zero_();
  }
  // widening: wait() deposits the fp32 sums straight into the destination (Note [Widening reduce-scatter])
  in_flight_.push_back(widening_now_ ? comm_->reduce_scatter_widened(
                                       view, WidenedSum{destinations_[bucket], prescale_, accumulate_}, bucket)
                                 : comm_->reduce_scatter(view, bucket, bucket_cuts_[bucket]));
  if (!overlap_) complete_oldest();
}

void GradReducer::complete_oldest() {
  PendingCollective pending = std::move(in_flight_.front());
  in_flight_.pop_front();
  pending.wait();
  const int64_t bucket = pending.tag;
  at::Tensor& view = bucket_view_[bucket];
  const int64_t shard = view.numel() / comm_->world_size();
  if (!widening_now_) {  // a widening reduce-scatter's wait() has deposited the shard already
    const at::Tensor reduced = view.narrow(0, comm_->rank() * shard, shard);
    if (accumulate_) {
      destinations_[bucket].add_(reduced);
    } else if (destinations_[bucket].data_ptr() != reduced.data_ptr()) {
      destinations_[bucket].copy_(reduced);
    }
  }
  view = at::Tensor();
  if (bucket_base_[bucket].defined()) free_buffers_.push_back(std::move(bucket_base_[bucket]));
}

void GradReducer::finalize() {
  std::vector<int64_t> remaining;
  std::vector<int64_t> unmarked;
  tracker_.finalize(remaining, unmarked);
  for (int64_t bucket : remaining) launch(bucket);
  while (!in_flight_.empty()) complete_oldest();
}

std::vector<int64_t> GradReducer::unmarked_params() const {
  std::vector<int64_t> unmarked;
  for (int64_t param = 0; param < tracker_.num_params(); ++param) {
    if (!tracker_.is_marked(param)) unmarked.push_back(param);
  }
  return unmarked;
}

void GradReducer::set_launch_order(std::vector<int64_t> order) {
  ZC_CHECK(in_flight_.empty() && !in_backward(), "set_launch_order() during a backward; call it after finalize()");
  tracker_.set_launch_order(std::move(order));
  for (const at::Tensor& buffer : free_buffers_) pool_bytes_ -= buffer.numel() * buffer.element_size();
  free_buffers_.clear();
}

int64_t GradReducer::buffer_bytes() const { return pool_bytes_; }

int64_t GradReducer::peak_buffer_bytes() const { return peak_pool_bytes_; }

}  // namespace zerocore::bindings
