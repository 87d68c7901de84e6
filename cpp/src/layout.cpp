#include "zerocore/layout.hpp"

#include <algorithm>
#include <limits>

#include "zerocore/bucket_geometry.hpp"
#include "zerocore/error.hpp"

namespace zerocore {
namespace {

constexpr int64_t kMaxElements = std::numeric_limits<int64_t>::max() / 4;

int64_t round_up(int64_t value, int64_t multiple) {
  const int64_t rem = value % multiple;
  return rem == 0 ? value : value + (multiple - rem);
}

}  // namespace

FlatLayout::FlatLayout(const int64_t* sizes, int64_t num_tensors, int64_t world_size, int64_t alignment,
                       int64_t bucket_cap)
    : world_size_(world_size), alignment_(alignment), bucket_cap_(bucket_cap) {
  ZC_CHECK_ARG(num_tensors >= 0, "num_tensors must be >= 0, got ", num_tensors);
  ZC_CHECK_ARG(world_size >= 1, "world_size must be >= 1, got ", world_size);
  ZC_CHECK_ARG(alignment >= 1, "alignment must be >= 1 element, got ", alignment);
  ZC_CHECK_ARG(bucket_cap >= 1, "bucket_cap must be >= 1 element, got ", bucket_cap);
  ZC_CHECK_ARG(world_size <= kMaxElements / alignment, "world_size * alignment overflows: world_size=",
               world_size, ", alignment=", alignment);
  const int64_t bucket_multiple = world_size * alignment;

  sizes_.assign(sizes, sizes + num_tensors);
  offsets_.resize(num_tensors);
  tensor_bucket_.resize(num_tensors);

  int64_t cursor = 0;        // next free flat element
  int64_t bucket_start = 0;  // flat start of the open bucket
  int64_t bucket_first = 0;  // first tensor of the open bucket
  auto close_bucket = [&](int64_t end_tensor) {
    const int64_t padded = round_up(cursor - bucket_start, bucket_multiple);
    const int64_t shard_offset = buckets_.empty() ? 0 : buckets_.back().shard_offset + buckets_.back().shard_size;
    buckets_.push_back(Bucket{bucket_start, cursor, padded, padded / world_size, shard_offset, bucket_first,
                              end_tensor});
    bucket_start += padded;
    cursor = bucket_start;
    bucket_first = end_tensor;
  };

  for (int64_t i = 0; i < num_tensors; ++i) {
    const int64_t size = sizes[i];
    ZC_CHECK_ARG(size >= 0, "sizes[", i, "] must be >= 0, got ", size);
    // A tensor larger than the cap gets a bucket of its own: close whatever is open first.
    if (size > bucket_cap && i > bucket_first) close_bucket(i);
    const int64_t offset = round_up(cursor, alignment);
    ZC_CHECK_ARG(size <= kMaxElements - offset, "sizes[", i, "]=", size,
                 " makes the flat buffer overflow 64-bit element offsets");
    offsets_[i] = offset;
    tensor_bucket_[i] = static_cast<int64_t>(buckets_.size());
    cursor = offset + size;
    if (cursor - bucket_start >= bucket_cap) close_bucket(i + 1);
  }
  if (bucket_first < num_tensors) close_bucket(num_tensors);
  total_size_ = bucket_start;
}

void FlatLayout::check_rank(int64_t rank) const {
  ZC_CHECK_ARG(rank >= 0 && rank < world_size_, "rank must be in [0, ", world_size_, "), got ", rank);
}

void FlatLayout::bucket_rank_pieces(int64_t bucket, int64_t rank, std::vector<Piece>& out) const {
  check_rank(rank);
  ZC_CHECK_ARG(bucket >= 0 && bucket < num_buckets(), "bucket must be in [0, ", num_buckets(), "), got ",
               bucket);
  const Bucket& b = buckets_[bucket];
  const int64_t shard_begin = b.flat_start + rank * b.shard_size;
  const int64_t shard_end = shard_begin + b.shard_size;
  if (shard_begin >= b.content_end) return;  // this rank's shard of the bucket is padding only

  // Tensor ends are non-decreasing, so the first tensor reaching past shard_begin is found by bisection.
  const auto first = std::partition_point(
      offsets_.begin() + b.first_tensor, offsets_.begin() + b.end_tensor, [&](const int64_t& offset) {
        const int64_t i = &offset - offsets_.data();
        return offset + sizes_[i] <= shard_begin;
      });
  for (int64_t i = first - offsets_.begin(); i < b.end_tensor && offsets_[i] < shard_end; ++i) {
    const int64_t begin = std::max(offsets_[i], shard_begin);
    const int64_t end = std::min(offsets_[i] + sizes_[i], shard_end);
    if (end <= begin) continue;  // zero-element tensor
    out.push_back(Piece{i, bucket, begin - offsets_[i], b.shard_offset + (begin - shard_begin), begin, end - begin});
  }
}

std::vector<Piece> FlatLayout::rank_pieces(int64_t rank) const {
  check_rank(rank);
  std::vector<Piece> pieces;
  for (int64_t b = 0; b < num_buckets(); ++b) bucket_rank_pieces(b, rank, pieces);
  return pieces;
}

std::vector<std::vector<int64_t>> FlatLayout::bucket_cuts() const {
  std::vector<int64_t> offset_in_bucket(offsets_.size());
  for (size_t i = 0; i < offsets_.size(); ++i) {
    offset_in_bucket[i] = offsets_[i] - buckets_[tensor_bucket_[i]].flat_start;
  }
  return zerocore::bucket_cuts(num_buckets(), tensor_bucket_, offset_in_bucket, sizes_);
}

}  // namespace zerocore
