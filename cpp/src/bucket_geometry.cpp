#include "zerocore/bucket_geometry.hpp"

#include <algorithm>
#include <numeric>

#include "zerocore/error.hpp"

namespace zerocore {

std::vector<int64_t> reducer_geometry(const std::vector<int64_t>& bucket_padded_size,
                                      const std::vector<int64_t>& param_bucket,
                                      const std::vector<int64_t>& param_offset,
                                      const std::vector<int64_t>& param_numel, int64_t world_size) {
  ZC_CHECK_ARG(world_size >= 1, "world_size must be >= 1, got ", world_size);
  const size_t buckets = bucket_padded_size.size();
  for (size_t b = 0; b < buckets; ++b) {
    const int64_t padded = bucket_padded_size[b];
    ZC_CHECK_ARG(padded >= 0 && padded % world_size == 0, "bucket_padded_size[", b,
                 "] must be >= 0 and divisible by world_size ", world_size, ", got ", padded);
  }
  const size_t params = param_bucket.size();
  ZC_CHECK_ARG(param_offset.size() == params, "param_offset must have one entry per parameter (", params,
               "), got ", param_offset.size());
  ZC_CHECK_ARG(param_numel.size() == params, "param_numel must have one entry per parameter (", params, "), got ",
               param_numel.size());
  for (size_t i = 0; i < params; ++i) {
    const int64_t b = param_bucket[i];
    ZC_CHECK_ARG(b >= 0 && b < static_cast<int64_t>(buckets), "param_bucket[", i, "] must be in [0, ", buckets,
                 "), got ", b);
    ZC_CHECK_ARG(param_offset[i] >= 0, "param_offset[", i, "] must be >= 0, got ", param_offset[i]);
    ZC_CHECK_ARG(param_numel[i] >= 0, "param_numel[", i, "] must be >= 0, got ", param_numel[i]);
    // offset + numel <= padded, written so it cannot overflow (offset, numel >= 0).
    ZC_CHECK_ARG(param_offset[i] <= bucket_padded_size[b] && param_numel[i] <= bucket_padded_size[b] - param_offset[i],
                 "param_offset[", i, "] + param_numel[", i, "] = [", param_offset[i], ", +", param_numel[i],
                 ") does not fit inside bucket ", b, " of bucket_padded_size ", bucket_padded_size[b]);
  }

  // Overlap: non-empty parameters by (bucket, offset); each must start at or after the previous one's end.
  std::vector<size_t> by_place;
  by_place.reserve(params);
  for (size_t i = 0; i < params; ++i) {
    if (param_numel[i] > 0) by_place.push_back(i);
  }
  std::sort(by_place.begin(), by_place.end(), [&](size_t a, size_t b) {
    if (param_bucket[a] != param_bucket[b]) return param_bucket[a] < param_bucket[b];
    if (param_offset[a] != param_offset[b]) return param_offset[a] < param_offset[b];
    return a < b;
  });
  for (size_t k = 1; k < by_place.size(); ++k) {
    const size_t prev = by_place[k - 1], cur = by_place[k];
    if (param_bucket[prev] != param_bucket[cur]) continue;
    const int64_t prev_end = param_offset[prev] + param_numel[prev];
    ZC_CHECK_ARG(param_offset[cur] >= prev_end, "param_offset: parameter ", prev, " [", param_offset[prev], ", ",
                 prev_end, ") and parameter ", cur, " [", param_offset[cur], ", ",
                 param_offset[cur] + param_numel[cur], ") overlap in bucket ", param_bucket[cur]);
  }

  // Note [Bucket launch order]: backward produces the last parameters' gradients first.
  std::vector<int64_t> launch_order(buckets);
  std::iota(launch_order.rbegin(), launch_order.rend(), int64_t{0});
  return launch_order;
}

std::vector<std::vector<int64_t>> bucket_cuts(int64_t num_buckets, const std::vector<int64_t>& param_bucket,
                                              const std::vector<int64_t>& param_offset,
                                              const std::vector<int64_t>& param_numel) {
  ZC_CHECK_ARG(num_buckets >= 0, "num_buckets must be >= 0, got ", num_buckets);
  const size_t params = param_bucket.size();
  ZC_CHECK_ARG(param_offset.size() == params && param_numel.size() == params,
               "param_offset and param_numel must have one entry per parameter (", params, "), got ",
               param_offset.size(), " and ", param_numel.size());
  std::vector<std::vector<int64_t>> cuts(static_cast<size_t>(num_buckets));
  for (size_t i = 0; i < params; ++i) {
    const int64_t b = param_bucket[i];
    ZC_CHECK_ARG(b >= 0 && b < num_buckets, "param_bucket[", i, "] must be in [0, ", num_buckets, "), got ", b);
    if (param_numel[i] <= 0) continue;  // occupies nothing: no boundary of its own
    cuts[b].push_back(param_offset[i]);
    cuts[b].push_back(param_offset[i] + param_numel[i]);
  }
  for (std::vector<int64_t>& in_bucket : cuts) {
    std::sort(in_bucket.begin(), in_bucket.end());
    in_bucket.erase(std::unique(in_bucket.begin(), in_bucket.end()), in_bucket.end());
  }
  return cuts;
}

}  // namespace zerocore
