// Point-to-point exchanges between the processes of one host through a shared-memory segment: the transport
// behind the "shared_memory" collective algorithms (bindings/shared_memory_collectives.cpp). Torch-free.
//
// Note [Shared-memory transport]
// ------------------------------
// Gloo moves every byte between two processes of one machine through loopback TCP: a copy into the kernel,
// a copy out, and the socket machinery between, at 2-3 GB/s here (bench/collectives.py). Ranks on one host can
// instead copy through memory they both map: the sender copies its message into its own region of the segment,
// the receiver copies it out, at memcpy speed (15-20 GB/s). NCCL does the same within a node (its SHM and P2P
// transports); this is that transport for CPU tensors.
//
// Layout: a header, then per rank a region of `depth` slots, each slot `world` sub-slots of `slot_bytes` (one
// per receiver). An exchange moves one message of `bytes` from every rank to every other rank, cut into steps
// of one sub-slot (or, when a rank sends the same message to all, of one whole slot, written once). Steps are
// numbered by a counter every rank advances alike (ranks run the same exchanges in the same order, as for any
// collective), and step g uses slot g % depth. In step g a rank waits until every peer has consumed step
// g - depth (its slot is free again), writes its sub-slots and the slot's header (exchange number, size, mode),
// publishes `posted = g + 1`, then for every peer waits for that peer's `posted > g`, checks the peer's slot
// header against its own exchange (a mismatch means the ranks are in different collectives: an error on both,
// never wrong data) and copies the peer's sub-slot out, and publishes `consumed = g + 1`. So up to `depth`
// steps are in flight and no slot is overwritten before every reader is done with it.
//
// Waiting: a rank's counters change together with its `bell`, a futex word bumped after every change; a waiter
// spins briefly, then sleeps on the bell of the rank it waits for, in slices of a few milliseconds, between
// which it checks that the channel is not being closed, that no rank has marked the segment broken, that the
// rank it waits for is still alive (when all ranks share a PID namespace) and that the deadline (the process
// group's timeout) has not passed. Each ends the wait with a SharedMemoryError naming the rank; a rank that
// fails marks the segment broken first, so its peers fail at once instead of at the deadline.
//
// Exchanges run on one worker thread per channel, in submission order, so a submit returns at once (like a
// backend's asynchronous collective) and progress does not depend on when the caller waits. Buffers must stay
// alive and unmodified until the exchange's future is ready: the caller owns them (the worker holds no
// reference, so it never has to release a Python-owned tensor, which would need the GIL).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace zerocore {

// The segment could not be created or opened here (no /dev/shm, no space, another host): callers fall back to
// another transport. Maps to RuntimeError in Python.
class SharedMemoryUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An exchange failed: a peer died, timed out, or ran a different collective. Maps to RuntimeError in Python.
class SharedMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct SharedMemoryExchange {
  std::vector<const void*> send;     // [world]: the message peer p receives (entry `rank` unused)
  std::vector<void*> recv;           // [world]: where peer p's message lands (entry `rank` unused)
  size_t bytes = 0;                  // every message's size
  bool same_for_all = false;         // every send[p] is the same message: written once per step
};

class SharedMemoryChannel {
 public:
  // A fresh segment name: unique on this host (the pid namespace, the pid, a per-process counter and random
  // bits).
  static std::string fresh_name();
  // Removes the segments in `directory` (where shm_open's names live) that a process of this pid namespace
  // created and died holding: killed between creating a segment and the rendezvous's unlink, it leaves one
  // behind. Rank 0 calls it before creating its own. Returns how many it removed.
  static int remove_stale_segments(const std::string& directory = "/dev/shm");
  // Rank 0 creates the segment `name` (exclusively) and initialises it; every other rank must call this after
  // rank 0's call returned, and opens it. Throws SharedMemoryUnavailable with the reason when that fails.
  SharedMemoryChannel(const std::string& name, int rank, int world, size_t slot_bytes, int depth,
                      std::chrono::milliseconds timeout);
  // Closes: lets what is queued or in flight finish for up to 10 s (or the timeout, if shorter), then fails
  // the rest, marking the segment broken if anything was left (so peers fail at once); joins the worker and
  // unmaps.
  ~SharedMemoryChannel();
  SharedMemoryChannel(const SharedMemoryChannel&) = delete;
  SharedMemoryChannel& operator=(const SharedMemoryChannel&) = delete;

  // Removes the name (the memory stays until every rank has closed it); rank 0 calls it once all ranks opened.
  void unlink();
  int rank() const;
  int world() const;
  size_t segment_bytes() const;

  // Queues one exchange; the future is ready when this rank has sent its messages and received all of its
  // peers'. It throws SharedMemoryError if the exchange failed (then every later one fails too).
  std::shared_future<void> submit(SharedMemoryExchange exchange);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zerocore
