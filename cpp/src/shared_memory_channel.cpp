// Note [Shared-memory transport] in zerocore/shared_memory_channel.hpp.
#include "zerocore/shared_memory_channel.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <random>
#include <thread>

#include "zerocore/error.hpp"

namespace zerocore {
namespace {

constexpr uint64_t kMagic = 0x7a63'7368'6d31'0001ULL;  // "zcshm1", version 1
constexpr size_t kLine = 64;

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "the segment's counters must be lock-free to work across processes");

// One rank's published state, on its own cache line.
struct alignas(kLine) RankState {
  std::atomic<uint64_t> posted;    // steps whose data this rank has written
  std::atomic<uint64_t> consumed;  // steps this rank has finished reading
  std::atomic<uint32_t> bell;      // futex word, bumped after every change of posted / consumed / broken
  std::atomic<uint32_t> waiters;   // processes sleeping on `bell`
  std::atomic<int64_t> pid;
  std::atomic<uint64_t> pid_namespace;  // inode of /proc/self/ns/pid: pids compare only within one namespace
};

// What a slot holds, written by its owner before it publishes the step; readers check it against their own.
struct alignas(kLine) SlotHeader {
  uint64_t exchange;  // the channel's exchange number
  uint64_t bytes;     // the exchange's message size
  uint64_t step;      // the step's index within the exchange
  uint64_t mode;      // 1: one message for all receivers
};

struct alignas(kLine) SegmentHeader {
  uint64_t magic;
  uint64_t world;
  uint64_t depth;
  uint64_t slot_bytes;
  std::atomic<int32_t> broken;  // 0, or 1 + the first rank that failed
};

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

uint64_t pid_namespace_inode() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

std::string errno_text(int error) { return std::strerror(error); }

// /proc/<pid>/stat's state field, after the parenthesized command name (which may itself hold ')').
bool is_zombie(pid_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');
  return close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

bool process_gone(pid_t pid) { return (::kill(pid, 0) != 0 && errno == ESRCH) || is_zombie(pid); }

constexpr const char* kNamePrefix = "zerocore-";

}  // namespace

struct SharedMemoryChannel::Impl {
  std::string name;
  int rank = 0;
  int world = 1;
  size_t slot_bytes = 0;
  uint64_t depth = 1;
  std::chrono::milliseconds timeout{0};
  size_t bytes = 0;  // of the mapping
  int fd = -1;
  void* base = nullptr;
  SegmentHeader* header = nullptr;
  RankState* states = nullptr;   // [world]
  SlotHeader* slot_headers = nullptr;  // [world][depth]
  char* data = nullptr;          // [world][depth][world][slot_bytes]
  bool unlinked = false;
  pid_t owner = 0;               // the process that opened it: a forked child must not touch the worker

  uint64_t next_step = 0;        // worker thread only
  uint64_t next_exchange = 0;    // worker thread only

  struct Queued {
    SharedMemoryExchange exchange;
    std::promise<void> done;
  };
  std::mutex mutex;
  std::condition_variable wake_worker;
  std::condition_variable went_idle;  // the queue ran empty with nothing in flight
  std::deque<Queued> queue;
  bool closing = false;
  bool busy = false;                  // an exchange is in flight on the worker
  std::atomic<bool> abort{false};     // waits end with an error
  std::string failure;                // the first error; every later exchange fails with it
  std::unique_ptr<std::thread> worker;

  size_t region_bytes() const { return depth * static_cast<size_t>(world) * slot_bytes; }
  char* sub_slot(int owner_rank, uint64_t slot, int receiver) const {
    return data + owner_rank * region_bytes() + (slot * world + receiver) * slot_bytes;
  }
  char* whole_slot(int owner_rank, uint64_t slot) const { return sub_slot(owner_rank, slot, 0); }
  SlotHeader& slot_header(int owner_rank, uint64_t slot) const { return slot_headers[owner_rank * depth + slot]; }

  void ring(int r) {
    RankState& s = states[r];
    s.bell.fetch_add(1, std::memory_order_seq_cst);
    if (s.waiters.load(std::memory_order_seq_cst) > 0) futex(&s.bell, FUTEX_WAKE, INT_MAX, nullptr);
  }

  // False once rank r's process is gone: no such pid, or a zombie its parent has not reaped yet.
  bool alive(int r) const {
    const RankState& s = states[r];
    if (s.pid_namespace.load() == 0 || s.pid_namespace.load() != states[rank].pid_namespace.load()) return true;
    return !process_gone(static_cast<pid_t>(s.pid.load()));
  }

  [[noreturn]] void fail(const std::string& message) {
    int32_t none = 0;
    header->broken.compare_exchange_strong(none, rank + 1);
    for (int r = 0; r < world; ++r) ring(r);
    throw SharedMemoryError(message);
  }

  // Waits until `counter` of rank `peer` reaches `target`; `what` says what for the error messages.
  void wait_for(int peer, const std::atomic<uint64_t>& counter, uint64_t target, const char* what) {
    RankState& s = states[peer];
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int spins = 0;; ++spins) {
      const uint32_t bell = s.bell.load(std::memory_order_seq_cst);
      if (counter.load(std::memory_order_acquire) >= target) return;
      const int32_t broken = header->broken.load(std::memory_order_acquire);
      if (broken != 0) {
        throw SharedMemoryError(detail::concat("shared-memory collective: rank ", broken - 1,
                                               " failed in a collective this rank (", rank, ") waits on"));
      }
      if (abort.load(std::memory_order_acquire)) {
        throw SharedMemoryError("shared-memory collective: the channel was closed while it waited for rank " +
                                std::to_string(peer));
      }
      if (spins < 64) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        continue;
      }
      s.waiters.fetch_add(1, std::memory_order_seq_cst);
      const timespec slice{0, 5'000'000};  // 5 ms: how soon a dead peer, a close or the deadline is noticed
      futex(&s.bell, FUTEX_WAIT, bell, &slice);
      s.waiters.fetch_sub(1, std::memory_order_seq_cst);
      if (counter.load(std::memory_order_acquire) >= target) return;
      if (!alive(peer)) {
        fail(detail::concat("shared-memory collective: rank ", peer, " (pid ", s.pid.load(),
                            ") exited while rank ", rank, " waited for it to ", what));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        fail(detail::concat("shared-memory collective: rank ", rank, " waited ", timeout.count(),
                             " ms (the process group's timeout) for rank ", peer, " to ", what,
                             "; a rank that stopped issuing collectives or issued others leaves its peers waiting"));
      }
    }
  }

  void run_exchange(const SharedMemoryExchange& x) {
    const uint64_t exchange = next_exchange++;
    if (x.bytes == 0) return;
    const size_t chunk = x.same_for_all ? slot_bytes * world : slot_bytes;
    const uint64_t steps = (x.bytes + chunk - 1) / chunk;
    for (uint64_t step = 0; step < steps; ++step) {
      const uint64_t g = next_step++;
      const uint64_t slot = g % depth;
      const size_t offset = step * chunk;
      const size_t len = std::min(chunk, x.bytes - offset);
      if (g >= depth) {  // every reader is done with this slot's previous use
        for (int p = 0; p < world; ++p) {
          if (p != rank) wait_for(p, states[p].consumed, g - depth + 1, "read the previous data of this slot");
        }
      }
      if (x.same_for_all) {
        std::memcpy(whole_slot(rank, slot), static_cast<const char*>(x.send[rank == 0 ? 1 : 0]) + offset, len);
      } else {
        for (int p = 0; p < world; ++p) {
          if (p != rank) std::memcpy(sub_slot(rank, slot, p), static_cast<const char*>(x.send[p]) + offset, len);
        }
      }
      slot_header(rank, slot) = SlotHeader{exchange, x.bytes, step, x.same_for_all ? 1u : 0u};
      states[rank].posted.store(g + 1, std::memory_order_release);
      ring(rank);
      for (int p = 0; p < world; ++p) {
        if (p == rank) continue;
        wait_for(p, states[p].posted, g + 1, "send its part of the collective");
        const SlotHeader theirs = slot_header(p, slot);
        if (theirs.exchange != exchange || theirs.bytes != x.bytes || theirs.step != step ||
            theirs.mode != (x.same_for_all ? 1u : 0u)) {
          fail(detail::concat("shared-memory collective: ranks ", rank, " and ", p,
                              " are in different collectives (this rank: exchange ", exchange, " of ", x.bytes,
                              " bytes", x.same_for_all ? ", one message for all" : "", "; rank ", p, ": exchange ",
                              theirs.exchange, " of ", theirs.bytes, " bytes",
                              theirs.mode ? ", one message for all" : "",
                              "); every rank must issue the same collectives in the same order"));
        }
        const char* from = x.same_for_all ? whole_slot(p, slot) : sub_slot(p, slot, rank);
        std::memcpy(static_cast<char*>(x.recv[p]) + offset, from, len);
      }
      states[rank].consumed.store(g + 1, std::memory_order_release);
      ring(rank);
    }
  }

  void run() {
    for (;;) {
      Queued item;
      {
        std::unique_lock<std::mutex> lock(mutex);
        wake_worker.wait(lock, [&] { return closing || !queue.empty(); });
        if (queue.empty()) return;
        item = std::move(queue.front());
        queue.pop_front();
        busy = true;
      }
      std::exception_ptr error;
      {
        std::string earlier;
        {
          std::lock_guard<std::mutex> lock(mutex);
          earlier = failure;
        }
        try {
          if (!earlier.empty()) throw SharedMemoryError("an earlier shared-memory collective failed: " + earlier);
          run_exchange(item.exchange);
        } catch (const std::exception& e) {
          error = std::current_exception();
          std::lock_guard<std::mutex> lock(mutex);
          if (failure.empty()) failure = e.what();
        }
      }
      if (error) {
        item.done.set_exception(error);
      } else {
        item.done.set_value();
      }
      {
        std::lock_guard<std::mutex> lock(mutex);
        busy = false;
      }
      went_idle.notify_all();
    }
  }
};

std::string SharedMemoryChannel::fresh_name() {
  static std::atomic<uint64_t> counter{0};
  std::random_device device;
  const uint64_t bits = (static_cast<uint64_t>(device()) << 32) ^ device();
  char out[128];
  std::snprintf(out, sizeof(out), "/%s%llu-%ld-%llu-%016llx", kNamePrefix,
                static_cast<unsigned long long>(pid_namespace_inode()), static_cast<long>(::getpid()),
                static_cast<unsigned long long>(counter.fetch_add(1)), static_cast<unsigned long long>(bits));
  return out;
}

int SharedMemoryChannel::remove_stale_segments(const std::string& directory) {
  const uint64_t namespace_inode = pid_namespace_inode();
  if (namespace_inode == 0) return 0;  // no /proc: liveness cannot be told, so nothing is removed
  DIR* dir = ::opendir(directory.c_str());
  if (dir == nullptr) return 0;
  int removed = 0;
  while (const dirent* entry = ::readdir(dir)) {
    unsigned long long inode = 0, counter = 0, bits = 0;
    long pid = 0;
    int consumed = 0;
    const std::string format = std::string(kNamePrefix) + "%llu-%ld-%llu-%llx%n";
    if (std::sscanf(entry->d_name, format.c_str(), &inode, &pid, &counter, &bits, &consumed) != 4 ||
        entry->d_name[consumed] != '\0' || inode != namespace_inode || pid <= 0 || pid == ::getpid()) {
      continue;  // not ours, or made in another pid namespace (its pid means nothing here)
    }
    if (process_gone(static_cast<pid_t>(pid)) && ::shm_unlink(("/" + std::string(entry->d_name)).c_str()) == 0) {
      ++removed;
    }
  }
  ::closedir(dir);
  return removed;
}

SharedMemoryChannel::SharedMemoryChannel(const std::string& name, int rank, int world, size_t slot_bytes, int depth,
                                         std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>()) {
  ZC_CHECK_ARG(world >= 2 && rank >= 0 && rank < world, "shared-memory channel: rank ", rank, " of world ", world);
  ZC_CHECK_ARG(slot_bytes >= kLine && slot_bytes % kLine == 0, "shared-memory channel: slot_bytes ", slot_bytes,
               " must be a positive multiple of ", kLine);
  ZC_CHECK_ARG(depth >= 1, "shared-memory channel: depth must be >= 1, got ", depth);
  ZC_CHECK_ARG(timeout.count() > 0, "shared-memory channel: timeout must be positive");
  Impl& m = *impl_;
  m.name = name;
  m.rank = rank;
  m.world = world;
  m.slot_bytes = slot_bytes;
  m.depth = static_cast<uint64_t>(depth);
  m.timeout = timeout;
  m.owner = ::getpid();
  const size_t header_bytes = round_up(sizeof(SegmentHeader), kLine) + sizeof(RankState) * world +
                              sizeof(SlotHeader) * world * depth;
  const size_t data_offset = round_up(header_bytes, 4096);
  m.bytes = data_offset + m.region_bytes() * world;

  const bool create = rank == 0;
  m.fd = ::shm_open(name.c_str(), create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
  if (m.fd < 0) {
    throw SharedMemoryUnavailable("shm_open(" + name + ") failed on rank " + std::to_string(rank) + ": " +
                                  errno_text(errno));
  }
  auto give_up = [&](const std::string& what, int error) {
    ::close(m.fd);
    if (create) ::shm_unlink(name.c_str());
    throw SharedMemoryUnavailable(what + " failed for " + name + " on rank " + std::to_string(rank) + ": " +
                                  errno_text(error));
  };
  if (create) {
    // Reserve the pages now: a tmpfs that is full fails here instead of with SIGBUS at the first write.
    if (::ftruncate(m.fd, static_cast<off_t>(m.bytes)) != 0) give_up("ftruncate", errno);
    const int reserved = ::posix_fallocate(m.fd, 0, static_cast<off_t>(m.bytes));
    if (reserved != 0) give_up("posix_fallocate of " + std::to_string(m.bytes) + " bytes", reserved);
  } else {
    struct stat st {};
    if (::fstat(m.fd, &st) != 0) give_up("fstat", errno);
    if (static_cast<size_t>(st.st_size) != m.bytes) {
      give_up("the segment's size (" + std::to_string(st.st_size) + " bytes, expected " + std::to_string(m.bytes) +
                  ")",
              EINVAL);
    }
  }
  m.base = ::mmap(nullptr, m.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, m.fd, 0);
  if (m.base == MAP_FAILED) {
    m.base = nullptr;
    give_up("mmap", errno);
  }
  char* base = static_cast<char*>(m.base);
  m.header = reinterpret_cast<SegmentHeader*>(base);
  m.states = reinterpret_cast<RankState*>(base + round_up(sizeof(SegmentHeader), kLine));
  m.slot_headers = reinterpret_cast<SlotHeader*>(reinterpret_cast<char*>(m.states) + sizeof(RankState) * world);
  m.data = base + data_offset;
  if (create) {
    SegmentHeader* h = new (base) SegmentHeader{};
    h->world = static_cast<uint64_t>(world);
    h->depth = m.depth;
    h->slot_bytes = slot_bytes;
    h->broken.store(0);
    for (int r = 0; r < world; ++r) new (&m.states[r]) RankState{};
    std::atomic_thread_fence(std::memory_order_release);
    h->magic = kMagic;
  } else if (m.header->magic != kMagic || m.header->world != static_cast<uint64_t>(world) ||
             m.header->depth != m.depth || m.header->slot_bytes != slot_bytes) {
    ::munmap(m.base, m.bytes);
    give_up("checking the segment's header (another layout or version)", EINVAL);
  }
  m.states[rank].pid.store(static_cast<int64_t>(::getpid()));
  m.states[rank].pid_namespace.store(pid_namespace_inode());
  m.worker = std::make_unique<std::thread>([this] { impl_->run(); });
}

SharedMemoryChannel::~SharedMemoryChannel() {
  Impl& m = *impl_;
  if (::getpid() != m.owner) {  // a forked child: the worker thread is not ours; leave everything to the parent
    (void)m.worker.release();
    return;
  }
  bool pending = false;
  {
    std::unique_lock<std::mutex> lock(m.mutex);
    m.closing = true;
    m.wake_worker.notify_all();
    // Collectives already issued get a moment to finish: the peers are most likely dropping their Comms
    // alike and finishing theirs. Past that, the peers waiting on them fail at once instead of at the deadline.
    const auto drain = std::min<std::chrono::milliseconds>(m.timeout, std::chrono::seconds(10));
    pending = !m.went_idle.wait_for(lock, drain, [&] { return m.queue.empty() && !m.busy; });
    if (pending && m.failure.empty()) m.failure = "the channel was closed with collectives in flight";
  }
  if (pending) {
    int32_t none = 0;
    m.header->broken.compare_exchange_strong(none, m.rank + 1);
    for (int r = 0; r < m.world; ++r) m.ring(r);
    m.abort.store(true);
  }
  if (m.worker && m.worker->joinable()) m.worker->join();
  if (m.base) ::munmap(m.base, m.bytes);
  if (m.fd >= 0) ::close(m.fd);
  if (m.rank == 0 && !m.unlinked) ::shm_unlink(m.name.c_str());
}

void SharedMemoryChannel::unlink() {
  if (!impl_->unlinked) {
    ::shm_unlink(impl_->name.c_str());
    impl_->unlinked = true;
  }
}

int SharedMemoryChannel::rank() const { return impl_->rank; }
int SharedMemoryChannel::world() const { return impl_->world; }
size_t SharedMemoryChannel::segment_bytes() const { return impl_->bytes; }

std::shared_future<void> SharedMemoryChannel::submit(SharedMemoryExchange exchange) {
  Impl& m = *impl_;
  ZC_CHECK_ARG(exchange.send.size() == static_cast<size_t>(m.world) &&
                   exchange.recv.size() == static_cast<size_t>(m.world),
               "shared-memory exchange: send and recv need one entry per rank (", m.world, "), got ",
               exchange.send.size(), " and ", exchange.recv.size());
  for (int p = 0; p < m.world; ++p) {
    ZC_CHECK_ARG(p == m.rank || exchange.bytes == 0 || (exchange.send[p] && exchange.recv[p]),
                 "shared-memory exchange: a null buffer for rank ", p);
  }
  Impl::Queued item;
  item.exchange = std::move(exchange);
  std::shared_future<void> done = item.done.get_future().share();
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    ZC_CHECK(!m.closing, "shared-memory channel: submit after close");
    m.queue.push_back(std::move(item));
  }
  m.wake_worker.notify_one();
  return done;
}

}  // namespace zerocore
