// Collectives issued from C++ through c10d::ProcessGroup (Gloo on CPU, NCCL on GPU share this path),
// with the algorithm for each logical collective chosen per backend, and a count of what was issued.
//
// Note [Collective algorithms]
// ----------------------------
// A logical reduce-scatter of a bucket (every rank ends with the sum of its shard) can run as the
// backend's reduce_scatter, as an all-reduce of the whole bucket from which each rank keeps its shard, or
// point to point (each rank sends every peer its shard and sums what it receives).
// A logical all-gather (every rank's shard lands in every rank's bucket) can run as the backend's
// all_gather, as world_size broadcasts (rank r broadcasts its shard in place), or as an all-reduce of a
// bucket that is zero outside the local shard. On Gloo the native reduce-scatter and all-gather are much
// slower than point-to-point, all-reduce and broadcast of the same buffer (bench/collectives.py measures
// it: 110 MB, 2 ranks: send_recv 0.68x and broadcast 0.48x of an all-reduce), so the default ("auto")
// depends on the backend.
//
// Each algorithm is a strategy class (bindings/collective_strategies.hpp/.cpp) behind the interface of its
// logical op, ReduceScatterStrategy or AllGatherStrategy:
//
//   op              name (class)                               algorithm_bytes   backend_calls   "auto" on
//   reduce_scatter  "reduce_scatter" (NativeReduceScatter)     B (W-1)/W         1               not Gloo
//                   "all_reduce"     (AllReduceReduceScatter)  2 B (W-1)/W       1               -
//                   "send_recv"      (SendRecvReduceScatter)   B (W-1)/W         2 (W-1)         (Gloo, fallback)
//                   "shared_memory"  (SharedMemoryReduceScatter) B (W-1)/W       0               Gloo
//   all_gather      "all_gather"     (NativeAllGather)         B (W-1)/W         1               not Gloo
//                   "broadcast"      (BroadcastAllGather)      B/W (W-1)         W               (Gloo, fallback)
//                   "all_reduce"     (AllReduceAllGather)      2 B (W-1)/W       1               -
//                   "shared_memory"  (SharedMemoryAllGather)   B/W (W-1)         0               Gloo
//
// "shared_memory" (bindings/shared_memory_collectives.cpp, Note [Shared-memory collectives]) is send_recv and
// broadcast with the bytes copied through memory that every rank of the host maps instead of sent over Gloo's
// loopback sockets (about 3x faster on a 26 MB bucket); where the ranks cannot share a segment it falls back to
// those two and reports their names.
//   ZeRO++ (bindings/quantized_collectives.cpp, Note [Quantized collectives]; by name only):
//   reduce_scatter  "hierarchical"   (qgZ: int4, node then     P(s) (N(L-1)+N-1)  2(L-1)+2(N-1)    -
//                                     across nodes)
//   all_gather      "quantized"      (qwZ: int8 + scales)      P(s) (W-1)        0 through shared  -
//                                                                                memory, W on Gloo,
//                                                                                else 1
//
// with P(s) the packed bytes of one shard of s elements, L ranks per node, N = W/L nodes. Quantized
// strategies also report what the same collective would send unquantized (stats' unquantized_bytes: the
// ring's B (W-1)/W), and take options (quantization group, node size, node and cross-node process groups)
// from Comm's constructor through CollectiveStrategy::configure.
//
// with B the bucket's bytes and W the world size (ring estimates of the bytes each rank sends; world size 1
// and empty buckets issue nothing and count 0 and 0). A per-op registry maps each name to a factory and
// knows which name "auto" means on each backend; Comm's constructor asks it for the two strategies, and an
// unknown name is a ValueError listing the registered ones. _C.collective_algorithms() lists them too.
//
// Comm owns everything around the algorithm, in one place for all of them: the bucket checks, the
// nothing-to-exchange shortcut (world size 1, empty bucket: every rank skips alike), the tag, and the stats
// and log. A strategy only issues backend calls and returns the PendingCollective with its cost:
// `logical_elements` counts the collective's size as ZeRO defines it (the whole bucket, whatever the
// algorithm), `algorithm_bytes` and `backend_calls` what the strategy reports, so comm_report() shows both.
// Every gather, whatever its label (stage 3 tells forward, backward and tag gathers apart), goes through
// Comm::all_gather and so through the chosen AllGatherStrategy.
//
// Adding an algorithm (a quantized or hierarchical all-gather, say) is a new class and nothing else: in
// collective_strategies.cpp (or a new file added to _C's sources), derive from the op's interface, give it
// a `static constexpr const char* kName`, return kName from name(), implement issue() with the guarantees
// the interface documents (every rank makes the same backend calls in the same order; wait() leaves the
// result in place), and register it next to the class:
//   const RegisterStrategy<QuantizedAllGather> kRegisterQuantized;               // by name only
//   const RegisterStrategy<HierarchicalAllGather> kRegisterHierarchical({"nccl"});  // and "auto" on NCCL
// A backend has one "auto" choice per op (a backend-specific one beats kOtherBackends); two algorithms
// claiming the same one, or a name registered twice, stop _C from loading.
// Registration order is the order names are listed in. tests/test_comm_strategies.py runs every registered
// algorithm against the expected result and the native algorithm's; its table FORMULAS, the registered
// names with their algorithm_bytes and backend_calls formulas, is the one place a new algorithm adds a row.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/extension.h>

#include "collective_strategies.hpp"

namespace zerocore::bindings {

struct CollectiveStats {
  int64_t calls = 0;             // logical collectives issued
  int64_t logical_elements = 0;  // elements of the full buffer each logical collective covers
  int64_t algorithm_bytes = 0;   // bytes this rank sends under the algorithm used (ring estimate)
  int64_t backend_calls = 0;     // calls into the ProcessGroup (several broadcasts make one all-gather)
  int64_t unquantized_bytes = 0; // what a ring over the bucket's own dtype would send: algorithm_bytes before quantization
};

class Comm {
 public:
  // Algorithms are registered names or "auto", the fastest known for the backend (Note [Collective
  // algorithms]); an unknown name throws InvalidArgument (ValueError) listing the registered ones.
  Comm(c10::intrusive_ptr<c10d::ProcessGroup> group, const std::string& reduce_scatter_algo,
       const std::string& all_gather_algo, const StrategyOptions& options = StrategyOptions{});

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  std::string backend() const { return group_->getBackendName(); }
  std::string reduce_scatter_algo() const { return reduce_scatter_->name(); }
  std::string all_gather_algo() const { return all_gather_->name(); }
  // Bytes of the shared-memory segment this Comm maps (Note [Shared-memory collectives]); 0 without one.
  int64_t shared_memory_bytes() const { return shared_memory_bytes_; }

  // Sums `bucket` (1-D, numel divisible by world_size) across ranks so that this rank's shard
  // bucket[rank * s, (rank + 1) * s) holds the sum. Other regions hold unspecified values afterwards.
  // `cuts`: where the bucket's tensors begin and end (BucketCollective::cuts), for the quantizing algorithms.
  PendingCollective reduce_scatter(const at::Tensor& bucket, int64_t tag, std::vector<int64_t> cuts = {});
  // Whether the reduce-scatter algorithm can sum in a wider dtype than the bucket travels in (Note [Widening
  // reduce-scatter] in collective_strategies.hpp).
  bool reduce_scatter_widens() const { return reduce_scatter_->widens(); }
  // A reduce-scatter of a 16-bit or fp32 bucket summed in fp32 at the receiver, whose result wait() leaves in
  // `into` (WidenedSum); the bucket keeps its values. Requires reduce_scatter_widens().
  PendingCollective reduce_scatter_widened(const at::Tensor& bucket, const WidenedSum& into, int64_t tag);
  // Fills every rank's shard of `bucket` from that rank; this rank's shard must already be in place.
  // `label` names the collective in stats and log (stage 3 tells forward, backward and tag gathers apart);
  // `cuts` as for reduce_scatter.
  PendingCollective all_gather(const at::Tensor& bucket, int64_t tag, const std::string& label = "all_gather",
                               std::vector<int64_t> cuts = {});
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
  // Checks `bucket`, runs `strategy` on it (unless there is nothing to exchange) and records it under `label`.
  // `widen`, when set, asks the reduce-scatter strategy for a widening one (reduce_scatter_widened).
  PendingCollective issue_bucket(CollectiveStrategy& strategy, const char* op, const at::Tensor& bucket, int64_t tag,
                                 const std::string& label, const std::optional<WidenedSum>& widen = std::nullopt,
                                 std::vector<int64_t> cuts = {});
  // The stats and log of every collective Comm issues.
  void record(const std::string& op, int64_t tag, int64_t elements, int64_t algorithm_bytes, int64_t backend_calls,
              int64_t unquantized_bytes);
  void check_bucket(const at::Tensor& bucket, const char* op) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_;
  int world_size_;
  std::unique_ptr<ReduceScatterStrategy> reduce_scatter_;
  std::unique_ptr<AllGatherStrategy> all_gather_;
  std::map<std::string, CollectiveStats> stats_;
  std::vector<std::string> log_;
  bool logging_ = false;
  int64_t shared_memory_bytes_ = 0;
};

}  // namespace zerocore::bindings
