#include "comm.hpp"

#include "zerocore/error.hpp"

namespace zerocore::bindings {

Comm::Comm(c10::intrusive_ptr<c10d::ProcessGroup> group, const std::string& reduce_scatter_algo,
           const std::string& all_gather_algo, const StrategyOptions& options)
    : group_(std::move(group)) {
  ZC_CHECK_ARG(group_, "process_group is None");
  rank_ = group_->getRank();
  world_size_ = group_->getSize();
  reduce_scatter_ = reduce_scatter_strategies().create(reduce_scatter_algo, group_->getBackendName());
  all_gather_ = all_gather_strategies().create(all_gather_algo, group_->getBackendName());
  StrategyOptions configured = options;
  std::string why_not;
  if (world_size_ > 1 && (reduce_scatter_->wants_shared_memory() || all_gather_->wants_shared_memory())) {
    configured.shared_memory = open_shared_memory_channel(*group_, why_not);  // collective; same verdict on every rank
  }
  shared_memory_bytes_ = configured.shared_memory ? static_cast<int64_t>(configured.shared_memory->segment_bytes()) : 0;
  reduce_scatter_->configure(configured, *group_);
  all_gather_->configure(configured, *group_);
  for (const std::string& requested : {reduce_scatter_algo, all_gather_algo}) {
    ZC_CHECK_ARG(world_size_ == 1 || requested != kSharedMemoryAlgorithm || configured.shared_memory,
                 "the '", kSharedMemoryAlgorithm, "' collective algorithm is not available here: ", why_not,
                 " (Note [Shared-memory collectives]; 'auto' falls back to the backend's algorithms)");
  }
}

void Comm::check_bucket(const at::Tensor& bucket, const char* op) const {
  ZC_CHECK_ARG(bucket.dim() == 1 && bucket.is_contiguous(), op, ": the bucket must be a contiguous 1-D tensor");
  ZC_CHECK_ARG(bucket.numel() % world_size_ == 0, op, ": bucket of ", bucket.numel(),
               " elements does not split into ", world_size_, " equal shards");
}

void Comm::record(const std::string& op, int64_t tag, int64_t elements, int64_t algorithm_bytes,
                  int64_t backend_calls, int64_t unquantized_bytes) {
  CollectiveStats& s = stats_[op];
  s.calls += 1;
  s.logical_elements += elements;
  s.algorithm_bytes += algorithm_bytes;
  s.backend_calls += backend_calls;
  s.unquantized_bytes += unquantized_bytes;
  if (logging_) log_.push_back(op + ":" + std::to_string(tag) + ":" + std::to_string(elements));
}

PendingCollective Comm::issue_bucket(CollectiveStrategy& strategy, const char* op, const at::Tensor& bucket,
                                     int64_t tag, const std::string& label, const std::optional<WidenedSum>& widen,
                                     std::vector<int64_t> cuts) {
  check_bucket(bucket, op);
  const int64_t n = bucket.numel();
  for (size_t i = 0; i < cuts.size(); ++i) {
    ZC_CHECK_ARG(cuts[i] >= 0 && cuts[i] <= n && (i == 0 || cuts[i - 1] < cuts[i]), op,
                 ": cuts must be increasing offsets within the bucket of ", n, " elements");
  }
  const BucketCollective geometry{bucket, rank_, world_size_, n, n / world_size_, n * bucket.element_size(),
                                  std::move(cuts)};
  if (world_size_ == 1 || n == 0) {  // nothing to exchange; every rank skips alike (same geometry)
    record(label, tag, n, 0, 0, 0);
    PendingCollective nothing;
    nothing.buffer = bucket;
    nothing.tag = tag;
    if (widen) nothing.widen_into(geometry.local_shard(), *widen);  // the sum over one rank: widened, scaled, deposited
    return nothing;
  }
  // `widen` comes only from reduce_scatter_widened, whose strategy is the reduce-scatter one
  IssuedCollective issued =
      widen ? static_cast<ReduceScatterStrategy&>(strategy).issue_widening(*group_, geometry, *widen)
            : strategy.issue(*group_, geometry);
  issued.pending.tag = tag;
  const int64_t ring_bytes = geometry.bytes * (world_size_ - 1) / world_size_;
  record(label, tag, n, issued.algorithm_bytes, issued.backend_calls,
         issued.quantized ? ring_bytes : issued.algorithm_bytes);
  return std::move(issued.pending);
}

PendingCollective Comm::reduce_scatter(const at::Tensor& bucket, int64_t tag, std::vector<int64_t> cuts) {
  return issue_bucket(*reduce_scatter_, ReduceScatterStrategy::kOp, bucket, tag, ReduceScatterStrategy::kOp,
                      std::nullopt, std::move(cuts));
}

PendingCollective Comm::reduce_scatter_widened(const at::Tensor& bucket, const WidenedSum& into, int64_t tag) {
  ZC_CHECK_ARG(reduce_scatter_->widens(), "reduce_scatter algorithm '", reduce_scatter_->name(),
               "' sums inside the backend and cannot sum in a wider dtype than the bucket's");
  ZC_CHECK_ARG(bucket.scalar_type() == at::kBFloat16 || bucket.scalar_type() == at::kHalf ||
                   bucket.scalar_type() == at::kFloat,
               "reduce_scatter_widened sums 16-bit or fp32 buckets in fp32; got a ", bucket.scalar_type(), " bucket");
  const at::Tensor& d = into.destination;
  ZC_CHECK_ARG(d.defined() && d.dim() == 1 && d.is_contiguous() && c10::isFloatingType(d.scalar_type()) &&
                   d.numel() * world_size_ == bucket.numel() && d.device() == bucket.device(),
               "reduce_scatter_widened: the destination must be a contiguous 1-D floating tensor of the shard's ",
               bucket.numel() / world_size_, " elements on the bucket's device");
  return issue_bucket(*reduce_scatter_, ReduceScatterStrategy::kOp, bucket, tag, ReduceScatterStrategy::kOp, into);
}

PendingCollective Comm::all_gather(const at::Tensor& bucket, int64_t tag, const std::string& label,
                                   std::vector<int64_t> cuts) {
  return issue_bucket(*all_gather_, AllGatherStrategy::kOp, bucket, tag, label, std::nullopt, std::move(cuts));
}

PendingCollective Comm::all_reduce(const at::Tensor& tensor, bool max, int64_t tag) {
  PendingCollective pending;
  pending.buffer = tensor;
  pending.tag = tag;
  const int64_t bytes = tensor.numel() * tensor.element_size();
  if (world_size_ > 1) {
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
    pending.works.push_back(group_->allreduce(tensors, options));
  }
  const int64_t sent = world_size_ > 1 ? 2 * bytes * (world_size_ - 1) / world_size_ : 0;
  record("all_reduce", tag, tensor.numel(), sent, world_size_ > 1 ? 1 : 0, sent);
  return pending;
}

PendingCollective Comm::broadcast(const at::Tensor& tensor, int root, int64_t tag) {
  ZC_CHECK_ARG(root >= 0 && root < world_size_, "broadcast root must be in [0, ", world_size_, "), got ", root);
  PendingCollective pending;
  pending.buffer = tensor;
  pending.tag = tag;
  if (world_size_ > 1) {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    pending.works.push_back(group_->broadcast(tensors, options));
  }
  const int64_t sent = world_size_ > 1 ? tensor.numel() * tensor.element_size() : 0;
  record("broadcast", tag, tensor.numel(), sent, world_size_ > 1 ? 1 : 0, sent);
  return pending;
}

}  // namespace zerocore::bindings
