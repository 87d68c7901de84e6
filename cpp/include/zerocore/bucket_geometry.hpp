// Reducer geometry: where every parameter's gradient lives inside the gradient buckets, checked once when
// the GradReducer is built, and the order the buckets are reduced in.
//
// Note [Reducer bucket geometry]
// ------------------------------
// Bucket b holds bucket_padded_size[b] elements, a multiple of world_size so it reduce-scatters into equal
// shards. Parameter i occupies [param_offset[i], param_offset[i] + param_numel[i]) of bucket param_bucket[i]:
// inside the bucket, and disjoint from every other parameter of that bucket (empty parameters occupy
// nothing). Buckets launch in reverse bucket order (Note [Bucket launch order] in ready_tracker.hpp).
#pragma once

#include <cstdint>
#include <vector>

namespace zerocore {

// Validates the geometry of Note [Reducer bucket geometry] and returns the launch order (a permutation of
// the bucket indices). Throws InvalidArgument naming the argument when world_size < 1, a bucket size is
// negative or not divisible by world_size, the per-parameter vectors differ in length, a bucket index is
// out of range, an offset or numel is negative, a parameter overruns its bucket, or two parameters of one
// bucket overlap.
std::vector<int64_t> reducer_geometry(const std::vector<int64_t>& bucket_padded_size,
                                      const std::vector<int64_t>& param_bucket,
                                      const std::vector<int64_t>& param_offset,
                                      const std::vector<int64_t>& param_numel, int64_t world_size);

// Per bucket: the offsets inside it where its non-empty parameters begin and end, sorted and distinct. A
// quantizing collective starts a scale group at each, so no two parameters share a scale (Note [Quantized
// collectives] in bindings/quantized_collectives.cpp). Cost O(P log P). Throws InvalidArgument when
// num_buckets < 0, the per-parameter vectors differ in length or a bucket index is out of range; the rest of
// the geometry is reducer_geometry's to check.
std::vector<std::vector<int64_t>> bucket_cuts(int64_t num_buckets, const std::vector<int64_t>& param_bucket,
                                              const std::vector<int64_t>& param_offset,
                                              const std::vector<int64_t>& param_numel);

}  // namespace zerocore
