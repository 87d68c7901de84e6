// Persistent workers with a spin-then-sleep handoff. Optimizer steps arrive back to back (one call per
// tensor or bucket), so workers spin briefly on the job generation before sleeping on a condition
// variable: a call that follows soon after the last one costs no futex wake-up. The caller runs range 0
// itself and waits (spinning, then sleeping) for every worker to acknowledge the job.
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

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

struct ThreadPool::Impl {
  int num_threads = 1;
  std::vector<std::thread> workers;

  // The current job, written by the caller before it bumps `generation` (release) and read by workers
  // after they see the new generation (acquire).
  const std::function<void(int64_t, int64_t)>* fn = nullptr;
  int64_t n = 0;
  int64_t grain = 1;
  int64_t grains_per_range = 0;  // every range gets this many grains ...
  int64_t ranges_with_extra = 0;  // ... and the first ranges_with_extra ranges one more
  int num_ranges = 0;
  bool stopping = false;

  std::atomic<uint64_t> generation{0};
  std::atomic<int> pending_workers{0};  // workers that have not finished the current generation
  std::atomic<int> sleeping_workers{0};
  std::atomic<bool> caller_sleeping{false};
  std::atomic<bool> busy{false};

  std::mutex mutex;
  std::condition_variable work_ready;
  std::condition_variable work_done;

  std::mutex error_mutex;
  std::exception_ptr first_error;

  void range_bounds(int index, int64_t* begin, int64_t* end) const {
    const int64_t extra_before = std::min<int64_t>(index, ranges_with_extra);
    const int64_t first_grain = index * grains_per_range + extra_before;
    const int64_t grains = grains_per_range + (index < ranges_with_extra ? 1 : 0);
    *begin = std::min(n, first_grain * grain);
    *end = std::min(n, (first_grain + grains) * grain);
  }

  void run_range(int index) {
    if (index >= num_ranges) return;
    int64_t begin = 0, end = 0;
    range_bounds(index, &begin, &end);
    try {
      (*fn)(begin, end);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!first_error) first_error = std::current_exception();
    }
  }

  uint64_t wait_for_new_generation(uint64_t seen) {
    for (int spin = 0; spin < kSpinIterations; ++spin) {
      const uint64_t current = generation.load(std::memory_order_acquire);
      if (current != seen) return current;
      cpu_relax();
    }
    std::unique_lock<std::mutex> lock(mutex);
    // seq_cst increment then seq_cst load of generation pairs with the caller's store-then-load of
    // sleeping_workers: at least one side sees the other, so no wake-up is lost.
    sleeping_workers.fetch_add(1, std::memory_order_seq_cst);
    uint64_t current = seen;
    work_ready.wait(lock, [&] {
      current = generation.load(std::memory_order_seq_cst);
      return current != seen;
    });
    sleeping_workers.fetch_sub(1, std::memory_order_relaxed);
    return current;
  }

  void worker_loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      seen = wait_for_new_generation(seen);
      if (stopping) return;
      run_range(index);
      if (pending_workers.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
          caller_sleeping.load(std::memory_order_seq_cst)) {
        std::lock_guard<std::mutex> lock(mutex);
        work_done.notify_one();
      }
    }
  }

  void publish(uint64_t next_generation) {
    generation.store(next_generation, std::memory_order_seq_cst);
    if (sleeping_workers.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex);
      work_ready.notify_all();
    }
  }

  void wait_for_workers() {
    for (int spin = 0; spin < kSpinIterations; ++spin) {
      if (pending_workers.load(std::memory_order_acquire) == 0) return;
      cpu_relax();
    }
    std::unique_lock<std::mutex> lock(mutex);
    caller_sleeping.store(true, std::memory_order_seq_cst);
    work_done.wait(lock, [&] { return pending_workers.load(std::memory_order_seq_cst) == 0; });
    caller_sleeping.store(false, std::memory_order_relaxed);
  }
};

ThreadPool::ThreadPool(int num_threads) : impl_(nullptr) {
  ZC_CHECK_ARG(num_threads >= 1, "ThreadPool: num_threads must be >= 1, got ", num_threads);
  auto impl = std::make_unique<Impl>();
  impl->num_threads = num_threads;
  Impl* raw = impl.get();
  try {
    for (int index = 1; index < num_threads; ++index) {
      raw->workers.emplace_back([raw, index] { raw->worker_loop(index); });
    }
  } catch (...) {
    // Could not start every thread: stop those that did start before reporting.
    raw->stopping = true;
    raw->publish(1);
    for (std::thread& worker : raw->workers) worker.join();
    throw;
  }
  impl_ = impl.release();
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->publish(impl_->generation.load(std::memory_order_relaxed) + 1);
  for (std::thread& worker : impl_->workers) worker.join();
  delete impl_;
}

int ThreadPool::num_threads() const { return impl_->num_threads; }

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  ZC_CHECK_ARG(grain >= 1, "parallel_for: grain must be >= 1, got ", grain);
  ZC_CHECK_ARG(n >= 0, "parallel_for: n must be >= 0, got ", n);
  if (n == 0) return;
  const int64_t num_grains = (n - 1) / grain + 1;
  if (impl_->num_threads == 1 || num_grains == 1) {
    fn(0, n);  // nothing to share: skip the handoff entirely
    return;
  }
  Impl& impl = *impl_;
  ZC_CHECK(!impl.busy.exchange(true, std::memory_order_acquire),
           "ThreadPool::parallel_for is not reentrant: one call at a time per pool");
  const int num_ranges = static_cast<int>(std::min<int64_t>(impl.num_threads, num_grains));
  impl.fn = &fn;
  impl.n = n;
  impl.grain = grain;
  impl.num_ranges = num_ranges;
  impl.grains_per_range = num_grains / num_ranges;
  impl.ranges_with_extra = num_grains % num_ranges;
  impl.first_error = nullptr;
  impl.pending_workers.store(static_cast<int>(impl.workers.size()), std::memory_order_relaxed);
  impl.publish(impl.generation.load(std::memory_order_relaxed) + 1);

  impl.run_range(0);  // exceptions are parked like the workers', so we always wait before leaving
  impl.wait_for_workers();
  std::exception_ptr error = impl.first_error;
  impl.first_error = nullptr;
  impl.busy.store(false, std::memory_order_release);
  if (error) std::rethrow_exception(error);
}

}  // namespace zerocore
