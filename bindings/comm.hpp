// Collectives issued from C++ through c10d::ProcessGroup (Gloo on CPU, NCCL on GPU share this path),
// with the algorithm for each logical collective chosen per backend, and a count of what was issued.
//
// Note [Collective algorithms]
// ----------------------------
// A logical reduce-scatter of a bucket (every rank ends with the sum of its shard) can run as the
// backend's reduce_scatter, or as an all-reduce of the whole bucket from which each rank keeps its shard.
// A logical all-gather (every rank's shard lands in every rank's bucket) can run as the backend's
// all_gather, as world_size broadcasts (rank r broadcasts its shard in place), or as an all-reduce of a
// bucket that is zero outside the local shard. On Gloo the native reduce-scatter and all-gather are much
// slower than all-reduce and broadcast of the same buffer (bench/collectives.py measures it), so the
// default depends on the backend. The choice is recorded in the stats: `logical_elements` counts the
// collective's size as ZeRO defines it, `algorithm_bytes` the bytes each rank sends under the algorithm
// used (ring estimates), so comm_report() shows both.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/extension.h>

namespace zerocore::bindings {

enum class ReduceScatterAlgo { kReduceScatter, kAllReduce };
enum class AllGatherAlgo { kAllGather, kBroadcast, kAllReduce };

// An issued collective and the buffer it fills; wait() blocks until it is done on this rank.
struct PendingCollective {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  at::Tensor buffer;  // kept alive until the collective completes
  int64_t tag = -1;   // caller's id (a bucket index)
  at::Tensor result;       // when defined: the backend wrote here, and wait() copies it into `destination`
  at::Tensor destination;

  void wait();
};

struct CollectiveStats {
  int64_t calls = 0;             // logical collectives issued
  int64_t logical_elements = 0;  // elements of the full buffer each logical collective covers
  int64_t algorithm_bytes = 0;   // bytes this rank sends under the algorithm used (ring estimate)
  int64_t backend_calls = 0;     // calls into the ProcessGroup (several broadcasts make one all-gather)
};

class Comm {
 public:
  // Algorithms "auto" pick the fastest known for the backend (see Note [Collective algorithms]).
  Comm(c10::intrusive_ptr<c10d::ProcessGroup> group, const std::string& reduce_scatter_algo,
       const std::string& all_gather_algo);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  std::string backend() const { return group_->getBackendName(); }
  std::string reduce_scatter_algo() const;
  std::string all_gather_algo() const;

  // Sums `bucket` (1-D, numel divisible by world_size) across ranks so that this rank's shard
  // bucket[rank * s, (rank + 1) * s) holds the sum. Other regions hold unspecified values afterwards.
  PendingCollective reduce_scatter(const at::Tensor& bucket, int64_t tag);
  // Fills every rank's shard of `bucket` from that rank; this rank's shard must already be in place.
  // `label` names the collective in stats and log (stage 3 tells forward, backward and tag gathers apart).
  PendingCollective all_gather(const at::Tensor& bucket, int64_t tag, const std::string& label = "all_gather");
  // A plain all-reduce (sum or max) for small tensors: norms and overflow flags.
  PendingCollective all_reduce(const at::Tensor& tensor, bool max, int64_t tag);
  // Broadcast from `root` (initial parameter sync).
  PendingCollective broadcast(const at::Tensor& tensor, int root, int64_t tag);

  const std::map<std::string, CollectiveStats>& stats() const { return stats_; }
  void reset_stats() { stats_.clear(); }
  // The sequence of collectives issued ("reduce_scatter:3:1024" = op, tag, elements), for order tests.
  const std::vector<std::string>& log() const { return log_; }
  void set_logging(bool enabled) { logging_ = enabled; }
  void clear_log() { log_.clear(); }

 private:
  void record(const std::string& op, int64_t tag, int64_t elements, int64_t algorithm_bytes, int64_t backend_calls);
  void check_bucket(const at::Tensor& bucket, const char* op) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_;
  int world_size_;
  ReduceScatterAlgo rs_algo_;
  AllGatherAlgo ag_algo_;
  std::map<std::string, CollectiveStats> stats_;
  std::vector<std::string> log_;
  bool logging_ = false;
};

}  // namespace zerocore::bindings
