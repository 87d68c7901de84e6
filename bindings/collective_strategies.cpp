#include "collective_strategies.hpp"
#include "scratch_pool.hpp"

#include <chrono>
#include <stdexcept>
#include <thread>

#include "zerocore/error.hpp"

namespace zerocore::bindings {

namespace {

// Note [Works released on the waiting thread]
// Gloo's worker thread drops its reference to a Work a moment after the Work completes, so wait() can return
// first. When that reference is the last, the Work's tensors are freed on Gloo's thread, and freeing a tensor
// that Python created and no longer references takes the GIL: at interpreter exit, where the engine's last
// collective completes just before the process ends, Python kills a thread that asks for the GIL
// (pthread_exit through a noexcept frame: std::terminate, SIGABRT, the rank reported failed after a
// successful run; about one run in ten here). So wait() gives the backend's reference a moment (microseconds
// in practice, bounded) to go, leaving the last one to the waiting thread, which Python knows. Only for CPU
// collectives: NCCL's watchdog keeps its references far longer, and frees no Python tensors at exit.
void let_backend_release(const c10::intrusive_ptr<c10d::Work>& work) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
  while (work.use_count() > 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
}

}  // namespace

void PendingCollective::wait() {
  const bool on_cpu = !buffer.defined() || buffer.is_cpu();
  for (auto& work : works) {
    if (!work) continue;
    work->wait();
    if (on_cpu) let_backend_release(work);  // Note [Works released on the waiting thread]
  }
  works.clear();
  if (result.defined()) {
    destination.copy_(result);
    result = at::Tensor();
    destination = at::Tensor();
  }
  if (local.defined()) {  // Note [Widening reduce-scatter]: the products rounded as a scaling pass would
    constexpr int64_t kChunk = int64_t{1} << 15;  // 128 KiB of fp32: the chunk's sum stays in L2
    const int64_t n = local.numel();
    const at::TensorOptions wide = local.options().dtype(at::kFloat);
    at::Tensor sum = at::empty({std::min(n, kChunk)}, wide);
    at::Tensor widened = addends.defined() ? at::empty({std::min(n, kChunk)}, wide) : at::Tensor();
    for (int64_t start = 0; start < n; start += kChunk) {
      const int64_t len = std::min(kChunk, n - start);
      at::Tensor chunk = sum.narrow(0, 0, len);
      chunk.copy_(local.narrow(0, start, len));
      if (prescale != 1.0) chunk.mul_(prescale);
      for (int64_t k = 0; addends.defined() && k < addends.size(0); ++k) {
        at::Tensor peer = widened.narrow(0, 0, len);
        peer.copy_(addends[k].narrow(0, start, len));
        if (prescale != 1.0) peer.mul_(prescale);
        chunk.add_(peer);
      }
      at::Tensor out = deposit.narrow(0, start, len);
      if (deposit_adds) {
        out.add_(chunk);
      } else {
        out.copy_(chunk);
      }
    }
    local = at::Tensor();
    deposit = at::Tensor();
    addends = at::Tensor();
  } else if (addends.defined()) {
    for (int64_t k = 0; k < addends.size(0); ++k) accumulator.add_(addends[k]);
    addends = at::Tensor();
    accumulator = at::Tensor();
  }
  if (finish) {
    auto run = std::move(finish);
    finish = nullptr;
    run();
  }
}

void PendingCollective::widen_into(const at::Tensor& local_shard, const WidenedSum& into) {
  local = local_shard;
  deposit = into.destination;
  prescale = into.prescale;
  deposit_adds = into.accumulate;
}

// ---------------------------------------------------------------------------------------------------------
// Registries
// ---------------------------------------------------------------------------------------------------------

template <class Strategy>
void StrategyRegistry<Strategy>::add(const std::string& name, Factory factory,
                                     const std::vector<std::string>& auto_on) {
  // Runs during static initialisation: a clash is a programming error that stops the module from loading.
  if (name.empty() || name == "auto") {
    throw std::logic_error(std::string(Strategy::kOp) + " algorithm name '" + name + "' is reserved");
  }
  for (const Entry& entry : entries_) {
    if (entry.name == name) {
      throw std::logic_error(std::string(Strategy::kOp) + " algorithm '" + name + "' is registered twice");
    }
  }
  for (const std::string& backend : auto_on) {
    if (!auto_by_backend_.emplace(backend, name).second) {
      throw std::logic_error(std::string(Strategy::kOp) + ": 'auto' on backend '" + backend + "' is both '" +
                             auto_by_backend_[backend] + "' and '" + name + "'");
    }
  }
  entries_.push_back(Entry{name, std::move(factory)});
}

template <class Strategy>
std::vector<std::string> StrategyRegistry<Strategy>::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const Entry& entry : entries_) out.push_back(entry.name);
  return out;
}

template <class Strategy>
std::string StrategyRegistry<Strategy>::auto_choice(const std::string& backend) const {
  auto it = auto_by_backend_.find(backend);
  if (it == auto_by_backend_.end()) it = auto_by_backend_.find(kOtherBackends);
  ZC_CHECK(it != auto_by_backend_.end(), Strategy::kOp, ": no algorithm is registered as 'auto' for backend '",
           backend, "'");
  return it->second;
}

template <class Strategy>
std::unique_ptr<Strategy> StrategyRegistry<Strategy>::create(const std::string& name,
                                                             const std::string& backend) const {
  const std::string chosen = name == "auto" ? auto_choice(backend) : name;
  for (const Entry& entry : entries_) {
    if (entry.name != chosen) continue;
    std::unique_ptr<Strategy> strategy = entry.factory();
    ZC_CHECK(strategy && strategy->name() == entry.name, Strategy::kOp, " algorithm registered as '", entry.name,
             "' reports the name '", strategy ? strategy->name() : std::string("<null>"), "'");
    return strategy;
  }
  // "'auto', 'a', 'b' or 'c'": the accepted names, as the message has always listed them.
  std::vector<std::string> accepted{"auto"};
  for (const Entry& entry : entries_) accepted.push_back(entry.name);
  std::string list;
  for (size_t i = 0; i < accepted.size(); ++i) {
    if (i > 0) list += i + 1 == accepted.size() ? " or " : ", ";
    list += "'" + accepted[i] + "'";
  }
  throw InvalidArgument(std::string(Strategy::kOp) + " algorithm must be " + list + ", got '" + name + "'");
}

template class StrategyRegistry<ReduceScatterStrategy>;
template class StrategyRegistry<AllGatherStrategy>;

IssuedCollective ReduceScatterStrategy::issue_widening(c10d::ProcessGroup&, const BucketCollective&,
                                                      const WidenedSum&) {
  ZC_CHECK(false, "reduce_scatter algorithm '", name(), "' sums inside the backend and cannot widen; check widens()");
  return {};
}

// Constructed on first use, so registrations from any translation unit find them ready.
StrategyRegistry<ReduceScatterStrategy>& reduce_scatter_strategies() {
  static StrategyRegistry<ReduceScatterStrategy> registry;
  return registry;
}

StrategyRegistry<AllGatherStrategy>& all_gather_strategies() {
  static StrategyRegistry<AllGatherStrategy> registry;
  return registry;
}

std::vector<c10::intrusive_ptr<c10d::Work>> broadcast_each(c10d::ProcessGroup& group,
                                                           const std::vector<at::Tensor>& slots) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (int root = 0; root < static_cast<int>(slots.size()); ++root) {
    std::vector<at::Tensor> tensors{slots[root]};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    works.push_back(group.broadcast(tensors, options));
  }
  return works;
}

std::vector<c10::intrusive_ptr<c10d::Work>> exchange_with_peers(c10d::ProcessGroup& group, int self,
                                                                const std::vector<at::Tensor>& messages,
                                                                const std::vector<at::Tensor>& inbox, int tag) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (int peer = 0; peer < static_cast<int>(messages.size()); ++peer) {
    if (peer == self) continue;
    std::vector<at::Tensor> send{messages[peer]};
    works.push_back(group.send(send, peer, tag));
    std::vector<at::Tensor> recv{inbox[peer]};
    works.push_back(group.recv(recv, peer, tag));
  }
  return works;
}

// ---------------------------------------------------------------------------------------------------------
// The algorithms. Registration order is the order names are listed in (error messages,
// _C.collective_algorithms()). Bytes are per rank, ring estimates, with B = the bucket's bytes, W = world size.
// ---------------------------------------------------------------------------------------------------------

namespace {

// The backend's tensor-in, tensor-out all-gather and reduce-scatter: all_gather_single / reduce_scatter_single
// where torch has them (2.13 on, where the old names are deprecated aliases), _allgather_base /
// _reduce_scatter_base before (zerocore supports torch >= 2.4). The int overload wins when both compile; the
// fallback's body is instantiated only when it is chosen.
template <class Group>
auto all_gather_into(Group& group, at::Tensor& output, at::Tensor& input, int)
    -> decltype(group.all_gather_single(output, input, c10d::AllgatherOptions())) {
  return group.all_gather_single(output, input, c10d::AllgatherOptions());
}
template <class Group>
auto all_gather_into(Group& group, at::Tensor& output, at::Tensor& input, long) -> c10::intrusive_ptr<c10d::Work> {
  return group._allgather_base(output, input, c10d::AllgatherOptions());
}
template <class Group>
auto reduce_scatter_into(Group& group, at::Tensor& output, at::Tensor& input, int)
    -> decltype(group.reduce_scatter_single(output, input, c10d::ReduceScatterOptions())) {
  return group.reduce_scatter_single(output, input, c10d::ReduceScatterOptions());
}
template <class Group>
auto reduce_scatter_into(Group& group, at::Tensor& output, at::Tensor& input, long)
    -> c10::intrusive_ptr<c10d::Work> {
  return group._reduce_scatter_base(output, input, c10d::ReduceScatterOptions());
}

// The backend's reduce-scatter: B (W-1)/W bytes, one call. Backends do not promise that a reduce-scatter may
// write over its own input, so the shard lands in scratch memory and wait() copies it into place.
class NativeReduceScatter final : public ReduceScatterStrategy {
 public:
  static constexpr const char* kName = "reduce_scatter";
  std::string name() const override { return kName; }

  IssuedCollective issue(c10d::ProcessGroup& group, const BucketCollective& b) override {
    IssuedCollective out;
    out.pending.buffer = b.bucket;
    out.pending.result = scratch_.take({b.shard}, b.bucket.options());  // Note [Scratch reuse]
    out.pending.destination = b.local_shard();
    at::Tensor input = b.bucket;
    out.pending.works.push_back(reduce_scatter_into(group, out.pending.result, input, 0));
    out.algorithm_bytes = b.bytes * (b.world_size - 1) / b.world_size;
    out.backend_calls = 1;
    return out;
  }

 private:
  ScratchPool scratch_;
};
const RegisterStrategy<NativeReduceScatter> kRegisterNativeReduceScatter({kOtherBackends});

// An all-reduce of the whole bucket, of which each rank keeps its shard: 2 B (W-1)/W bytes, one call.
// Faster than Gloo's reduce-scatter, slower than send_recv there (bench/collectives.py).
class AllReduceReduceScatter final : public ReduceScatterStrategy {
 public:
  static constexpr const char* kName = "all_reduce";
  std::string name() const override { return kName; }

  IssuedCollective issue(c10d::ProcessGroup& group, const BucketCollective& b) override {
    IssuedCollective out;
    out.pending.buffer = b.bucket;
    std::vector<at::Tensor> tensors{b.bucket};
    out.pending.works.push_back(group.allreduce(tensors, c10d::AllreduceOptions()));
    out.algorithm_bytes = 2 * b.bytes * (b.world_size - 1) / b.world_size;
    out.backend_calls = 1;
    return out;
  }
};
const RegisterStrategy<AllReduceReduceScatter> kRegisterAllReduceReduceScatter;

// Point to point: every rank sends each peer that peer's shard and receives its own shard from every peer,
// then wait() adds them into its shard in rank order (or widens, scales and adds them in fp32, Note [Widening
// reduce-scatter]): B (W-1)/W bytes sent (a ring's), 2 (W-1) calls, no reduction inside the backend. On Gloo this is the fastest
// backend algorithm (bench/collectives.py): its reduce_scatter is slow and an all-reduce moves twice the bytes;
// "auto" there is "shared_memory", which falls back to this one across hosts. The message tag counts this strategy's collectives, which
// every rank issues in the same order.
class SendRecvReduceScatter final : public ReduceScatterStrategy {
 public:
  static constexpr const char* kName = "send_recv";
  std::string name() const override { return kName; }
  bool widens() const override { return true; }

  IssuedCollective issue(c10d::ProcessGroup& group, const BucketCollective& b) override {
    IssuedCollective out = exchange(group, b);
    out.pending.sum_into_local_shard(b.local_shard());
    return out;
  }

  IssuedCollective issue_widening(c10d::ProcessGroup& group, const BucketCollective& b,
                                  const WidenedSum& into) override {
    IssuedCollective out = exchange(group, b);
    out.pending.widen_into(b.local_shard(), into);
    return out;
  }

 private:
  // Sends every peer its shard and receives each peer's copy of this rank's shard into `addends`.
  IssuedCollective exchange(c10d::ProcessGroup& group, const BucketCollective& b) {
    IssuedCollective out;
    const int tag = static_cast<int>(next_tag_++ % (1 << 30));
    at::Tensor received = received_.take({b.world_size - 1, b.shard}, b.bucket.options());  // Note [Scratch reuse]
    std::vector<at::Tensor> messages, inbox;
    int64_t row = 0;
    for (int peer = 0; peer < b.world_size; ++peer) {
      messages.push_back(b.shard_of(peer));
      inbox.push_back(peer == b.rank ? at::Tensor() : received[row++]);
    }
    out.pending.works = exchange_with_peers(group, b.rank, messages, inbox, tag);
    out.pending.buffer = b.bucket;
    out.pending.addends = received;
    out.algorithm_bytes = b.bytes * (b.world_size - 1) / b.world_size;
    out.backend_calls = 2 * (b.world_size - 1);
    return out;
  }

  int64_t next_tag_ = 0;
  ScratchPool received_;
};
const RegisterStrategy<SendRecvReduceScatter> kRegisterSendRecvReduceScatter;

// The backend's all-gather from a copy of the local shard into the bucket: B (W-1)/W bytes, one call.
class NativeAllGather final : public AllGatherStrategy {
 public:
  static constexpr const char* kName = "all_gather";
  std::string name() const override { return kName; }

  IssuedCollective issue(c10d::ProcessGroup& group, const BucketCollective& b) override {
    IssuedCollective out;
    at::Tensor input = b.local_shard().clone();
    at::Tensor output = b.bucket;
    out.pending.works.push_back(all_gather_into(group, output, input, 0));
    out.pending.buffer = input;  // keep the input alive (the bucket is owned by the caller)
    out.algorithm_bytes = b.bytes * (b.world_size - 1) / b.world_size;
    out.backend_calls = 1;
    return out;
  }
};
const RegisterStrategy<NativeAllGather> kRegisterNativeAllGather({kOtherBackends});

// W broadcasts, rank r's shard from rank r, in place: B/W (W-1) bytes (each rank roots one shard), W calls.
// On Gloo much faster than its all-gather; "auto" there is "shared_memory", which falls back to this one across
// hosts.
class BroadcastAllGather final : public AllGatherStrategy {
 public:
  static constexpr const char* kName = "broadcast";
  std::string name() const override { return kName; }

  IssuedCollective issue(c10d::ProcessGroup& group, const BucketCollective& b) override {
    IssuedCollective out;
    out.pending.buffer = b.bucket;
    std::vector<at::Tensor> slots;
    for (int root = 0; root < b.world_size; ++root) slots.push_back(b.shard_of(root));
    out.pending.works = broadcast_each(group, slots);
    out.algorithm_bytes = b.bytes / b.world_size * (b.world_size - 1);
    out.backend_calls = b.world_size;
    return out;
  }
};
const RegisterStrategy<BroadcastAllGather> kRegisterBroadcastAllGather;

// An all-reduce (sum) of the bucket after zeroing everything outside the local shard: 2 B (W-1)/W bytes,
// one call. Exact in every dtype: each element is its owner's value plus W-1 zeros.
class AllReduceAllGather final : public AllGatherStrategy {
 public:
  static constexpr const char* kName = "all_reduce";
  std::string name() const override { return kName; }

  IssuedCollective issue(c10d::ProcessGroup& group, const BucketCollective& b) override {
    IssuedCollective out;
    out.pending.buffer = b.bucket;
    if (b.rank > 0) b.bucket.narrow(0, 0, b.rank * b.shard).zero_();
    const int64_t after = (b.rank + 1) * b.shard;
    if (after < b.numel) b.bucket.narrow(0, after, b.numel - after).zero_();
    std::vector<at::Tensor> tensors{b.bucket};
    out.pending.works.push_back(group.allreduce(tensors, c10d::AllreduceOptions()));
    out.algorithm_bytes = 2 * b.bytes * (b.world_size - 1) / b.world_size;
    out.backend_calls = 1;
    return out;
  }
};
const RegisterStrategy<AllReduceAllGather> kRegisterAllReduceAllGather;

}  // namespace

}  // namespace zerocore::bindings
