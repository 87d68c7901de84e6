// The "shared_memory" collective algorithms: the point-to-point reduce-scatter and the broadcast all-gather of
// collective_strategies.cpp with their bytes moved through a segment every rank of the host maps (Note
// [Shared-memory transport] in zerocore/shared_memory_channel.hpp) instead of through Gloo's loopback sockets.
// "auto" on Gloo.
//
// Note [Shared-memory collectives]
// --------------------------------
// Comm opens one channel per Comm when either of its algorithms asks for one (open_shared_memory_channel, a
// collective: rank 0 creates the segment, the others open it, and all agree). Where any rank cannot (ranks on
// other hosts, no /dev/shm or no room in it, ZEROCORE_SHARED_MEMORY=0 on any rank), every rank falls back
// alike: "auto" then runs send_recv and broadcast through the backend, and reports their names; an explicit
// "shared_memory" is refused naming the reason. Buckets not in CPU memory take the fallback too.
//
// The arithmetic is send_recv's, unchanged: the channel delivers each peer's copy of this rank's shard into
// the same receive scratch, and wait() sums (or widens, scales and sums, Note [Widening reduce-scatter]) in the
// same order, so results are bitwise those of send_recv. The all-gather writes this rank's shard into the
// segment once and every peer copies it straight into its bucket. Every rank's exchanges run on the channel's
// worker thread in issue order, as a backend runs its collectives, so issue() returns at once and a collective
// progresses whether or not its caller is waiting yet. backend_calls counts 0: nothing goes through the
// ProcessGroup; algorithm_bytes are the ring's estimate, as for the algorithms they replace.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "collective_strategies.hpp"
#include "scratch_pool.hpp"
#include "zerocore/error.hpp"
#include "zerocore/shared_memory_channel.hpp"

namespace zerocore::bindings {

namespace {

// Per rank: `kDepth` slots of `world` sub-slots within this many bytes (2 ranks: 256 KiB sub-slots, 4 MiB in all).
constexpr size_t kRegionBudget = size_t{2} << 20;
constexpr int kDepth = 4;

std::chrono::milliseconds group_timeout(c10d::ProcessGroup& group) {
  try {
    auto backend = group.getBackend(c10::DeviceType::CPU);
    if (backend) {
      auto options = backend->getBackendOptions();
      if (options) return options->timeout;
    }
  } catch (const std::exception&) {  // a backend without options: c10d's default
  }
  return std::chrono::minutes(30);
}

char* shard_pointer(const BucketCollective& b, int r) {
  return static_cast<char*>(b.bucket.data_ptr()) + r * b.shard * b.bucket.element_size();
}

// Work whose wait() blocks until the channel finished the exchange and rethrows its error. It owns the tensors
// the exchange reads and writes (the channel holds raw pointers only), and one dropped unwaited waits for the
// exchange before releasing them.
class SharedMemoryWork final : public c10d::Work {
 public:
  SharedMemoryWork(std::shared_future<void> done, std::vector<at::Tensor> buffers)
      : done_(std::move(done)), buffers_(std::move(buffers)) {}
  ~SharedMemoryWork() override { done_.wait(); }
  bool isCompleted() override { return done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }
  bool wait(std::chrono::milliseconds timeout) override {
    (void)timeout;  // the channel's waits end at the process group's timeout
    done_.get();
    return true;
  }

 private:
  std::shared_future<void> done_;
  std::vector<at::Tensor> buffers_;
};

class SharedMemoryReduceScatter final : public ReduceScatterStrategy {
 public:
  static constexpr const char* kName = kSharedMemoryAlgorithm;
  std::string name() const override { return channel_ || !fallback_ ? kName : fallback_->name(); }
  bool widens() const override { return true; }
  bool wants_shared_memory() const override { return true; }

  void configure(const StrategyOptions& options, const c10d::ProcessGroup& group) override {
    fallback_ = reduce_scatter_strategies().create("send_recv", group.getBackendName());
    fallback_->configure(options, group);
    channel_ = options.shared_memory;
  }

  IssuedCollective issue(c10d::ProcessGroup& group, const BucketCollective& b) override {
    if (!usable(b)) return fallback_->issue(group, b);
    IssuedCollective out = exchange(b);
    out.pending.sum_into_local_shard(b.local_shard());
    return out;
  }

  IssuedCollective issue_widening(c10d::ProcessGroup& group, const BucketCollective& b,
                                  const WidenedSum& into) override {
    if (!usable(b)) return fallback_->issue_widening(group, b, into);
    IssuedCollective out = exchange(b);
    out.pending.widen_into(b.local_shard(), into);
    return out;
  }

 private:
  bool usable(const BucketCollective& b) const { return channel_ && b.bucket.device().is_cpu(); }

  // Every peer gets its shard of the bucket; each peer's copy of this rank's shard lands in `addends`.
  IssuedCollective exchange(const BucketCollective& b) {
    at::Tensor received = received_.take({b.world_size - 1, b.shard}, b.bucket.options());  // Note [Scratch reuse]
    SharedMemoryExchange x;
    x.send.assign(b.world_size, nullptr);
    x.recv.assign(b.world_size, nullptr);
    int64_t row = 0;
    for (int peer = 0; peer < b.world_size; ++peer) {
      if (peer == b.rank) continue;
      x.send[peer] = shard_pointer(b, peer);
      x.recv[peer] = received[row++].data_ptr();
    }
    x.bytes = static_cast<size_t>(b.shard * b.bucket.element_size());
    IssuedCollective out;
    out.pending.works.push_back(exchange_through_shared_memory(*channel_, std::move(x), {b.bucket, received}));
    out.pending.buffer = b.bucket;
    out.pending.addends = received;
    out.algorithm_bytes = b.bytes * (b.world_size - 1) / b.world_size;
    out.backend_calls = 0;
    return out;
  }

  std::shared_ptr<SharedMemoryChannel> channel_;
  std::unique_ptr<ReduceScatterStrategy> fallback_;
  ScratchPool received_;
};
const RegisterStrategy<SharedMemoryReduceScatter> kRegisterSharedMemoryReduceScatter({"gloo"});

class SharedMemoryAllGather final : public AllGatherStrategy {
 public:
  static constexpr const char* kName = kSharedMemoryAlgorithm;
  std::string name() const override { return channel_ || !fallback_ ? kName : fallback_->name(); }
  bool wants_shared_memory() const override { return true; }

  void configure(const StrategyOptions& options, const c10d::ProcessGroup& group) override {
    fallback_ = all_gather_strategies().create("broadcast", group.getBackendName());
    fallback_->configure(options, group);
    channel_ = options.shared_memory;
  }

  IssuedCollective issue(c10d::ProcessGroup& group, const BucketCollective& b) override {
    if (!channel_ || !b.bucket.device().is_cpu()) return fallback_->issue(group, b);
    std::vector<void*> shards;
    for (int r = 0; r < b.world_size; ++r) shards.push_back(shard_pointer(b, r));
    SharedMemoryExchange x =
        one_message_for_all(b.rank, shards, static_cast<size_t>(b.shard * b.bucket.element_size()));
    IssuedCollective out;
    out.pending.works.push_back(exchange_through_shared_memory(*channel_, std::move(x), {b.bucket}));
    out.pending.buffer = b.bucket;
    out.algorithm_bytes = b.bytes / b.world_size * (b.world_size - 1);
    out.backend_calls = 0;
    return out;
  }

 private:
  std::shared_ptr<SharedMemoryChannel> channel_;
  std::unique_ptr<AllGatherStrategy> fallback_;
};
const RegisterStrategy<SharedMemoryAllGather> kRegisterSharedMemoryAllGather({"gloo"});

}  // namespace

SharedMemoryExchange one_message_for_all(int rank, const std::vector<void*>& slots, size_t bytes) {
  SharedMemoryExchange x;
  const int world = static_cast<int>(slots.size());
  x.send.assign(world, slots[rank]);
  x.recv = slots;
  x.send[rank] = nullptr;
  x.recv[rank] = nullptr;
  x.bytes = bytes;
  x.same_for_all = true;
  return x;
}

c10::intrusive_ptr<c10d::Work> exchange_through_shared_memory(SharedMemoryChannel& channel,
                                                             SharedMemoryExchange exchange,
                                                             std::vector<at::Tensor> buffers) {
  return c10::make_intrusive<SharedMemoryWork>(channel.submit(std::move(exchange)), std::move(buffers));
}

std::shared_ptr<SharedMemoryChannel> open_shared_memory_channel(c10d::ProcessGroup& group, std::string& why_not) {
  const int rank = group.getRank();
  const int world = group.getSize();
  if (world < 2) {
    why_not = "the process group has one rank";
    return nullptr;
  }
  if (group.getBackendName() != "gloo") {  // the rendezvous below moves CPU tensors
    why_not = "the process group's backend is '" + group.getBackendName() + "', not 'gloo'";
    return nullptr;
  }
  const char* setting = std::getenv("ZEROCORE_SHARED_MEMORY");
  const bool wanted = !(setting && std::string(setting) == "0");
  const size_t slot_bytes =
      std::max<size_t>(4096, kRegionBudget / (static_cast<size_t>(kDepth) * world) / 4096 * 4096);
  const std::chrono::milliseconds timeout = group_timeout(group);

  std::shared_ptr<SharedMemoryChannel> channel;
  std::string reason = wanted ? "" : "ZEROCORE_SHARED_MEMORY=0 is set";
  constexpr int64_t kNameBytes = 120;
  at::Tensor announce = at::zeros({1 + kNameBytes}, at::kByte);  // [created, name bytes...] from rank 0
  if (rank == 0 && wanted) {
    SharedMemoryChannel::remove_stale_segments();  // a rank 0 killed during an earlier rendezvous left its own
    const std::string name = SharedMemoryChannel::fresh_name();
    try {
      channel = std::make_shared<SharedMemoryChannel>(name, rank, world, slot_bytes, kDepth, timeout);
      announce[0] = 1;
      std::memcpy(announce.data_ptr<uint8_t>() + 1, name.data(), std::min<size_t>(name.size(), kNameBytes - 1));
    } catch (const SharedMemoryUnavailable& e) {
      reason = e.what();
    }
  }
  {
    std::vector<at::Tensor> tensors{announce};
    c10d::BroadcastOptions options;
    options.rootRank = 0;
    group.broadcast(tensors, options)->wait();
  }
  if (rank != 0 && wanted) {
    if (announce[0].item<uint8_t>() == 1) {
      const std::string name(reinterpret_cast<const char*>(announce.data_ptr<uint8_t>() + 1));
      try {
        channel = std::make_shared<SharedMemoryChannel>(name, rank, world, slot_bytes, kDepth, timeout);
      } catch (const SharedMemoryUnavailable& e) {
        reason = e.what();
      }
    } else {
      reason = "rank 0 could not create the segment";
    }
  }
  at::Tensor failed = at::zeros({world}, at::kInt);  // one flag per rank: who could not open it
  failed[rank] = channel ? 0 : 1;
  {
    std::vector<at::Tensor> tensors{failed};
    group.allreduce(tensors, c10d::AllreduceOptions())->wait();
  }
  if (rank == 0 && channel) channel->unlink();  // every rank that could open it has: the name is not needed
  for (int r = 0; r < world; ++r) {
    if (failed[r].item<int32_t>() == 0) continue;
    why_not = "rank " + std::to_string(r) + " could not use a shared-memory segment" +
              (r == rank ? ": " + reason : " (its own error says why)");
    return nullptr;
  }
  return channel;
}

}  // namespace zerocore::bindings
