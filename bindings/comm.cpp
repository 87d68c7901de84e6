#include "comm.hpp"

#include "zerocore/error.hpp"

namespace zerocore::bindings {

void PendingCollective::wait() {
  for (auto& work : works) {
    if (work) work->wait();
  }
  works.clear();
  if (result.defined()) {
    destination.copy_(result);
    result = at::Tensor();
    destination = at::Tensor();
  }
}

namespace {

bool is_gloo(const std::string& backend) { return backend == "gloo"; }

ReduceScatterAlgo parse_rs(const std::string& name, const std::string& backend) {
  if (name == "auto") return is_gloo(backend) ? ReduceScatterAlgo::kAllReduce : ReduceScatterAlgo::kReduceScatter;
  if (name == "reduce_scatter") return ReduceScatterAlgo::kReduceScatter;
  if (name == "all_reduce") return ReduceScatterAlgo::kAllReduce;
  throw InvalidArgument("reduce_scatter algorithm must be 'auto', 'reduce_scatter' or 'all_reduce', got '" + name +
                        "'");
}

AllGatherAlgo parse_ag(const std::string& name, const std::string& backend) {
  if (name == "auto") return is_gloo(backend) ? AllGatherAlgo::kBroadcast : AllGatherAlgo::kAllGather;
  if (name == "all_gather") return AllGatherAlgo::kAllGather;
  if (name == "broadcast") return AllGatherAlgo::kBroadcast;
  if (name == "all_reduce") return AllGatherAlgo::kAllReduce;
  throw InvalidArgument("all_gather algorithm must be 'auto', 'all_gather', 'broadcast' or 'all_reduce', got '" +
                        name + "'");
}

}  // namespace

Comm::Comm(c10::intrusive_ptr<c10d::ProcessGroup> group, const std::string& reduce_scatter_algo,
           const std::string& all_gather_algo)
    : group_(std::move(group)) {
  ZC_CHECK_ARG(group_, "process_group is None");
  rank_ = group_->getRank();
  world_size_ = group_->getSize();
  rs_algo_ = parse_rs(reduce_scatter_algo, group_->getBackendName());
  ag_algo_ = parse_ag(all_gather_algo, group_->getBackendName());
}

std::string Comm::reduce_scatter_algo() const {
  return rs_algo_ == ReduceScatterAlgo::kAllReduce ? "all_reduce" : "reduce_scatter";
}

std::string Comm::all_gather_algo() const {
  switch (ag_algo_) {
    case AllGatherAlgo::kAllGather: return "all_gather";
    case AllGatherAlgo::kBroadcast: return "broadcast";
    case AllGatherAlgo::kAllReduce: return "all_reduce";
  }
  return "unknown";
}

void Comm::check_bucket(const at::Tensor& bucket, const char* op) const {
  ZC_CHECK_ARG(bucket.dim() == 1 && bucket.is_contiguous(), op, ": the bucket must be a contiguous 1-D tensor");
  ZC_CHECK_ARG(bucket.numel() % world_size_ == 0, op, ": bucket of ", bucket.numel(),
               " elements does not split into ", world_size_, " equal shards");
}

void Comm::record(const std::string& op, int64_t tag, int64_t elements, int64_t algorithm_bytes,
                  int64_t backend_calls) {
  CollectiveStats& s = stats_[op];
  s.calls += 1;
  s.logical_elements += elements;
  s.algorithm_bytes += algorithm_bytes;
  s.backend_calls += backend_calls;
  if (logging_) log_.push_back(op + ":" + std::to_string(tag) + ":" + std::to_string(elements));
}

PendingCollective Comm::reduce_scatter(const at::Tensor& bucket, int64_t tag) {
  check_bucket(bucket, "reduce_scatter");
  PendingCollective pending{{}, bucket, tag};
  const int64_t n = bucket.numel();
  const int64_t shard = n / world_size_;
  const int64_t bytes = n * bucket.element_size();
  if (world_size_ == 1 || n == 0) {  // nothing to exchange; every rank skips alike (same geometry)
    record("reduce_scatter", tag, n, 0, 0);
    return pending;
  }
  if (rs_algo_ == ReduceScatterAlgo::kAllReduce) {
    std::vector<at::Tensor> tensors{bucket};
    pending.works.push_back(group_->allreduce(tensors, c10d::AllreduceOptions()));
    record("reduce_scatter", tag, n, 2 * bytes * (world_size_ - 1) / world_size_, 1);
  } else {
    // Backends do not promise that a reduce-scatter may write over its own input, so the shard lands in
    // scratch memory and wait() copies it into place.
    at::Tensor input = bucket;
    pending.result = at::empty({shard}, bucket.options());
    pending.destination = bucket.narrow(0, rank_ * shard, shard);
    pending.works.push_back(group_->_reduce_scatter_base(pending.result, input, c10d::ReduceScatterOptions()));
    record("reduce_scatter", tag, n, bytes * (world_size_ - 1) / world_size_, 1);
  }
  return pending;
}

PendingCollective Comm::all_gather(const at::Tensor& bucket, int64_t tag, const std::string& label) {
  check_bucket(bucket, "all_gather");
  PendingCollective pending{{}, bucket, tag};
  const int64_t n = bucket.numel();
  const int64_t shard = n / world_size_;
  const int64_t bytes = n * bucket.element_size();
  if (world_size_ == 1 || n == 0) {  // nothing to exchange; every rank skips alike (same geometry)
    record(label, tag, n, 0, 0);
    return pending;
  }
  switch (ag_algo_) {
    case AllGatherAlgo::kAllGather: {
      at::Tensor input = bucket.narrow(0, rank_ * shard, shard).clone();
      at::Tensor output = bucket;
      pending.works.push_back(group_->_allgather_base(output, input, c10d::AllgatherOptions()));
      pending.buffer = input;  // keep the input alive too (bucket is owned by the caller)
      record(label, tag, n, bytes * (world_size_ - 1) / world_size_, 1);
      break;
    }
    case AllGatherAlgo::kBroadcast: {
      for (int root = 0; root < world_size_; ++root) {
        std::vector<at::Tensor> tensors{bucket.narrow(0, root * shard, shard)};
        c10d::BroadcastOptions options;
        options.rootRank = root;
        pending.works.push_back(group_->broadcast(tensors, options));
      }
      record(label, tag, n, bytes / world_size_ * (world_size_ - 1), world_size_);
      break;
    }
    case AllGatherAlgo::kAllReduce: {
      if (rank_ > 0) bucket.narrow(0, 0, rank_ * shard).zero_();
      if (rank_ + 1 < world_size_) bucket.narrow(0, (rank_ + 1) * shard, n - (rank_ + 1) * shard).zero_();
      std::vector<at::Tensor> tensors{bucket};
      pending.works.push_back(group_->allreduce(tensors, c10d::AllreduceOptions()));
      record(label, tag, n, 2 * bytes * (world_size_ - 1) / world_size_, 1);
      break;
    }
  }
  return pending;
}

PendingCollective Comm::all_reduce(const at::Tensor& tensor, bool max, int64_t tag) {
  PendingCollective pending{{}, tensor, tag};
  const int64_t bytes = tensor.numel() * tensor.element_size();
  if (world_size_ > 1) {
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
    pending.works.push_back(group_->allreduce(tensors, options));
  }
  record("all_reduce", tag, tensor.numel(), world_size_ > 1 ? 2 * bytes * (world_size_ - 1) / world_size_ : 0,
         world_size_ > 1 ? 1 : 0);
  return pending;
}

PendingCollective Comm::broadcast(const at::Tensor& tensor, int root, int64_t tag) {
  ZC_CHECK_ARG(root >= 0 && root < world_size_, "broadcast root must be in [0, ", world_size_, "), got ", root);
  PendingCollective pending{{}, tensor, tag};
  if (world_size_ > 1) {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    pending.works.push_back(group_->broadcast(tensors, options));
  }
  record("broadcast", tag, tensor.numel(), world_size_ > 1 ? tensor.numel() * tensor.element_size() : 0,
         world_size_ > 1 ? 1 : 0);
  return pending;
}

}  // namespace zerocore::bindings
