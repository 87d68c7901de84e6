#include "zerocore/simd.hpp"

#include <atomic>

#include "zerocore/error.hpp"

namespace zerocore {
namespace {

// -1: automatic; otherwise the forced SimdPath value.
std::atomic<int> g_forced_path{-1};

bool is_compiled(SimdPath path) {
  for (SimdPath p : compiled_simd_paths()) {
    if (p == path) return true;
  }
  return false;
}

}  // namespace

const char* simd_path_name(SimdPath path) {
  switch (path) {
    case SimdPath::kScalar: return "scalar";
    case SimdPath::kAvx2: return "avx2";
    case SimdPath::kAvx512: return "avx512";
  }
  return "unknown";
}

SimdPath parse_simd_path(const std::string& name) {
  for (SimdPath path : {SimdPath::kScalar, SimdPath::kAvx2, SimdPath::kAvx512}) {
    if (name == simd_path_name(path)) return path;
  }
  throw InvalidArgument("unknown SIMD path '" + name + "'; expected one of: scalar, avx2, avx512");
}

std::vector<SimdPath> compiled_simd_paths() {
  std::vector<SimdPath> paths{SimdPath::kScalar};
#if defined(ZEROCORE_HAVE_AVX2)
  paths.push_back(SimdPath::kAvx2);
#endif
#if defined(ZEROCORE_HAVE_AVX512)
  paths.push_back(SimdPath::kAvx512);
#endif
  return paths;
}

bool cpu_supports(SimdPath path) {
  switch (path) {
    case SimdPath::kScalar: return true;
#if defined(__x86_64__) || defined(__i386__)
    case SimdPath::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case SimdPath::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
    default: return false;
#endif
  }
  return false;
}

SimdPath best_simd_path() {
  SimdPath best = SimdPath::kScalar;
  for (SimdPath path : compiled_simd_paths()) {
    if (cpu_supports(path)) best = path;
  }
  return best;
}

SimdPath active_simd_path() {
  const int forced = g_forced_path.load(std::memory_order_relaxed);
  return forced < 0 ? best_simd_path() : static_cast<SimdPath>(forced);
}

void force_simd_path(SimdPath path) {
  ZC_CHECK_ARG(is_compiled(path), "SIMD path '", simd_path_name(path), "' was not compiled into this build");
  ZC_CHECK_ARG(cpu_supports(path), "this CPU cannot run the '", simd_path_name(path), "' SIMD path");
  g_forced_path.store(static_cast<int>(path), std::memory_order_relaxed);
}

void reset_simd_path() { g_forced_path.store(-1, std::memory_order_relaxed); }

void check_simd_path(SimdPath path, const char* caller) {
  ZC_CHECK_ARG(is_compiled(path), caller, ": SIMD path '", simd_path_name(path), "' (", static_cast<int>(path),
               ") was not compiled into this build");
  ZC_CHECK_ARG(cpu_supports(path), caller, ": this CPU cannot run the '", simd_path_name(path), "' SIMD path");
}

}  // namespace zerocore
