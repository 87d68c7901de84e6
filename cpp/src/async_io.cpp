// The asynchronous file I/O engine; see Note [Async I/O engine] in zerocore/async_io.hpp.
#include "zerocore/async_io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "zerocore/error.hpp"

namespace zerocore {
namespace {

// One pread/pwrite moves at most this much (Linux caps a transfer at 0x7ffff000 bytes anyway).
constexpr size_t kMaxTransfer = size_t{1} << 30;

std::string errno_text(int error) { return detail::concat(std::strerror(error), " (errno ", error, ")"); }

const char* mode_purpose(OpenMode mode) {
  switch (mode) {
    case OpenMode::kRead: return "reading";
    case OpenMode::kWrite: return "writing";
    case OpenMode::kReadWrite: return "reading and writing";
  }
  return "?";
}

bool aligned(uint64_t value) { return value % kDirectAlignment == 0; }

std::string parent_directory(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

struct File {
  std::string path;
  OpenMode mode = OpenMode::kRead;
  int fd = -1;         // buffered
  int direct_fd = -1;  // O_DIRECT, -1 when the file system refused it
  // Cleared when a direct transfer fails with EINVAL (a file system that accepts O_DIRECT at open but not
  // for I/O): the rest goes through fd.
  std::atomic<bool> direct_ok{false};

  File() = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (direct_fd >= 0) ::close(direct_fd);
    if (fd >= 0) ::close(fd);
  }
  bool readable() const { return mode != OpenMode::kWrite; }
  bool writable() const { return mode != OpenMode::kRead; }
};

struct Request {
  int64_t id = 0;
  bool is_write = false;
  std::shared_ptr<File> file;  // dropped once the request is done, so close() takes effect
  uint64_t offset = 0;
  unsigned char* buffer = nullptr;
  size_t nbytes = 0;
  size_t block_size = 0;
  size_t num_chunks = 0;
  size_t next_chunk = 0;      // the next chunk to start
  size_t settled_chunks = 0;  // finished or skipped
  bool done = false;
  std::optional<IoError> error;

  // Chunks are cut at file offsets that are multiples of block_size.
  uint64_t chunk_begin(size_t i) const { return i == 0 ? offset : (offset / block_size + i) * block_size; }
  uint64_t chunk_end(size_t i) const {
    return i + 1 == num_chunks ? offset + nbytes : (offset / block_size + i + 1) * block_size;
  }
};

// Moves [begin, end) of the request between its buffer and its file; returns the error, if any.
std::optional<IoError> run_chunk(const Request& req, size_t chunk) {
  const uint64_t begin = req.chunk_begin(chunk);
  const uint64_t end = req.chunk_end(chunk);
  File& file = *req.file;
  unsigned char* const buf = req.buffer + (begin - req.offset);
  const size_t len = static_cast<size_t>(end - begin);
  const char* const what = req.is_write ? "write" : "read";
  size_t done = 0;
  while (done < len) {
    const uint64_t pos = begin + done;
    unsigned char* const ptr = buf + done;
    const size_t remaining = len - done;
    const bool use_direct_fd = file.direct_ok.load(std::memory_order_relaxed);
    // O_DIRECT needs the buffer and the file offset equally misaligned: then the head up to the next
    // 4096 boundary goes buffered, the whole pages direct, the tail buffered.
    const bool same_phase = use_direct_fd && reinterpret_cast<uintptr_t>(ptr) % kDirectAlignment == pos % kDirectAlignment;
    int fd = file.fd;
    size_t n = remaining;
    if (same_phase && aligned(pos) && remaining >= kDirectAlignment) {
      fd = file.direct_fd;
      n = remaining / kDirectAlignment * kDirectAlignment;
    } else if (same_phase && !aligned(pos)) {
      n = std::min<size_t>(remaining, kDirectAlignment - pos % kDirectAlignment);
    }
    n = std::min(n, kMaxTransfer);
    if (fd == file.direct_fd) n = n / kDirectAlignment * kDirectAlignment;
    const ssize_t got = req.is_write ? ::pwrite(fd, ptr, n, static_cast<off_t>(pos))
                                     : ::pread(fd, ptr, n, static_cast<off_t>(pos));
    if (got < 0) {
      const int error = errno;
      if (error == EINTR) continue;
      if (fd == file.direct_fd && error == EINVAL) {
        file.direct_ok.store(false, std::memory_order_relaxed);
        continue;
      }
      return IoError(detail::concat(what, " of ", len, " bytes at offset ", begin, " of ", file.path,
                                    " failed: ", errno_text(error)),
                     error, file.path, static_cast<int64_t>(begin));
    }
    if (got == 0) {
      if (req.is_write) {
        return IoError(detail::concat("write of ", len, " bytes at offset ", begin, " of ", file.path,
                                      " failed: the system wrote 0 of ", remaining, " bytes at offset ", pos),
                       EIO, file.path, static_cast<int64_t>(begin));
      }
      // The end of the file: say where it is now (the size), which may lie before pos when another chunk of
      // the same request was the first to reach it.
      uint64_t file_end = pos;
      struct stat st;
      if (::fstat(file.fd, &st) == 0 && static_cast<uint64_t>(st.st_size) < pos) file_end = st.st_size;
      return IoError(detail::concat("short read: ", file.path, " ends at byte ", file_end, ", wanted bytes [",
                                    req.offset, ", ", req.offset + req.nbytes, ")"),
                     EIO, file.path, static_cast<int64_t>(begin));
    }
    done += static_cast<size_t>(got);
  }
  return std::nullopt;
}

}  // namespace

void validate(const AioConfig& config) {
  ZC_CHECK_ARG(config.block_size > 0 && config.block_size % kDirectAlignment == 0,
               "aio block_size must be a positive multiple of ", kDirectAlignment, " bytes, got ", config.block_size);
  ZC_CHECK_ARG(config.block_size <= (size_t{1} << 40), "aio block_size must be at most 1 TiB, got ",
               config.block_size);
  ZC_CHECK_ARG(config.queue_depth > 0, "aio queue_depth must be >= 1, got ", config.queue_depth);
  ZC_CHECK_ARG(config.thread_count > 0, "aio thread_count must be >= 1, got ", config.thread_count);
  ZC_CHECK_ARG(config.thread_count <= 1024, "aio thread_count must be at most 1024, got ", config.thread_count);
}

OpenMode parse_open_mode(const std::string& mode) {
  if (mode == "r") return OpenMode::kRead;
  if (mode == "w") return OpenMode::kWrite;
  if (mode == "rw") return OpenMode::kReadWrite;
  throw InvalidArgument("open mode must be 'r' (read), 'w' (write: create or truncate) or 'rw' (read and write: "
                        "create if missing), got '" + mode + "'");
}

const char* open_mode_name(OpenMode mode) {
  switch (mode) {
    case OpenMode::kRead: return "r";
    case OpenMode::kWrite: return "w";
    case OpenMode::kReadWrite: return "rw";
  }
  return "?";
}

struct AsyncIO::Impl {
  AioConfig config;

  mutable std::mutex mutex;
  std::condition_variable work_cv;  // workers: a chunk may start, or stop
  std::condition_variable done_cv;  // waiters: a request finished
  std::deque<std::shared_ptr<Request>> queue;                        // requests with chunks not started
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests;    // submitted, not waited
  std::unordered_map<int64_t, std::shared_ptr<File>> files;          // open handles
  int64_t next_request = 1;
  int64_t next_handle = 1;
  int in_flight = 0;        // chunks being transferred
  int wave_started = 0;     // overlap_events = false: chunks started since in_flight was last 0
  size_t unfinished = 0;    // requests not done
  bool stopping = false;
  std::vector<std::thread> workers;

  bool can_start() const {
    return !queue.empty() && in_flight < config.queue_depth &&
           (config.overlap_events || wave_started < config.queue_depth);
  }

  std::shared_ptr<File> file(int64_t handle) const {
    const auto it = files.find(handle);
    ZC_CHECK_ARG(it != files.end(), "aio handle ", handle, " is not open (never opened, or closed)");
    return it->second;
  }

  // Under the lock: the chunk finished with `error` (or was skipped when counted by the caller).
  void settle(Request& req, std::optional<IoError> error) {
    if (error) {
      // The earliest failing offset wins, whatever order the chunks in flight finish in.
      if (!req.error || error->offset() < req.error->offset()) req.error = std::move(error);
      if (req.next_chunk < req.num_chunks) {  // skip what has not started
        req.settled_chunks += req.num_chunks - req.next_chunk;
        req.next_chunk = req.num_chunks;
        queue.erase(std::find_if(queue.begin(), queue.end(),
                                 [&](const std::shared_ptr<Request>& r) { return r.get() == &req; }));
      }
    }
    ++req.settled_chunks;
    if (req.settled_chunks == req.num_chunks) {
      req.done = true;
      req.file.reset();
      --unfinished;
      done_cv.notify_all();
    }
  }

  void worker_loop() {
    std::unique_lock<std::mutex> lock(mutex);
    while (true) {
      work_cv.wait(lock, [&] { return stopping || can_start(); });
      if (!can_start()) return;  // stopping, and nothing left (the destructor waits for every request first)
      std::shared_ptr<Request> req = queue.front();
      const size_t chunk = req->next_chunk++;
      if (req->next_chunk == req->num_chunks) queue.pop_front();
      ++in_flight;
      ++wave_started;
      lock.unlock();
      std::optional<IoError> error;
      try {
        error = run_chunk(*req, chunk);
      } catch (const std::exception& e) {
        error = IoError(detail::concat("aio ", req->is_write ? "write" : "read", " at offset ",
                                       req->chunk_begin(chunk), " of ", req->file->path, " failed: ", e.what()),
                        EIO, req->file->path, static_cast<int64_t>(req->chunk_begin(chunk)));
      }
      lock.lock();
      --in_flight;
      if (in_flight == 0) wave_started = 0;
      settle(*req, std::move(error));
      if (can_start()) work_cv.notify_all();
    }
  }

  int64_t submit(int64_t handle, uint64_t file_offset, unsigned char* buffer, size_t nbytes, bool is_write) {
    ZC_CHECK_ARG(buffer != nullptr || nbytes == 0, "aio ", is_write ? "write" : "read",
                 ": the buffer is null but nbytes is ", nbytes);
    constexpr uint64_t kMaxOffset = static_cast<uint64_t>(std::numeric_limits<off_t>::max());
    ZC_CHECK_ARG(file_offset <= kMaxOffset && nbytes <= kMaxOffset - file_offset, "aio ",
                 is_write ? "write" : "read", " of ", nbytes, " bytes at offset ", file_offset,
                 " reaches past the largest file offset");
    std::lock_guard<std::mutex> lock(mutex);
    std::shared_ptr<File> f = file(handle);
    if (is_write) {
      ZC_CHECK_ARG(f->writable(), "aio handle ", handle, " (", f->path,
                   ") is open for reading only ('r'); open it with 'w' or 'rw' to write");
    } else {
      ZC_CHECK_ARG(f->readable(), "aio handle ", handle, " (", f->path,
                   ") is open for writing only ('w'); open it with 'rw' to read");
    }
    auto req = std::make_shared<Request>();
    req->id = next_request++;
    req->is_write = is_write;
    req->offset = file_offset;
    req->buffer = buffer;
    req->nbytes = nbytes;
    req->block_size = config.block_size;
    if (nbytes == 0) {
      req->done = true;
    } else {
      req->file = std::move(f);
      req->num_chunks = static_cast<size_t>((file_offset + nbytes - 1) / config.block_size -
                                            file_offset / config.block_size + 1);
      queue.push_back(req);
      ++unfinished;
      if (can_start()) work_cv.notify_all();
    }
    requests.emplace(req->id, req);
    return req->id;
  }
};

AsyncIO::AsyncIO(const AioConfig& config) : impl_(std::make_unique<Impl>()) {
  validate(config);
  impl_->config = config;
  try {
    for (int i = 0; i < config.thread_count; ++i) impl_->workers.emplace_back([this] { impl_->worker_loop(); });
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(impl_->mutex);
      impl_->stopping = true;
    }
    impl_->work_cv.notify_all();
    for (auto& t : impl_->workers) t.join();
    throw;
  }
}

AsyncIO::~AsyncIO() {
  {
    std::unique_lock<std::mutex> lock(impl_->mutex);
    impl_->done_cv.wait(lock, [&] { return impl_->unfinished == 0; });
    impl_->stopping = true;
  }
  impl_->work_cv.notify_all();
  for (auto& t : impl_->workers) t.join();
}

const AioConfig& AsyncIO::config() const { return impl_->config; }

int64_t AsyncIO::open(const std::string& path, OpenMode mode) {
  ZC_CHECK_ARG(!path.empty(), "aio open: the path is empty");
  ZC_CHECK_ARG(path.find('\0') == std::string::npos, "aio open: the path contains a NUL byte");
  int flags = O_CLOEXEC;
  switch (mode) {
    case OpenMode::kRead: flags |= O_RDONLY; break;
    case OpenMode::kWrite: flags |= O_WRONLY | O_CREAT | O_TRUNC; break;
    case OpenMode::kReadWrite: flags |= O_RDWR | O_CREAT; break;
  }
  auto file = std::make_shared<File>();
  file->path = path;
  file->mode = mode;
  do {
    file->fd = ::open(path.c_str(), flags, 0644);
  } while (file->fd < 0 && errno == EINTR);
  if (file->fd < 0) {
    const int error = errno;
    std::string message = detail::concat("cannot open ", path, " for ", mode_purpose(mode), " ('",
                                         open_mode_name(mode), "'): ", errno_text(error));
    if (error == ENOENT && mode != OpenMode::kRead) {
      const std::string dir = parent_directory(path);
      struct stat st;
      if (::stat(dir.c_str(), &st) != 0) message += detail::concat("; the directory ", dir, " does not exist");
    }
    throw IoError(message, error, path);
  }
  struct stat st;
  if (::fstat(file->fd, &st) == 0 && S_ISDIR(st.st_mode)) {
    throw IoError(detail::concat("cannot open ", path, " for ", mode_purpose(mode), ": ", errno_text(EISDIR)),
                  EISDIR, path);
  }
  // The O_DIRECT descriptor: same access, nothing created or truncated (the first open did that).
  const int direct_flags = (flags & O_ACCMODE) | O_CLOEXEC | O_DIRECT;
  do {
    file->direct_fd = ::open(path.c_str(), direct_flags);
  } while (file->direct_fd < 0 && errno == EINTR);
  file->direct_ok.store(file->direct_fd >= 0, std::memory_order_relaxed);

  std::lock_guard<std::mutex> lock(impl_->mutex);
  const int64_t handle = impl_->next_handle++;
  impl_->files.emplace(handle, std::move(file));
  return handle;
}

void AsyncIO::close(int64_t handle) {
  std::shared_ptr<File> file;  // closed after the lock is released, unless requests still hold it
  std::lock_guard<std::mutex> lock(impl_->mutex);
  file = impl_->file(handle);
  impl_->files.erase(handle);
}

void AsyncIO::close_all() {
  std::unordered_map<int64_t, std::shared_ptr<File>> files;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  files.swap(impl_->files);
}

bool AsyncIO::direct(int64_t handle) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->file(handle)->direct_ok.load(std::memory_order_relaxed);
}

std::string AsyncIO::path(int64_t handle) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->file(handle)->path;
}

OpenMode AsyncIO::mode(int64_t handle) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->file(handle)->mode;
}

uint64_t AsyncIO::size(int64_t handle) const {
  std::shared_ptr<File> file;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    file = impl_->file(handle);
  }
  struct stat st;
  if (::fstat(file->fd, &st) != 0) {
    const int error = errno;
    throw IoError(detail::concat("stat of ", file->path, " failed: ", errno_text(error)), error, file->path);
  }
  return static_cast<uint64_t>(st.st_size);
}

void AsyncIO::fsync(int64_t handle) {
  std::shared_ptr<File> file;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    file = impl_->file(handle);
  }
  int rc;
  do {
    rc = ::fsync(file->fd);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int error = errno;
    throw IoError(detail::concat("fsync of ", file->path, " failed: ", errno_text(error)), error, file->path);
  }
}

void AsyncIO::truncate(int64_t handle, uint64_t nbytes) {
  std::shared_ptr<File> file;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    file = impl_->file(handle);
  }
  ZC_CHECK_ARG(file->writable(), "aio truncate: handle ", handle, " (", file->path, ") is open for reading only");
  ZC_CHECK_ARG(nbytes <= static_cast<uint64_t>(std::numeric_limits<off_t>::max()), "aio truncate: ", nbytes,
               " bytes is past the largest file offset");
  int rc;
  do {
    rc = ::ftruncate(file->fd, static_cast<off_t>(nbytes));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int error = errno;
    throw IoError(detail::concat("truncate of ", file->path, " to ", nbytes, " bytes failed: ", errno_text(error)),
                  error, file->path, static_cast<int64_t>(nbytes));
  }
}

void AsyncIO::allocate(int64_t handle, uint64_t offset, uint64_t nbytes) {
  std::shared_ptr<File> file;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    file = impl_->file(handle);
  }
  ZC_CHECK_ARG(file->writable(), "aio allocate: handle ", handle, " (", file->path, ") is open for reading only");
  constexpr uint64_t kMaxOffset = static_cast<uint64_t>(std::numeric_limits<off_t>::max());
  ZC_CHECK_ARG(offset <= kMaxOffset && nbytes <= kMaxOffset - offset, "aio allocate: ", nbytes,
               " bytes at offset ", offset, " reach past the largest file offset");
  if (nbytes == 0) return;
  int error;
  do {
    error = ::posix_fallocate(file->fd, static_cast<off_t>(offset), static_cast<off_t>(nbytes));
  } while (error == EINTR);
  if (error != 0) {
    throw IoError(detail::concat("allocate of ", nbytes, " bytes at offset ", offset, " of ", file->path,
                                 " failed: ", errno_text(error)),
                  error, file->path, static_cast<int64_t>(offset));
  }
}

int64_t AsyncIO::submit_read(int64_t handle, uint64_t file_offset, void* dst, size_t nbytes) {
  return impl_->submit(handle, file_offset, static_cast<unsigned char*>(dst), nbytes, /*is_write=*/false);
}

int64_t AsyncIO::submit_write(int64_t handle, uint64_t file_offset, const void* src, size_t nbytes) {
  // The workers only read a write's buffer.
  return impl_->submit(handle, file_offset, static_cast<unsigned char*>(const_cast<void*>(src)), nbytes,
                       /*is_write=*/true);
}

void AsyncIO::wait(int64_t request) {
  std::unique_lock<std::mutex> lock(impl_->mutex);
  const auto it = impl_->requests.find(request);
  ZC_CHECK_ARG(it != impl_->requests.end(), "aio request ", request,
               " is not pending (never submitted, or already waited)");
  std::shared_ptr<Request> req = it->second;
  impl_->done_cv.wait(lock, [&] { return req->done; });
  impl_->requests.erase(request);
  if (req->error) throw IoError(*req->error);
}

bool AsyncIO::poll(int64_t request) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const auto it = impl_->requests.find(request);
  ZC_CHECK_ARG(it != impl_->requests.end(), "aio request ", request,
               " is not pending (never submitted, or already waited)");
  return it->second->done;
}

void AsyncIO::wait_all() {
  std::unique_lock<std::mutex> lock(impl_->mutex);
  std::vector<std::shared_ptr<Request>> pending;
  pending.reserve(impl_->requests.size());
  for (const auto& [id, req] : impl_->requests) pending.push_back(req);
  impl_->done_cv.wait(lock, [&] {
    return std::all_of(pending.begin(), pending.end(), [](const std::shared_ptr<Request>& r) { return r->done; });
  });
  const Request* first_failed = nullptr;
  for (const auto& req : pending) {
    impl_->requests.erase(req->id);
    if (req->error && (first_failed == nullptr || req->id < first_failed->id)) first_failed = req.get();
  }
  if (first_failed != nullptr) throw IoError(*first_failed->error);
}

size_t AsyncIO::pending() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->requests.size();
}

bool AsyncIO::is_pending(int64_t request) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->requests.count(request) != 0;
}

}  // namespace zerocore
