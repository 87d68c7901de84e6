// Flat-partition layout: where N tensors live in one flat buffer, how that buffer is cut into buckets,
// and which slice of every bucket each data-parallel rank owns.
//
// Note [Flat-partition geometry]
// ------------------------------
// Tensors are placed in order; each tensor's offset is rounded up to `alignment` elements. Consecutive
// tensors form a bucket; a bucket closes at a tensor boundary as soon as its content reaches
// `bucket_cap` elements, and a tensor larger than the cap always starts a bucket of its own. Every bucket
// starts at a multiple of world_size * alignment and is padded to one, then split into world_size equal,
// contiguous shards (each a multiple of `alignment` long), so a bucket reduce-scatters and all-gathers in
// equal pieces. A rank's shard of the whole buffer is the concatenation of its bucket shards, in bucket
// order (with one bucket it is one contiguous range, as in Megatron's distributed optimizer); the shard
// length is the same on every rank. Shards do not respect tensor boundaries: a tensor may be split
// between ranks, and a shard may hold pieces of many tensors or only padding.
//
//   flat buffer : | bucket 0 ............................ | bucket 1 ................ |
//   bucket 0    : | rank 0 shard | rank 1 shard | ... pad |
//   rank r local: [ bucket 0 shard of r ][ bucket 1 shard of r ] ...
//
// Each place where a tensor meets one rank's shard is a Piece with three ranges of equal `length`:
// inside the tensor, inside the rank's concatenated (local) shard, and inside the flat buffer.
#pragma once

#include <cstdint>
#include <vector>

namespace zerocore {

// One bucket: a run of consecutive tensors [first_tensor, end_tensor) and its padded extent.
struct Bucket {
  int64_t flat_start;     // first element in the flat buffer; a multiple of world_size * alignment
  int64_t content_end;    // one past the last tensor element (flat); content_end - flat_start <= padded_size
  int64_t padded_size;    // bucket length including padding; a multiple of world_size * alignment
  int64_t shard_size;     // padded_size / world_size: the equal piece each rank owns
  int64_t shard_offset;   // where this bucket's shard starts inside every rank's local shard
  int64_t first_tensor;   // index of the first tensor in the bucket
  int64_t end_tensor;     // one past the last tensor index in the bucket
};

// Where tensor `tensor` meets one rank's shard: three aligned ranges of `length` elements.
struct Piece {
  int64_t tensor;         // tensor index
  int64_t bucket;         // bucket index
  int64_t tensor_offset;  // start inside the tensor (flattened)
  int64_t shard_offset;   // start inside the rank's concatenated local shard
  int64_t flat_offset;    // start inside the flat buffer
  int64_t length;         // elements; always > 0
};

class FlatLayout {
 public:
  // Builds the layout in O(N). Throws InvalidArgument naming the value when a size is negative,
  // world_size < 1, alignment < 1 or bucket_cap < 1.
  FlatLayout(const int64_t* sizes, int64_t num_tensors, int64_t world_size, int64_t alignment,
             int64_t bucket_cap);
  FlatLayout(const std::vector<int64_t>& sizes, int64_t world_size, int64_t alignment, int64_t bucket_cap)
      : FlatLayout(sizes.data(), static_cast<int64_t>(sizes.size()), world_size, alignment, bucket_cap) {}

  int64_t num_tensors() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  int64_t world_size() const { return world_size_; }
  int64_t alignment() const { return alignment_; }
  int64_t bucket_cap() const { return bucket_cap_; }
  // Length of the flat buffer, padding included (the sum of the buckets' padded sizes).
  int64_t total_size() const { return total_size_; }
  // Length of every rank's local shard (total_size / world_size).
  int64_t shard_size() const { return total_size_ / world_size_; }

  const std::vector<int64_t>& sizes() const { return sizes_; }
  const std::vector<int64_t>& offsets() const { return offsets_; }
  const std::vector<int64_t>& tensor_buckets() const { return tensor_bucket_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }

  // The pieces of `rank`'s shard, ordered by shard_offset (equivalently by flat_offset).
  // Cost: O(num_buckets * log(tensors per bucket) + pieces). Throws InvalidArgument for a bad rank.
  std::vector<Piece> rank_pieces(int64_t rank) const;

  // The pieces of one bucket's shard owned by `rank`, appended to `out`.
  void bucket_rank_pieces(int64_t bucket, int64_t rank, std::vector<Piece>& out) const;

  // Per bucket: where its non-empty tensors begin and end, relative to the bucket's flat_start (bucket_cuts in
  // bucket_geometry.hpp, the cuts the gradient reducer quantizes by too).
  std::vector<std::vector<int64_t>> bucket_cuts() const;

 private:
  void check_rank(int64_t rank) const;

  int64_t world_size_;
  int64_t alignment_;
  int64_t bucket_cap_;
  int64_t total_size_ = 0;
  std::vector<int64_t> sizes_;          // element count per tensor
  std::vector<int64_t> offsets_;        // flat offset per tensor; a multiple of alignment
  std::vector<int64_t> tensor_bucket_;  // bucket index per tensor
  std::vector<Bucket> buckets_;
};

}  // namespace zerocore
