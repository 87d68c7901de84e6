// How many threads the CPU kernels use when nobody pinned a count (Note [Kernel threads under torchrun]).
#pragma once

#include <optional>
#include <string_view>

namespace zerocore {

// Note [Kernel threads under torchrun]
// ------------------------------------
// The CPU kernels follow torch's intra-op thread count, except in one case: torchrun, launching several
// ranks on a machine, sets OMP_NUM_THREADS=1 in each unless the user set it, so torch computes on one
// thread per rank, and an offloaded optimizer's CPU Adam (the step of ZeRO-Offload) would too: one core of
// the C / L each rank could use, a step up to C / L times slower than the machine allows (USER_PAINS #9).
// When torch runs on one thread, OMP_NUM_THREADS is exactly "1" and LOCAL_WORLD_SIZE (torchrun's ranks on
// this machine) is above 1, the kernels take their rank's share of the cores this process may run on
// instead: cores / LOCAL_WORLD_SIZE, at least 1. The ranks' shares add up to the cores, so nothing is
// oversubscribed; where a launcher narrowed each rank's affinity already, the share is smaller than it
// could be, never larger. A deliberate OMP_NUM_THREADS=1 under torchrun is indistinguishable from torchrun's
// default: zerocore.ops.set_num_threads(1) pins one thread.
int default_kernel_threads(int torch_threads, std::optional<std::string_view> omp_num_threads,
                           std::optional<std::string_view> local_world_size, int cores);

}  // namespace zerocore
