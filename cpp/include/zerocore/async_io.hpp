// An asynchronous file I/O engine: requests are cut into block_size chunks that a pool of worker threads
// executes with pread/pwrite, at most queue_depth chunks in flight per engine. Torch-free; the bindings
// expose it as zerocore._C.AsyncIO (checkpoint reads, NVMe offload of optimizer state).
//
// Note [Async I/O engine]
// -----------------------
// Configuration (DeepSpeed's `aio` section): block_size is the chunk size (a multiple of 4096);
// queue_depth caps the chunks being transferred at once, over all requests; thread_count is the number of
// worker threads, each transferring one chunk at a time (blocking pread/pwrite), so at most
// min(thread_count, queue_depth) chunks are in flight. overlap_events = true starts the next chunk as soon
// as one finishes; false issues chunks in waves of queue_depth, the next wave once the whole previous one
// finished (DeepSpeed's submit-then-reap loop). single_submit is accepted for DeepSpeed configs but has
// no effect: every chunk is its own system call, there is no batch submission to split.
//
// Chunks are cut at file offsets that are multiples of block_size, and executed in submission order
// (requests FIFO, a request's chunks in order). A chunk whose buffer address, file offset and length are
// all multiples of 4096 goes through an O_DIRECT descriptor (no page cache); its unaligned head or tail
// (when buffer and offset are misaligned alike) and anything misaligned go through a second, buffered
// descriptor of the same file. A file system that rejects O_DIRECT at open gets buffered I/O throughout;
// direct(handle) says which.
//
// Completion: wait(id) blocks until a request finished and throws its error (an IoError naming the path,
// the failing chunk's offset and length, and errno); the request is then forgotten. poll(id) says whether
// it finished without forgetting it. Requests may be waited in any order, from any thread. A failing chunk
// fails its request: the request's chunks not yet started are skipped, those in flight finish, and the
// other requests go on. EINTR and partial transfers are retried; reading past the end of the file is an
// error (short read). The caller keeps each buffer alive and untouched until its request is waited.
//
// Handles: close(handle) forgets the handle at once; requests already submitted on it still complete
// (their descriptors close when the last of them finishes). fsync(handle) flushes what the file holds
// now: wait a handle's writes before its fsync. The destructor waits for every outstanding request,
// ignoring their errors, joins the workers and closes every descriptor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace zerocore {

struct AioConfig {
  size_t block_size = 1 << 20;
  int queue_depth = 8;
  int thread_count = 1;
  bool single_submit = false;
  bool overlap_events = true;
};

// Throws InvalidArgument naming the bad field.
void validate(const AioConfig& config);

// r: read an existing file. w: write, creating or truncating. rw: read and write, creating if missing,
// never truncating.
enum class OpenMode { kRead, kWrite, kReadWrite };
// Parses "r" | "w" | "rw"; throws InvalidArgument otherwise.
OpenMode parse_open_mode(const std::string& mode);
const char* open_mode_name(OpenMode mode);

// Alignment (bytes) of buffer address, file offset and length for a chunk to go through O_DIRECT.
constexpr size_t kDirectAlignment = 4096;

class AsyncIO {
 public:
  explicit AsyncIO(const AioConfig& config = AioConfig{});
  ~AsyncIO();
  AsyncIO(const AsyncIO&) = delete;
  AsyncIO& operator=(const AsyncIO&) = delete;

  const AioConfig& config() const;

  // Opens `path`; throws IoError naming the path and the system's reason. Handles are never reused.
  int64_t open(const std::string& path, OpenMode mode);
  void close(int64_t handle);
  // Closes every handle (as close does for each).
  void close_all();
  // Whether the handle's aligned chunks use O_DIRECT (false where the file system refused it).
  bool direct(int64_t handle) const;
  std::string path(int64_t handle) const;
  OpenMode mode(int64_t handle) const;
  // Current size of the file in bytes.
  uint64_t size(int64_t handle) const;
  // fsync(2) of the file; throws IoError.
  void fsync(int64_t handle);
  // ftruncate(2) to nbytes (writable handles); throws IoError.
  void truncate(int64_t handle, uint64_t nbytes);
  // posix_fallocate(3) of [offset, offset + nbytes) (writable handles); throws IoError.
  void allocate(int64_t handle, uint64_t offset, uint64_t nbytes);

  // Queue a transfer of nbytes between the buffer and the file at file_offset; returns the request id
  // (> 0, never reused). Throws InvalidArgument for an unknown handle, a handle not open for the
  // direction, or a null buffer with nbytes > 0. nbytes == 0 completes at once.
  int64_t submit_read(int64_t handle, uint64_t file_offset, void* dst, size_t nbytes);
  int64_t submit_write(int64_t handle, uint64_t file_offset, const void* src, size_t nbytes);

  // Blocks until the request finished, forgets it, and throws its IoError if it failed. InvalidArgument
  // for an id that is not pending (never submitted, or already waited).
  void wait(int64_t request);
  // Whether the request finished (successfully or not); it stays pending until waited.
  bool poll(int64_t request) const;
  // Waits for every pending request and forgets them all; then throws the error of the earliest failed
  // one (by id), if any.
  void wait_all();
  // Requests submitted and not yet waited; whether `request` is one of them.
  size_t pending() const;
  bool is_pending(int64_t request) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zerocore
