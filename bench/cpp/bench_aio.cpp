// zerocore-bench aio: the disk's own sequential bandwidth (one thread, large plain pwrite/pread) next to
// the zerocore::AsyncIO engine's with the given aio settings, both writing a fresh file (counted up to its
// fsync) and reading it back cold (evicted from the page cache first), plus crc32c's speed.
//
// Eviction: fsync, then posix_fadvise(POSIX_FADV_DONTNEED) drops the file's clean pages without root. The
// "buffered read, page cache" row reads the same file again, now cached, to show what eviction removed.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "zerocore/async_io.hpp"
#include "zerocore/crc32c.hpp"

namespace zerocore_bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::runtime_error system_error(const std::string& what, const std::string& path) {
  const int error = errno;
  return std::runtime_error(what + " " + path + " failed: " + std::strerror(error) + " (errno " +
                            std::to_string(error) + ")");
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using PageBuffer = std::unique_ptr<unsigned char, FreeDeleter>;

// Page-aligned, and a buffer of two huge pages or more starts at a huge page and is advised MADV_HUGEPAGE
// before it is touched, as zerocore's own direct-I/O buffers are (Note [Huge pages for direct I/O] in
// python/zerocore/_safetensors_io.py): O_DIRECT into 4 KiB pages is bounded by pinning them, not by the disk,
// and the yardstick must be the fastest way to move the bytes.
PageBuffer page_buffer(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  const bool huge = bytes >= 2 * kHuge;
  const size_t align = huge ? kHuge : 4096;
  const size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (p == nullptr) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  if (huge) ::madvise(p, rounded, MADV_HUGEPAGE);  // advice only: where refused, 4 KiB pages as before
#endif
  return PageBuffer(static_cast<unsigned char*>(p));
}

// Deterministic incompressible bytes (xorshift64*).
void fill_random(unsigned char* data, size_t bytes) {
  uint64_t state = 0x9E3779B97F4A7C15ull;
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    const uint64_t word = state * 0x2545F4914F6CDD1Dull;
    std::memcpy(data + i, &word, 8);
  }
  for (; i < bytes; ++i) data[i] = static_cast<unsigned char>(i * 131u);
}

// Removes the files it was given when the command ends, however it ends.
struct FileRemover {
  std::vector<std::string> paths;
  ~FileRemover() {
    for (const std::string& p : paths) ::unlink(p.c_str());
  }
};

int open_or_throw(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
  if (fd < 0) throw system_error("open of", path);
  return fd;
}

void fsync_or_throw(int fd, const std::string& path) {
  if (::fsync(fd) != 0) throw system_error("fsync of", path);
}

// fsync, then drop the file's pages from the page cache. Returns false when the kernel refused.
bool evict(const std::string& path) {
  const int fd = open_or_throw(path, O_RDONLY);
  fsync_or_throw(fd, path);
  const int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  return rc == 0;
}

// Whether the file system under `dir` takes O_DIRECT.
bool direct_supported(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  ::close(fd);
  ::unlink(path.c_str());
  return true;
}

// One thread, large pwrites of the whole buffer (1 GiB per call at most; O_DIRECT when `direct`, which
// needs bytes to be a multiple of 4096), then fsync: seconds up to the fsync's return.
double disk_write(const std::string& path, const unsigned char* data, size_t bytes, bool direct) {
  const int fd = open_or_throw(path, O_WRONLY | O_CREAT | O_TRUNC | (direct ? O_DIRECT : 0));
  const auto start = Clock::now();
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n =
        ::pwrite(fd, data + done, std::min(bytes - done, size_t{1} << 30), static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const auto error = system_error("write of", path);
      ::close(fd);
      throw error;
    }
    done += static_cast<size_t>(n);
  }
  fsync_or_throw(fd, path);
  const double seconds = seconds_since(start);
  ::close(fd);
  return seconds;
}

// One thread, large preads into the buffer (buffered: the kernel's readahead does the rest).
double disk_read(const std::string& path, unsigned char* data, size_t bytes, bool direct) {
  const int fd = open_or_throw(path, O_RDONLY | (direct ? O_DIRECT : 0));
  const auto start = Clock::now();
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, data + done, std::min(bytes - done, size_t{1} << 30), static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const auto error = n == 0 ? std::runtime_error("short read of " + path) : system_error("read of", path);
      ::close(fd);
      throw error;
    }
    done += static_cast<size_t>(n);
  }
  const double seconds = seconds_since(start);
  ::close(fd);
  return seconds;
}

struct Row {
  std::string key;   // JSON name
  std::string what;  // table label
  double seconds;
  size_t bytes;
  double gbps() const { return seconds > 0 ? bytes / seconds / 1e9 : 0.0; }
};

}  // namespace

int aio_command(int argc, char** argv) {
  std::string dir = "/tmp";
  int64_t bytes = int64_t{1} << 30;
  int64_t block_size = 1 << 20;
  int64_t queue_depth = 8;
  int64_t threads = 1;
  bool single_submit = false;
  bool no_overlap = false;
  bool json = false;
  ArgParser parser("aio",
                   "Sequential file bandwidth: the disk's own (one thread, large plain pwrite + fsync, and a cold\n"
                   "read after evicting the file from the page cache) next to zerocore's AsyncIO engine with the\n"
                   "given aio settings (write + fsync, cold read), and crc32c. GB/s = 1e9 bytes/s. The files\n"
                   "are removed at the end.");
  parser.add_string("path", &dir, "directory for the test files");
  parser.add_int("bytes", &bytes, 1, "bytes per file");
  parser.add_int("block-size", &block_size, 1, "aio block_size: bytes per chunk, a multiple of 4096");
  parser.add_int("queue-depth", &queue_depth, 1, "aio queue_depth: chunks in flight");
  parser.add_int("threads", &threads, 1, "aio thread_count: worker threads", "", kMaxThreads);
  parser.add_flag("single-submit", &single_submit, "aio single_submit (accepted, no effect with pread workers)");
  parser.add_flag("no-overlap-events", &no_overlap, "aio overlap_events = false: chunks in waves of queue_depth");
  parser.add_flag("json", &json, "print one JSON object on stdout instead of the table");
  if (!parser.parse(argc, argv, 1)) return 0;
  if (queue_depth > (1 << 20)) throw UsageError("--queue-depth is too large: " + std::to_string(queue_depth));

  zerocore::AioConfig config;
  config.block_size = static_cast<size_t>(block_size);
  config.queue_depth = static_cast<int>(queue_depth);
  config.thread_count = static_cast<int>(threads);
  config.single_submit = single_submit;
  config.overlap_events = !no_overlap;
  zerocore::validate(config);  // InvalidArgument: exit status 2

  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    throw UsageError("--path " + dir + " is not a directory");
  }
  const size_t n = static_cast<size_t>(bytes);
  const std::string stem = dir + "/zerocore-bench-aio." + std::to_string(::getpid());
  FileRemover remover{{stem + ".disk", stem + ".engine"}};
  const std::string& disk_path = remover.paths[0];
  const std::string& engine_path = remover.paths[1];

  PageBuffer source = page_buffer(n);
  PageBuffer target = page_buffer(n);
  fill_random(source.get(), n);
  std::memset(target.get(), 0, n);  // touched now, so no page fault lands in a timed read
  const uint32_t expected_crc = zerocore::crc32c(source.get(), n);

  std::vector<Row> rows;
  bool evicted = true;

  // The disk on its own: buffered, then (where the file system takes it and the size allows) O_DIRECT,
  // one large call at a time.
  rows.push_back({"disk_write", "disk: pwrite + fsync (1 thread)", disk_write(disk_path, source.get(), n, false), n});
  evicted = evict(disk_path) && evicted;
  rows.push_back({"disk_read_cold", "disk: pread, cold (1 thread)", disk_read(disk_path, target.get(), n, false), n});
  if (zerocore::crc32c(target.get(), n) != expected_crc) throw std::runtime_error("disk read: data mismatch");
  rows.push_back({"disk_read_cached", "disk: pread, page cache", disk_read(disk_path, target.get(), n, false), n});
  const bool disk_direct = n % 4096 == 0 && direct_supported(disk_path);
  if (disk_direct) {
    rows.push_back({"disk_direct_write", "disk: O_DIRECT pwrite + fsync (1 thread)",
                    disk_write(disk_path, source.get(), n, true), n});
    std::memset(target.get(), 0, n);
    rows.push_back({"disk_direct_read", "disk: O_DIRECT pread (1 thread)",
                    disk_read(disk_path, target.get(), n, true), n});
    if (zerocore::crc32c(target.get(), n) != expected_crc) throw std::runtime_error("disk read: data mismatch");
  }
  ::unlink(disk_path.c_str());  // frees the disk space and page cache before the engine runs

  // The engine.
  bool direct = false;
  {
    zerocore::AsyncIO engine(config);
    const int64_t handle = engine.open(engine_path, zerocore::OpenMode::kWrite);
    direct = engine.direct(handle);
    auto start = Clock::now();
    engine.wait(engine.submit_write(handle, 0, source.get(), n));
    engine.fsync(handle);
    rows.push_back({"engine_write", "engine: write + fsync", seconds_since(start), n});
    engine.close(handle);

    evicted = evict(engine_path) && evicted;
    std::memset(target.get(), 0, n);
    const int64_t reader = engine.open(engine_path, zerocore::OpenMode::kRead);
    start = Clock::now();
    engine.wait(engine.submit_read(reader, 0, target.get(), n));
    rows.push_back({"engine_read_cold", "engine: read, cold", seconds_since(start), n});
    engine.close(reader);
    if (zerocore::crc32c(target.get(), n) != expected_crc) throw std::runtime_error("engine read: data mismatch");
  }

  // crc32c over the whole buffer (from memory), the instruction path when the CPU has it; over 1 MiB
  // pieces that stay in cache; and the portable path.
  const char* crc_path = zerocore::crc32c_hardware_available() ? "sse4.2" : "portable";
  volatile uint32_t sink = 0;  // results are kept, so no timed call can be dropped
  const Timing crc_timing = time_repeats(3, [&] { sink = zerocore::crc32c(source.get(), n); });
  rows.push_back({"crc32c", format("crc32c (%s), from memory", crc_path), crc_timing.best(), n});
  const size_t piece = std::min<size_t>(n, size_t{1} << 20);
  const size_t passes = 256;
  const Timing cached_timing = time_repeats(3, [&] {
    for (size_t i = 0; i < passes; ++i) sink = zerocore::crc32c(source.get(), piece, sink);
  });
  rows.push_back({"crc32c_cached", piece >= 1024 ? format("crc32c (%s), %zu KiB in cache", crc_path, piece >> 10)
                                : format("crc32c (%s), %zu bytes in cache", crc_path, piece),
                  cached_timing.best(), piece * passes});
  const size_t portable_bytes = std::min<size_t>(n, size_t{256} << 20);
  const Timing portable_timing =
      time_repeats(1, [&] { sink = zerocore::crc32c_portable(source.get(), portable_bytes); });
  rows.push_back({"crc32c_portable", "crc32c (portable)", portable_timing.best(), portable_bytes});

  const auto gbps = [&](const std::string& key) {
    for (const Row& r : rows) {
      if (r.key == key) return r.gbps();
    }
    return 0.0;
  };
  // The engine against the faster of the disk's own single-thread figures (buffered or O_DIRECT).
  const double disk_write_best = std::max(gbps("disk_write"), gbps("disk_direct_write"));
  const double disk_read_best = std::max(gbps("disk_read_cold"), gbps("disk_direct_read"));

  if (json) {
    JsonWriter out;
    out.begin_object()
        .field_string("command", "aio")
        .field_string("path", dir)
        .field_int("bytes", bytes)
        .field_int("block_size", block_size)
        .field_int("queue_depth", queue_depth)
        .field_int("threads", threads)
        .field_bool("single_submit", single_submit)
        .field_bool("overlap_events", !no_overlap)
        .field_bool("direct", direct)
        .field_bool("evicted", evicted)
        .field_bool("crc32c_hardware", zerocore::crc32c_hardware_available());
    for (const Row& r : rows) out.field_number(r.key + "_gbps", r.gbps());
    out.field_number("engine_vs_disk_write", gbps("engine_write") / disk_write_best)
        .field_number("engine_vs_disk_read_cold", gbps("engine_read_cold") / disk_read_best);
    out.end_object();
    std::printf("%s\n", out.str().c_str());
    return 0;
  }

  std::printf("aio: %lld bytes per file in %s; engine block_size %lld, queue_depth %lld, thread_count %lld%s%s, "
              "O_DIRECT %s\n",
              static_cast<long long>(bytes), dir.c_str(), static_cast<long long>(block_size),
              static_cast<long long>(queue_depth), static_cast<long long>(threads),
              single_submit ? ", single_submit" : "", no_overlap ? ", overlap_events off" : "",
              direct ? "on" : "off (refused by the file system)");
  std::printf("GB/s = 1e9 bytes/s; writes counted up to fsync; cold = evicted from the page cache first; vs disk = "
              "against the faster single-thread disk row (buffered or O_DIRECT)%s\n\n",
              evicted ? "" : " (WARNING: eviction failed, reads may be cached)");
  Table table({"what", "GB/s", "seconds", "bytes", "vs disk"});
  for (const Row& r : rows) {
    std::string ratio;
    if (r.key == "engine_write") ratio = format("%.2fx", r.gbps() / disk_write_best);
    if (r.key == "engine_read_cold") ratio = format("%.2fx", r.gbps() / disk_read_best);
    table.add_row({r.what, format("%.2f", r.gbps()), format("%.3f", r.seconds), std::to_string(r.bytes), ratio});
  }
  table.print(stdout);
  return 0;
}

}  // namespace zerocore_bench
