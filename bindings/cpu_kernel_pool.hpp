// The CPU kernels' shared thread pool (defined in adam_bindings.cpp with set_num_threads/get_num_threads), for
// binding files other than the Adam one.
#pragma once

#include <functional>

#include "zerocore/thread_pool.hpp"

namespace zerocore::bindings {

// Runs fn with the pool every CPU kernel of _C shares (torch.get_num_threads() threads unless
// zerocore.ops.set_num_threads pinned a count), serialised with every other kernel call on it. Call it
// with the GIL released.
void run_on_cpu_kernel_pool(const std::function<void(ThreadPool*)>& fn);

}  // namespace zerocore::bindings
