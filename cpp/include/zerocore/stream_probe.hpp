// Memory-bandwidth probe: STREAM-style kernels over a ThreadPool, the roofline the CPU Adam kernel is
// compared to. Torch-free, so the zerocore-bench harness and the Python bindings share it.
//
// Note [Stream probe accounting]
// ------------------------------
// Every kernel streams fp32 arrays of `elements` each and counts the bytes its loop reads plus the bytes it
// writes, nothing else: no read-for-ownership of written lines, as STREAM counts. So
//   copy   a = b              : 1 read  1 write   8 bytes / element
//   triad  a = b + s * c      : 2 reads 1 write  12 bytes / element
//   adam   p, m, v updated in place from (p, g, m, v): 4 reads 3 writes, 28 bytes / element
// "adam" has exactly the traffic of an fp32 Adam step and a few FMAs per element, so it measures what an
// Adam kernel could reach if it were purely memory bound. Regular stores to a line that was not read first
// cost an extra read (RFO) that this accounting does not show; non-temporal stores avoid it, which is why
// both store kinds are measured and the faster one is the roofline. The in-place adam kernel reads every
// line it writes, so for it the two store kinds usually differ little.
//
// Note [Shaped streams]
// ---------------------
// The copy stream is the roofline of a kernel that reads as many bytes as it writes. A kernel far from that
// shape is not bounded by it: quantize reads 4-8 bytes for each byte it writes, and one core's reads are
// limited by the cache misses it can keep in flight, while its non-temporal writes drain beside them. Seen
// on this project's 2-core VM: the copy stream at 35 GB/s on one thread, of which only half is reads, so a
// kernel that only read would score about 0.5 of it however well it streamed; dequantize, the reverse
// shape, scores up to 1.38. A shaped stream reads `reads` cache lines for every `writes` lines it writes (one
// of the two is 1), touching each byte once and computing only an xor, with no software prefetch and with
// one 4 or 16 KiB ahead of its reads; the fastest of those and of the two store kinds is the fastest the memory
// system moves that mix of bytes: the roofline of a kernel with the same shape. Bytes are counted as for
// the other kernels: read plus written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "zerocore/simd.hpp"
#include "zerocore/thread_pool.hpp"

namespace zerocore {

// Uninitialised bytes aligned to a 64-byte cache line, so SIMD loads and non-temporal stores need no peeling
// loop. Move-only; frees on destruction.
class AlignedBuffer {
 public:
  static constexpr size_t kAlignment = 64;

  AlignedBuffer() = default;
  // Throws std::bad_alloc when the memory is not available.
  explicit AlignedBuffer(size_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

enum class StreamKernel { kCopy = 0, kTriad = 1, kAdam = 2 };

const char* stream_kernel_name(StreamKernel kernel);
// Parses "copy" | "triad" | "adam"; throws InvalidArgument naming the accepted values otherwise.
StreamKernel parse_stream_kernel(const std::string& name);
// fp32 arrays the kernel touches (2, 3, 4) and the bytes it moves per element (8, 12, 28).
int stream_kernel_arrays(StreamKernel kernel);
int64_t stream_kernel_bytes_per_element(StreamKernel kernel);

enum class StoreKind { kRegular = 0, kNonTemporal = 1 };

// The read:write shape of a shaped stream (Note [Shaped streams]): `reads` lines read per `writes` lines
// written; one of the two is 1 and the other 1, 2, 4 or 8.
struct StreamShape {
  int reads = 1;
  int writes = 1;

  bool operator==(const StreamShape& other) const { return reads == other.reads && writes == other.writes; }
};

// "4:1" and the like.
std::string stream_shape_name(StreamShape shape);
// Throws InvalidArgument naming the accepted shapes when `shape` is not one of them.
void check_stream_shape(StreamShape shape);

const char* store_kind_name(StoreKind stores);  // "regular" | "nt"

// The code path the probe runs when asked for `requested`: kAvx512 when it is compiled in and this CPU
// supports it, otherwise kScalar, the portable loops (which the compiler vectorises for the baseline ISA).
SimdPath stream_probe_path(SimdPath requested);
// Whether `path` (as returned by stream_probe_path) has non-temporal stores (x86 only).
bool stream_supports_non_temporal(SimdPath path);

struct StreamResult {
  StreamKernel kernel = StreamKernel::kCopy;
  StoreKind stores = StoreKind::kRegular;
  SimdPath path = SimdPath::kScalar;
  int threads = 1;
  int64_t elements = 0;
  int64_t bytes_per_pass = 0;    // elements * stream_kernel_bytes_per_element(kernel)
  std::vector<double> seconds;   // one per timed pass, in run order (the warm-up pass is not included)
  double best_seconds = 0.0;
  double median_seconds = 0.0;

  double best_gbps() const {
    return best_seconds > 0 ? static_cast<double>(bytes_per_pass) / best_seconds * 1e-9 : 0.0;
  }
  double median_gbps() const {
    return median_seconds > 0 ? static_cast<double>(bytes_per_pass) / median_seconds * 1e-9 : 0.0;
  }
};

// The result with the highest best_gbps (the roofline among store kinds). `results` must not be empty.
const StreamResult& fastest_stream_result(const std::vector<StreamResult>& results);

// Owns the arrays of one problem size and runs the kernels over them. The arrays are allocated when a
// kernel first needs them and first-touched by `pool` with the same partition the kernels use, so on a
// NUMA machine every thread streams pages local to it. Keep one probe per pool: a probe used with another
// thread count would stream pages placed for the old partition.
class StreamProbe {
 public:
  // elements >= 1 per array; pool may be nullptr (the calling thread only) and must outlive the probe.
  // `path` is resolved with stream_probe_path. Throws InvalidArgument for elements < 1.
  StreamProbe(int64_t elements, ThreadPool* pool, SimdPath path = best_simd_path());

  int64_t elements() const { return elements_; }
  SimdPath path() const { return path_; }
  int threads() const;

  // One untimed warm-up pass, then `repeats` timed passes (repeats >= 1). Throws InvalidArgument for
  // repeats < 1 or non-temporal stores on a path without them.
  StreamResult run(StreamKernel kernel, StoreKind stores, int repeats);
  // run() with regular stores and, where the path has them, non-temporal stores.
  std::vector<StreamResult> run_all_stores(StreamKernel kernel, int repeats);
  // One timed pass and its seconds, no warm-up (the arrays are allocated, if needed, before the clock
  // starts). For callers that interleave probe passes with the kernel they compare it to, so that both
  // see the same machine: on a shared host the bandwidth drifts between back-to-back measurements.
  double time_pass(StreamKernel kernel, StoreKind stores);
  // The same for a shaped stream (Note [Shaped streams]) over the probe's first two arrays: the wide side
  // is `elements` fp32 (rounded down to whole 64-byte lines of the narrow side), the narrow side that
  // divided by the ratio. prefetch_bytes > 0 (a multiple of 64): a software prefetch into L2 that far
  // ahead of every line read (the AVX-512 path only; the portable loops ignore it). shaped_pass_bytes is
  // what one pass reads plus writes.
  double time_shaped_pass(StreamShape shape, StoreKind stores, int64_t prefetch_bytes = 0);
  int64_t shaped_pass_bytes(StreamShape shape) const;

 private:
  void ensure_arrays(int count);
  void check_stores(StoreKind stores) const;
  void pass(StreamKernel kernel, StoreKind stores);
  void shaped_pass(StreamShape shape, StoreKind stores, int64_t prefetch_bytes);
  // Narrow-side lines (16 fp32 each) a shaped pass of this shape covers.
  int64_t shaped_lines(StreamShape shape) const;

  int64_t elements_;
  ThreadPool* pool_;
  SimdPath path_;
  std::vector<AlignedBuffer> arrays_;
};

}  // namespace zerocore
