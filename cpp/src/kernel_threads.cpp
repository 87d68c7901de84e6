#include "zerocore/kernel_threads.hpp"

#include <algorithm>
#include <charconv>

namespace zerocore {

namespace {

// A whole decimal number and nothing else; nullopt otherwise (torchrun writes plain decimals).
std::optional<long> parse_count(std::string_view text) {
  long value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end || text.empty()) return std::nullopt;
  return value;
}

}  // namespace

int default_kernel_threads(int torch_threads, std::optional<std::string_view> omp_num_threads,
                           std::optional<std::string_view> local_world_size, int cores) {
  const int followed = std::max(1, torch_threads);
  if (followed != 1 || !omp_num_threads || *omp_num_threads != "1" || !local_world_size) return followed;
  const std::optional<long> ranks = parse_count(*local_world_size);
  if (!ranks || *ranks <= 1) return followed;
  return static_cast<int>(std::max(1L, std::max(1, cores) / *ranks));
}

}  // namespace zerocore
