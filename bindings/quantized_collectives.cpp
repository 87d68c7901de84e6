// ZeRO++'s quantized collectives as strategies (Note [Collective algorithms] in comm.hpp; Note [Quantization
// arithmetic] in zerocore/quantize.hpp for what the bytes are):
//
//   all_gather      "quantized"     (QuantizedAllGather, qwZ)             each shard as int8 + one fp32 scale per group
//   reduce_scatter  "hierarchical"  (HierarchicalQuantizedReduceScatter,  int4 all-to-all inside the node, sum,
//                                    qgZ)                                  int4 across nodes, sum
//
// Note [Quantized collectives]
// ----------------------------
// Every contribution goes through the quantizer, the local one too, so that every rank computes with the same
// values and a test can rebuild the result from explicitly quantized and dequantized shards: the all-gather's
// result is, in every rank's slot, dequantize(quantize(that rank's shard)); the reduce-scatter's is sum_n'
// dequantize(quantize(sum_l' dequantize(quantize(shard from rank (n', l'))))) in fp32, summed in index order,
// rounded once to the bucket's dtype. Quantization groups start at each shard's first element (the quantization
// group size is an option of Comm) and at every cut the bucket carries inside the shard: the reducer and stage 3's
// gathers pass where each parameter's slot begins and ends (bucket_cuts in
// cpp/include/zerocore/bucket_geometry.hpp), so no scale spans two parameters. One shared scale let a parameter
// whose gradients are small beside its neighbour's (a norm's weight, a bias) round to zero in int4 step after step
// and never train (Gemma 3's q_norm and k_norm in a 2-layer model, 4 ranks: unchanged after 4 steps); DeepSpeed's
// qgZ keeps 1-D tensors out of its quantization for the same reason. In the weight all-gather a shared scale cost
// precision only (a bias of ~0.01 beside a norm weight of ~1 forwarded with steps of 1/127), but nothing is gained
// by sharing it (DeepSpeed's qwZ does). The packed message of one shard is its pieces' q bytes (each piece's whole
// bytes), padded to 4, then their scales, so scales stay aligned; every message is as long as the longest shard's.
//
// A group holding inf or NaN is not quantized (Note [Quantization arithmetic]): it arrives as NaN, on every
// rank alike, so a non-finite gradient is still seen as one by the overflow check that follows and a
// non-finite weight still poisons the loss, never a plausible number.
//
// The hierarchical reduce-scatter needs the rank layout of Comm's StrategyOptions: world = N nodes of L ranks,
// rank r = n L + l. Stage one sends each node peer l' the shards { n' L + l' : every node n' } (int4) and sums
// what it receives for { n' L + l }; stage two sends each node n' the partial sum of shard n' L + l over this
// node (int4) and sums what arrives into this rank's shard. Stage one is waited for inside issue(), where
// every rank of the node issues it in the same order; stage two is pending until wait(). Bytes per rank (P(k)
// the packed size of k elements): stage one N P(s) (L - 1), stage two P(s) (N - 1), against the ring's
// B (W - 1) / W in the bucket's dtype: 0.26x of bf16 at 2 nodes of 2 ranks.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "collective_strategies.hpp"
#include "quantize_ops.hpp"
#include "zerocore/error.hpp"

namespace zerocore::bindings {
namespace {

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// One shard of n elements, elements [begin, begin + n) of its bucket, packed as [q bytes | pad to 4 | fp32
// scales]. The shard is cut where the bucket's cuts fall inside it (BucketCollective::cuts) and each piece is
// quantized in groups from its own first element, its q bytes whole (an int4 piece of odd length ends on a
// padding nibble): no scale spans two parameters.
struct Packing {
  int bits;
  int64_t group_size;
  int64_t n;
  std::vector<int64_t> starts;  // each piece's first element in the shard, then n
  int64_t q_bytes = 0;
  int64_t bytes = 0;

  // `cuts` are increasing (Comm checks them): a binary search finds the ones inside this shard, so packing
  // every shard of a bucket costs O(W log cuts + cuts), not O(W x cuts)
  Packing(int bits_, int64_t group_size_, int64_t begin, int64_t n_, const std::vector<int64_t>& cuts = {})
      : bits(bits_), group_size(group_size_), n(n_) {
    starts.push_back(0);
    for (auto cut = std::upper_bound(cuts.begin(), cuts.end(), begin); cut != cuts.end() && *cut < begin + n;
         ++cut) {
      starts.push_back(*cut - begin);
    }
    starts.push_back(n);
    int64_t q = 0, groups = 0;
    for_each_piece([&](int64_t, int64_t length, int64_t q_offset, int64_t scale_offset) {
      q = q_offset + quantized_bytes(length, bits);
      groups = scale_offset + quantize_num_groups(length, group_size);
    });
    q_bytes = round_up(q, 4);
    bytes = q_bytes + 4 * groups;
  }

  // f(first element, length, offset of its q bytes, index of its first scale) for each piece in order
  template <typename F>
  void for_each_piece(F&& f) const {
    int64_t q = 0, scale = 0;
    for (size_t i = 0; i + 1 < starts.size(); ++i) {
      const int64_t length = starts[i + 1] - starts[i];
      f(starts[i], length, q, scale);
      q += quantized_bytes(length, bits);
      scale += quantize_num_groups(length, group_size);
    }
  }

  void pack(const at::Tensor& values, const at::Tensor& message) const {
    uint8_t* q = message.data_ptr<uint8_t>();
    float* scales = reinterpret_cast<float*>(q + q_bytes);
    for_each_piece([&](int64_t first, int64_t length, int64_t q_offset, int64_t scale_offset) {
      quantize_tensor(values.narrow(0, first, length), bits, group_size, q + q_offset, scales + scale_offset,
                      /*read_back=*/false);
    });
  }
  void unpack(const at::Tensor& message, const at::Tensor& out) const {
    const uint8_t* q = message.data_ptr<uint8_t>();
    const float* scales = reinterpret_cast<const float*>(q + q_bytes);
    for_each_piece([&](int64_t first, int64_t length, int64_t q_offset, int64_t scale_offset) {
      dequantize_into(q + q_offset, scales + scale_offset, length, bits, group_size, out.narrow(0, first, length));
    });
  }
};

// Every shard's packing (its pieces depend on where the bucket's cuts fall in it) and the bytes of one message:
// the longest shard's, so every exchange moves equal sizes.
struct ShardPackings {
  std::vector<Packing> of_shard;
  int64_t message_bytes = 0;

  ShardPackings(int bits, int64_t group_size, const BucketCollective& b) {
    for (int r = 0; r < b.world_size; ++r) {
      of_shard.emplace_back(bits, group_size, r * b.shard, b.shard, b.cuts);
      message_bytes = std::max(message_bytes, of_shard.back().bytes);
    }
  }
};

void check_group_size(int64_t group_size, int bits, const char* name) {
  ZC_CHECK_ARG(group_size > 0 && (bits == 8 || group_size % 2 == 0), name,
               ": the quantization group size must be > 0", bits == 4 ? " and even (int4)" : "", ", got ",
               group_size);
}

bool is_gloo(const c10d::ProcessGroup& group) { return group.getBackendName() == "gloo"; }

// qwZ: every rank's shard as int8 with one fp32 scale per group, all-gathered (through shared memory between
// ranks of one host, as W broadcasts on other Gloo groups, whose broadcast beats its all-gather, the backend's
// all-gather elsewhere), then dequantized into every slot of the
// bucket, this rank's too (Note [Quantized collectives]). The packed buffer of W messages is the only
// temporary: about half of a bf16 bucket.
class QuantizedAllGather final : public AllGatherStrategy {
 public:
  static constexpr const char* kName = "quantized";
  std::string name() const override { return kName; }

  // Ranks of one host exchange the packed messages through Comm's shared-memory channel when it has one
  // (Note [Shared-memory collectives]), as the unquantized all-gather does.
  bool wants_shared_memory() const override { return true; }

  void configure(const StrategyOptions& options, const c10d::ProcessGroup& group) override {
    check_group_size(options.quantization_group_size, 8, "all_gather 'quantized'");
    group_size_ = options.quantization_group_size;
    channel_ = options.shared_memory;
    (void)group;
  }

  IssuedCollective issue(c10d::ProcessGroup& group, const BucketCollective& b) override {
    ShardPackings shards(8, group_size_, b);
    std::vector<Packing> packings = std::move(shards.of_shard);
    const int64_t message_bytes = shards.message_bytes;
    at::Tensor packed = at::empty({b.world_size * message_bytes}, b.bucket.options().dtype(at::kByte));
    std::vector<at::Tensor> slots;  // rank r's message
    for (int r = 0; r < b.world_size; ++r) slots.push_back(packed.narrow(0, r * message_bytes, message_bytes));
    packings[b.rank].pack(b.local_shard(), slots[b.rank]);
    IssuedCollective out;
    at::Tensor input;  // the backend's all-gather reads a copy of this rank's message
    if (channel_ && packed.device().is_cpu()) {
      std::vector<void*> messages;
      for (const at::Tensor& slot : slots) messages.push_back(slot.data_ptr());
      SharedMemoryExchange x = one_message_for_all(b.rank, messages, static_cast<size_t>(message_bytes));
      out.pending.works.push_back(exchange_through_shared_memory(*channel_, std::move(x), {packed}));
      out.backend_calls = 0;
    } else if (is_gloo(group)) {
      out.pending.works = broadcast_each(group, slots);
      out.backend_calls = b.world_size;
    } else {
      std::vector<std::vector<at::Tensor>> outputs{slots};
      input = slots[b.rank].clone();
      std::vector<at::Tensor> inputs{input};
      out.pending.works.push_back(group.allgather(outputs, inputs, c10d::AllgatherOptions()));
      out.backend_calls = 1;
    }
    const BucketCollective geometry = b;
    out.pending.buffer = packed;
    out.pending.finish = [packings = std::move(packings), slots, input, geometry] {
      for (int r = 0; r < geometry.world_size; ++r) packings[r].unpack(slots[r], geometry.shard_of(r));
    };
    out.algorithm_bytes = message_bytes * (b.world_size - 1);
    out.quantized = true;
    return out;
  }

 private:
  int64_t group_size_ = 256;
  std::shared_ptr<SharedMemoryChannel> channel_;
};
const RegisterStrategy<QuantizedAllGather> kRegisterQuantizedAllGather;

// qgZ: see Note [Quantized collectives].
class HierarchicalQuantizedReduceScatter final : public ReduceScatterStrategy {
 public:
  static constexpr const char* kName = "hierarchical";
  std::string name() const override { return kName; }

  void configure(const StrategyOptions& options, const c10d::ProcessGroup& group) override {
    check_group_size(options.quantization_group_size, 4, "reduce_scatter 'hierarchical'");
    const int world = group.getSize();
    ZC_CHECK_ARG(options.node_size >= 1 && world % options.node_size == 0,
                 "reduce_scatter 'hierarchical': the node size must divide the world size ", world, ", got ",
                 options.node_size);
    const int nodes = world / options.node_size;
    ZC_CHECK_ARG(options.node_size == 1 || (options.node_group && options.node_group->getSize() == options.node_size),
                 "reduce_scatter 'hierarchical': node_group must be the ", options.node_size, " ranks of this node");
    ZC_CHECK_ARG(nodes == 1 || (options.cross_group && options.cross_group->getSize() == nodes),
                 "reduce_scatter 'hierarchical': cross_group must hold this rank's peer in each of the ", nodes,
                 " nodes");
    options_ = options;
  }

  IssuedCollective issue(c10d::ProcessGroup& group, const BucketCollective& b) override {
    (void)group;
    const int local_size = options_.node_size;
    const int nodes = b.world_size / local_size;
    const int node = b.rank / local_size;
    const int local = b.rank % local_size;
    const int tag = static_cast<int>(next_tag_++ % (1 << 30));
    ShardPackings shards(4, options_.quantization_group_size, b);
    const std::vector<Packing>& packings = shards.of_shard;
    const int64_t message_bytes = shards.message_bytes;
    const auto bytes = b.bucket.options().dtype(at::kByte);
    const auto fp32 = b.bucket.options().dtype(at::kFloat);
    IssuedCollective out;

    // stage one, inside the node: to local peer l' the shards of ranks (n', l') of every node n'
    at::Tensor sent = at::empty({local_size, nodes, message_bytes}, bytes);
    at::Tensor received = at::empty({local_size, nodes, message_bytes}, bytes);
    for (int peer = 0; peer < local_size; ++peer) {
      at::Tensor into = peer == local ? received[peer] : sent[peer];
      for (int n = 0; n < nodes; ++n) {
        packings[n * local_size + peer].pack(b.shard_of(n * local_size + peer), into[n]);
      }
    }
    if (local_size > 1) {
      std::vector<at::Tensor> messages, inbox;
      for (int peer = 0; peer < local_size; ++peer) {
        messages.push_back(sent[peer]);
        inbox.push_back(received[peer]);
      }
      for (auto& work : exchange_with_peers(*options_.node_group, local, messages, inbox, tag)) work->wait();
      out.backend_calls += 2 * (local_size - 1);
    }
    // this node's partial sums of the shards (n', l), in fp32, local ranks in order
    at::Tensor partial = at::zeros({nodes, b.shard}, fp32);
    at::Tensor values = at::empty({b.shard}, fp32);
    for (int n = 0; n < nodes; ++n) {
      for (int peer = 0; peer < local_size; ++peer) {
        packings[n * local_size + local].unpack(received[peer][n], values);
        partial[n].add_(values);
      }
    }

    // stage two, across nodes: to node n' the partial sum of shard (n', l)
    at::Tensor sent2 = at::empty({nodes, message_bytes}, bytes);
    at::Tensor received2 = at::empty({nodes, message_bytes}, bytes);
    for (int n = 0; n < nodes; ++n) {
      packings[n * local_size + local].pack(partial[n], n == node ? received2[n] : sent2[n]);
    }
    if (nodes > 1) {
      std::vector<at::Tensor> messages, inbox;
      for (int n = 0; n < nodes; ++n) {
        messages.push_back(sent2[n]);
        inbox.push_back(received2[n]);
      }
      out.pending.works = exchange_with_peers(*options_.cross_group, node, messages, inbox, tag);
      out.backend_calls += 2 * (nodes - 1);
    }
    const at::Tensor destination = b.local_shard();
    out.pending.buffer = received2;  // and sent2 lives in finish: both stay alive until the exchange is done
    const Packing packing = packings[b.rank];  // this rank's shard, which every message of stage two carries
    out.pending.finish = [packing, received2, sent2, destination, nodes, fp32] {
      at::Tensor total = at::zeros({packing.n}, fp32);
      at::Tensor values = at::empty({packing.n}, fp32);
      for (int n = 0; n < nodes; ++n) {
        packing.unpack(received2[n], values);
        total.add_(values);
      }
      destination.copy_(total);
    };
    out.algorithm_bytes = message_bytes * (nodes * (local_size - 1) + (nodes - 1));
    out.quantized = true;
    return out;
  }

 private:
  StrategyOptions options_;
  int64_t next_tag_ = 0;
};
const RegisterStrategy<HierarchicalQuantizedReduceScatter> kRegisterHierarchicalReduceScatter;

}  // namespace
}  // namespace zerocore::bindings
