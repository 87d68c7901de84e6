// The algorithms behind Comm's logical bucket collectives, one strategy class each, and the registries that
// map an algorithm's name to its class per logical op (see Note [Collective algorithms] in comm.hpp).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/extension.h>

#include "zerocore/shared_memory_channel.hpp"

namespace zerocore::bindings {

struct WidenedSum;

// An issued collective and the buffer it fills; wait() blocks until it is done on this rank.
struct PendingCollective {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  at::Tensor buffer;  // kept alive until the collective completes
  int64_t tag = -1;   // caller's id (a bucket index)
  at::Tensor result;       // when defined: the backend wrote here, and wait() copies it into `destination`
  at::Tensor destination;
  at::Tensor addends;      // when defined ([k, n]): wait() adds its k rows into `accumulator` ([n])
  at::Tensor accumulator;
  // A widening reduce-scatter (Note [Widening reduce-scatter]): when `local` is defined, wait() computes in
  // fp32 local * prescale plus each row of `addends` times prescale (every product and sum rounded in fp32)
  // and copies that into `deposit` (adds it, when `deposit_adds`), in cache-sized chunks.
  at::Tensor local;
  at::Tensor deposit;
  double prescale = 1.0;
  bool deposit_adds = false;
  std::function<void()> finish;  // when set: wait() runs it last (a quantized collective's dequantization)

  void wait();

  // What wait() does with a point-to-point reduce-scatter's received shards (`addends`), or with none: adds
  // them into this rank's shard of the bucket, or (Note [Widening reduce-scatter]) widens, scales and sums them
  // with that shard into `into`.
  void sum_into_local_shard(const at::Tensor& local_shard) { accumulator = local_shard; }
  void widen_into(const at::Tensor& local_shard, const WidenedSum& into);
};

// Where a widening reduce-scatter leaves its result (Note [Widening reduce-scatter]): this rank's shard summed
// over ranks in fp32, each rank's shard multiplied by `prescale` first, then copied into `destination` (any
// floating dtype, the shard's size), or added to it when `accumulate`.
struct WidenedSum {
  at::Tensor destination;
  double prescale = 1.0;
  bool accumulate = false;
};

// The bucket of one logical collective and its geometry, as Comm hands it to a strategy. Comm has already
// checked it (contiguous 1-D, numel divisible by world_size) and handled the cases with nothing to exchange
// (world_size 1, an empty bucket), so a strategy sees world_size > 1 and numel > 0 only.
struct BucketCollective {
  at::Tensor bucket;
  int rank = 0;
  int world_size = 1;
  int64_t numel = 0;  // of the whole bucket
  int64_t shard = 0;  // numel / world_size: rank r owns bucket[r * shard, (r + 1) * shard)
  int64_t bytes = 0;  // numel * element size: the whole bucket
  // Offsets in the bucket where a tensor of its layout begins or ends (its parameters): a quantizing
  // strategy starts a group at each, so no scale is shared by two parameters (Note [Quantized collectives]).
  // Empty: groups start at each shard's first element only.
  std::vector<int64_t> cuts;

  at::Tensor shard_of(int r) const { return bucket.narrow(0, r * shard, shard); }
  at::Tensor local_shard() const { return shard_of(rank); }
};

// What a strategy issued and what it cost, for Comm's stats: `algorithm_bytes` is what this rank sends under
// the algorithm (ring estimate), `backend_calls` the calls it made into the ProcessGroup.
struct IssuedCollective {
  PendingCollective pending;
  int64_t algorithm_bytes = 0;
  int64_t backend_calls = 0;
  bool quantized = false;  // the bytes sent are not the bucket's dtype: Comm also counts the ring's unquantized bytes
};

// What a strategy may need beyond the bucket, fixed when Comm is built (Note [Collective algorithms]): the
// quantization group of the quantized algorithms, and for the hierarchical ones the node's process group
// (the ranks n * L .. n * L + L - 1 of node n, L = node_size) and the cross-node one (the ranks with this
// rank's local index in every node). Groups are null where they would have one rank.
struct StrategyOptions {
  int64_t quantization_group_size = 256;
  int node_size = 1;
  c10::intrusive_ptr<c10d::ProcessGroup> node_group;
  c10::intrusive_ptr<c10d::ProcessGroup> cross_group;
  // Comm's shared-memory channel, opened when an algorithm wants_shared_memory() and every rank could open it
  // (Note [Shared-memory collectives]); null otherwise.
  std::shared_ptr<SharedMemoryChannel> shared_memory;
};

// The name both shared-memory algorithms are registered under (bindings/shared_memory_collectives.cpp).
inline constexpr const char* kSharedMemoryAlgorithm = "shared_memory";

// Opens a shared-memory channel among the ranks of `group` (a collective: every rank calls it at the same point).
// Returns null on every rank alike when any rank cannot, with the reason in `why_not`.
std::shared_ptr<SharedMemoryChannel> open_shared_memory_channel(c10d::ProcessGroup& group, std::string& why_not);
// An exchange in which every rank sends the same message, its own slot, to every peer and receives peer r's
// into slots[r] (an all-gather's shape; slots[rank] is the message).
SharedMemoryExchange one_message_for_all(int rank, const std::vector<void*>& slots, size_t bytes);
// Queues `exchange` on `channel`; the Work's wait() returns once it is done (rethrowing its error). The Work owns
// `buffers`, the tensors the exchange reads and writes, and a Work dropped unwaited waits for the exchange first.
c10::intrusive_ptr<c10d::Work> exchange_through_shared_memory(SharedMemoryChannel& channel,
                                                             SharedMemoryExchange exchange,
                                                             std::vector<at::Tensor> buffers);

// One algorithm for one logical collective. issue() starts the collective on `group` and returns without
// waiting; the result is in place once the returned PendingCollective's wait() returns. Every rank runs the
// same strategy on buckets of the same geometry, so every rank makes the same sequence of backend calls.
// Strategies record nothing: Comm does the stats and log for all of them.
class CollectiveStrategy {
 public:
  virtual ~CollectiveStrategy() = default;
  // The name it is registered under (Comm's reduce_scatter_algo / all_gather_algo report it).
  virtual std::string name() const = 0;
  // Called once, before any issue(); throws InvalidArgument when the options do not fit the algorithm.
  virtual void configure(const StrategyOptions& options, const c10d::ProcessGroup& group) {
    (void)options;
    (void)group;
  }
  virtual IssuedCollective issue(c10d::ProcessGroup& group, const BucketCollective& bucket) = 0;
  // Whether configure() should get a shared-memory channel in its options (Note [Shared-memory collectives]).
  virtual bool wants_shared_memory() const { return false; }
};

// Logical reduce-scatter: afterwards this rank's shard holds the sum over ranks of that shard; the rest of
// the bucket holds unspecified values.
//
// Note [Widening reduce-scatter]
// ------------------------------
// Mixed precision reduces 16-bit gradients in fp32 (DeepSpeed's default communication_data_type). An
// algorithm whose backend only moves bytes and that adds the ranks' shards itself (send_recv) need not send
// them in fp32: each rank sends its 16-bit values, and the receiver widens every shard, multiplies it by the
// prescale and adds them in fp32, in rank order as before. Widening is exact, so the sum is bitwise the one
// of widening and scaling before sending -- with half the bytes on the wire, a 16-bit reduction bucket
// instead of an fp32 one, and no widening pass over the whole bucket. The fp32 sum never exists at the shard's
// size: it is formed a cache-sized chunk at a time and deposited (copied or added) into the caller's
// destination, so the only fp32 values are those the old path rounded at its deposit anyway. fp32 buckets
// take the same path: the scaling moves from a pass over the bucket before sending to the receiver's chunks,
// and the deposit from a second pass over the shard into the same chunks (same products, same order). An
// algorithm that sums inside the backend (the native reduce-scatter, an all-reduce) or quantizes cannot, and
// says so with widens().
class ReduceScatterStrategy : public CollectiveStrategy {
 public:
  using Interface = ReduceScatterStrategy;
  static constexpr const char* kOp = "reduce_scatter";

  // Whether issue_widening() is implemented.
  virtual bool widens() const { return false; }
  // Like issue(), but wait() leaves this rank's reduced shard in `into` as WidenedSum describes; the bucket
  // keeps its values.
  virtual IssuedCollective issue_widening(c10d::ProcessGroup& group, const BucketCollective& bucket,
                                          const WidenedSum& into);
};

// Logical all-gather: afterwards every rank's shard of the bucket equals its owner's. The local shard must
// be in place before issue(); the other shards' contents beforehand are unspecified.
class AllGatherStrategy : public CollectiveStrategy {
 public:
  using Interface = AllGatherStrategy;
  static constexpr const char* kOp = "all_gather";
};

// Backend calls more than one algorithm makes. Rank r of `group` broadcasts slots[r] to the others, in
// place: an all-gather of equal slots as W broadcasts (faster than Gloo's all-gather).
std::vector<c10::intrusive_ptr<c10d::Work>> broadcast_each(c10d::ProcessGroup& group,
                                                           const std::vector<at::Tensor>& slots);
// Sends messages[peer] to every other rank of `group` and receives that rank's message into inbox[peer]
// (the entries at index `self` are not used), all in flight at once, under message tag `tag`.
std::vector<c10::intrusive_ptr<c10d::Work>> exchange_with_peers(c10d::ProcessGroup& group, int self,
                                                                const std::vector<at::Tensor>& messages,
                                                                const std::vector<at::Tensor>& inbox, int tag);

// In a registration's `auto_on`: "auto" picks the algorithm on any backend that no other algorithm names.
inline constexpr const char* kOtherBackends = "*";

// name -> factory for the algorithms of one logical op, in registration order, plus the per-backend choice
// of "auto". Filled during static initialisation (RegisterStrategy below) and read-only afterwards.
template <class Strategy>
class StrategyRegistry {
 public:
  using Factory = std::function<std::unique_ptr<Strategy>()>;

  // Registers `name`, which must be new and not "auto"; "auto" picks it on the backends in `auto_on`
  // (backend names as ProcessGroup::getBackendName() gives them, or kOtherBackends).
  void add(const std::string& name, Factory factory, const std::vector<std::string>& auto_on);
  // The registered names, in registration order.
  std::vector<std::string> names() const;
  // The algorithm "auto" picks on `backend`.
  std::string auto_choice(const std::string& backend) const;
  // A new instance of `name` ("auto" resolved for `backend`); an unknown name throws InvalidArgument
  // (ValueError) listing the accepted names.
  std::unique_ptr<Strategy> create(const std::string& name, const std::string& backend) const;

 private:
  struct Entry {
    std::string name;
    Factory factory;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> auto_by_backend_;  // backend (or kOtherBackends) -> name
};

StrategyRegistry<ReduceScatterStrategy>& reduce_scatter_strategies();
StrategyRegistry<AllGatherStrategy>& all_gather_strategies();

template <class Interface>
StrategyRegistry<Interface>& strategies_for();
template <>
inline StrategyRegistry<ReduceScatterStrategy>& strategies_for<ReduceScatterStrategy>() {
  return reduce_scatter_strategies();
}
template <>
inline StrategyRegistry<AllGatherStrategy>& strategies_for<AllGatherStrategy>() {
  return all_gather_strategies();
}

// Registers a strategy class, under its kName, with the registry of the op it implements: a namespace-scope
//   const RegisterStrategy<MyAllGather> kRegisterMyAllGather;
// next to the class is all a new algorithm needs (Note [Collective algorithms]).
template <class Concrete>
struct RegisterStrategy {
  using Interface = typename Concrete::Interface;
  explicit RegisterStrategy(const std::vector<std::string>& auto_on = {}) {
    strategies_for<Interface>().add(
        Concrete::kName, [] { return std::unique_ptr<Interface>(std::make_unique<Concrete>()); }, auto_on);
  }
};

}  // namespace zerocore::bindings
