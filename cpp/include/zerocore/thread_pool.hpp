// A persistent pool of worker threads for the CPU kernels, owned by its caller (no global pool).
#pragma once

#include <cstdint>
#include <functional>

namespace zerocore {

class ThreadPool {
 public:
  // num_threads >= 1 counts the calling thread, so a pool of 1 starts no worker.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const;

  // Splits [0, n) into at most num_threads() contiguous ranges of whole `grain`s and runs
  // fn(begin, end) on each, the calling thread taking one; returns when all are done. The first
  // exception thrown by fn is rethrown here. Not reentrant: one parallel_for at a time per pool.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  struct Impl;
  Impl* impl_;
};

}  // namespace zerocore
