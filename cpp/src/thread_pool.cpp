// Persistent workers with a spin-then-sleep handoff and ranges claimed, not assigned.
//
// Optimizer steps arrive back to back (one call per tensor or bucket), so workers spin briefly on the job
// word before sleeping on a condition variable: a call that follows soon after the last one costs no
// futex wake-up. The ranges of a job are handed out through one atomic word (generation | ranges | next):
// the caller claims the first and every thread, the caller included, keeps claiming until none are left.
// So a worker that the OS has not scheduled yet (an oversubscribed machine) delays nothing: the caller
// runs its range too, and waits only for ranges actually claimed. A worker touches the job's fields only
// after a successful claim, and the caller rewrites them only once every range has finished, so a worker
// that wakes late can never see a half-written job.
#include "zerocore/thread_pool.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "zerocore/error.hpp"

namespace zerocore {
namespace {

// About 50 us on current x86 (pause is 30-150 cycles): long enough to bridge back-to-back calls, short
// enough not to steal a core from other work for long.
constexpr int kSpinIterations = 2048;
// The job word packs the generation (32 bits), the number of ranges (16) and the next range to claim (16).
constexpr int64_t kMaxRanges = 0xFFFF;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

inline uint32_t word_generation(uint64_t word) { return static_cast<uint32_t>(word >> 32); }
inline int word_ranges(uint64_t word) { return static_cast<int>((word >> 16) & 0xFFFF); }
inline int word_next(uint64_t word) { return static_cast<int>(word & 0xFFFF); }
inline uint64_t make_word(uint32_t generation, int ranges) {
  return (static_cast<uint64_t>(generation) << 32) | (static_cast<uint64_t>(ranges) << 16);
}

}  // namespace

struct ThreadPool::Impl {
  int num_threads = 1;
  std::vector<std::thread> workers;

  // The current job: written by the caller before it publishes the job word, read by a thread only after
  // it claimed one of the job's ranges.
  const std::function<void(int64_t, int64_t)>* fn = nullptr;
  int64_t n = 0;
  int64_t grain = 1;
  int64_t grains_per_range = 0;   // every range gets this many grains ...
  int64_t ranges_with_extra = 0;  // ... and the first ranges_with_extra ranges one more

  std::atomic<uint64_t> job_word{0};
  std::atomic<int> finished_ranges{0};
  std::atomic<int> sleeping_workers{0};
  std::atomic<bool> caller_sleeping{false};
  std::atomic<bool> stopping{false};
  std::atomic<bool> busy{false};

  std::mutex mutex;
  std::condition_variable work_ready;
  std::condition_variable work_done;

  std::mutex error_mutex;
  std::exception_ptr first_error;

  void run_range(int index) {
    const int64_t extra_before = std::min<int64_t>(index, ranges_with_extra);
    const int64_t first_grain = index * grains_per_range + extra_before;
    const int64_t grains = grains_per_range + (index < ranges_with_extra ? 1 : 0);
    const int64_t begin = std::min(n, first_grain * grain);
    const int64_t end = std::min(n, (first_grain + grains) * grain);
    try {
      (*fn)(begin, end);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!first_error) first_error = std::current_exception();
    }
  }

  // Claims and runs ranges of the job `word` belongs to until none are left or a newer job replaces it.
  void claim_and_run(uint64_t word) {
    const uint32_t generation = word_generation(word);
    while (word_generation(word) == generation && word_next(word) < word_ranges(word)) {
      if (!job_word.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        continue;  // `word` now holds the current value
      }
      run_range(word_next(word));
      const int total = word_ranges(word);
      // seq_cst increment then seq_cst load of caller_sleeping pairs with the caller's store-then-load in
      // wait_for_ranges: at least one side sees the other, so no wake-up is lost.
      if (finished_ranges.fetch_add(1, std::memory_order_seq_cst) + 1 == total &&
          caller_sleeping.load(std::memory_order_seq_cst)) {
        std::lock_guard<std::mutex> lock(mutex);
        work_done.notify_one();
      }
      word = job_word.load(std::memory_order_acquire);
    }
  }

  uint64_t wait_for_new_generation(uint32_t seen) {
    for (int spin = 0; spin < kSpinIterations; ++spin) {
      const uint64_t word = job_word.load(std::memory_order_acquire);
      if (word_generation(word) != seen) return word;
      cpu_relax();
    }
    std::unique_lock<std::mutex> lock(mutex);
    // Pairs with publish()'s store-then-load of sleeping_workers, as in claim_and_run.
    sleeping_workers.fetch_add(1, std::memory_order_seq_cst);
    uint64_t word = 0;
    work_ready.wait(lock, [&] {
      word = job_word.load(std::memory_order_seq_cst);
      return word_generation(word) != seen;
    });
    sleeping_workers.fetch_sub(1, std::memory_order_relaxed);
    return word;
  }

  void worker_loop() {
    uint32_t seen = 0;
    for (;;) {
      const uint64_t word = wait_for_new_generation(seen);
      if (stopping.load(std::memory_order_acquire)) return;
      seen = word_generation(word);
      claim_and_run(word);
    }
  }

  void publish(uint64_t word) {
    job_word.store(word, std::memory_order_seq_cst);
    if (sleeping_workers.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex);
      work_ready.notify_all();
    }
  }

  void wait_for_ranges(int total) {
    for (int spin = 0; spin < kSpinIterations; ++spin) {
      if (finished_ranges.load(std::memory_order_acquire) == total) return;
      cpu_relax();
    }
    std::unique_lock<std::mutex> lock(mutex);
    caller_sleeping.store(true, std::memory_order_seq_cst);
    work_done.wait(lock, [&] { return finished_ranges.load(std::memory_order_seq_cst) == total; });
    caller_sleeping.store(false, std::memory_order_relaxed);
  }

  void stop_workers() {
    stopping.store(true, std::memory_order_release);
    publish(make_word(word_generation(job_word.load(std::memory_order_relaxed)) + 1, 0));
    for (std::thread& worker : workers) worker.join();
  }
};

ThreadPool::ThreadPool(int num_threads) : impl_(nullptr) {
  ZC_CHECK_ARG(num_threads >= 1, "ThreadPool: num_threads must be >= 1, got ", num_threads);
  auto impl = std::make_unique<Impl>();
  impl->num_threads = num_threads;
  Impl* raw = impl.get();
  try {
    for (int index = 1; index < num_threads; ++index) raw->workers.emplace_back([raw] { raw->worker_loop(); });
  } catch (...) {
    raw->stop_workers();  // could not start every thread: stop those that did before reporting
    throw;
  }
  impl_ = impl.release();
}

ThreadPool::~ThreadPool() {
  impl_->stop_workers();
  delete impl_;
}

int ThreadPool::num_threads() const { return impl_->num_threads; }

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  ZC_CHECK_ARG(grain >= 1, "parallel_for: grain must be >= 1, got ", grain);
  ZC_CHECK_ARG(n >= 0, "parallel_for: n must be >= 0, got ", n);
  if (n == 0) return;
  const int64_t num_grains = (n - 1) / grain + 1;
  const int num_ranges = static_cast<int>(std::min({num_grains, int64_t{impl_->num_threads}, kMaxRanges}));
  if (num_ranges == 1) {
    fn(0, n);  // nothing to share: skip the handoff entirely
    return;
  }
  Impl& impl = *impl_;
  ZC_CHECK(!impl.busy.exchange(true, std::memory_order_acquire),
           "ThreadPool::parallel_for is not reentrant: one call at a time per pool");
  impl.fn = &fn;
  impl.n = n;
  impl.grain = grain;
  impl.grains_per_range = num_grains / num_ranges;
  impl.ranges_with_extra = num_grains % num_ranges;
  impl.first_error = nullptr;
  impl.finished_ranges.store(0, std::memory_order_relaxed);
  const uint32_t generation = word_generation(impl.job_word.load(std::memory_order_relaxed)) + 1;
  const uint64_t word = make_word(generation, num_ranges);
  impl.publish(word);

  impl.claim_and_run(word);  // exceptions are parked like the workers', so we always wait before leaving
  impl.wait_for_ranges(num_ranges);
  std::exception_ptr error = impl.first_error;
  impl.first_error = nullptr;
  impl.busy.store(false, std::memory_order_release);
  if (error) std::rethrow_exception(error);
}

}  // namespace zerocore
