// Run-time choice of the SIMD code path. Kernels are compiled once per ISA (each in its own translation
// unit with its own -m flags, never -march=native) and the best path this CPU supports is picked at run
// time; tests and benchmarks may force a path.
#pragma once

#include <string>
#include <vector>

namespace zerocore {

enum class SimdPath { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

const char* simd_path_name(SimdPath path);
// Parses "scalar" | "avx2" | "avx512"; throws InvalidArgument naming the accepted values otherwise.
SimdPath parse_simd_path(const std::string& name);

// Paths compiled into this build, in increasing order of width.
std::vector<SimdPath> compiled_simd_paths();
// Whether this CPU (and OS) can run `path`.
bool cpu_supports(SimdPath path);
// The widest compiled path this CPU supports.
SimdPath best_simd_path();

// The path kernels use when the caller does not name one: best_simd_path() unless forced.
SimdPath active_simd_path();
// Forces the default path (for tests and benchmarks). Throws InvalidArgument if this build or CPU
// cannot run it.
void force_simd_path(SimdPath path);
// Returns to the automatic choice.
void reset_simd_path();

// What every kernel entry point checks of the path it is given: throws InvalidArgument, prefixed with
// "<caller>: ", unless `path` was compiled into this build and this CPU can run it.
void check_simd_path(SimdPath path, const char* caller);

}  // namespace zerocore
