"""An independent checker of the flat-partition invariants, on a plain snapshot of a layout.

It works on plain lists so a test can hand it a deliberately broken layout and show that it fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import zerocore


@dataclass
class LayoutSnapshot:
    sizes: list[int]
    world_size: int
    alignment: int
    bucket_cap: int
    offsets: list[int]
    buckets: list[zerocore.Bucket]
    pieces: list[list[zerocore.Piece]]  # per rank
    total_size: int
    shard_size: int


def snapshot(layout: zerocore.FlatLayout, sizes: list[int]) -> LayoutSnapshot:
    return LayoutSnapshot(
        sizes=list(sizes),
        world_size=layout.world_size,
        alignment=layout.alignment,
        bucket_cap=layout.bucket_cap,
        offsets=layout.offsets().tolist(),
        buckets=list(layout.buckets),
        pieces=[layout.pieces(rank) for rank in range(layout.world_size)],
        total_size=layout.total_size,
        shard_size=layout.shard_size,
    )


def check_offsets(s: LayoutSnapshot) -> None:
    assert len(s.offsets) == len(s.sizes)
    previous_end = 0
    for i, (offset, size) in enumerate(zip(s.offsets, s.sizes)):
        assert offset % s.alignment == 0, f"tensor {i} offset {offset} not aligned to {s.alignment}"
        assert offset >= previous_end, f"tensor {i} at {offset} overlaps the previous tensor ending {previous_end}"
        previous_end = offset + size
        assert previous_end <= s.total_size, f"tensor {i} ends at {previous_end} past the buffer {s.total_size}"


def check_buckets(s: LayoutSnapshot) -> None:
    multiple = s.world_size * s.alignment
    next_tensor, next_start, shard_offset = 0, 0, 0
    for k, b in enumerate(s.buckets):
        assert b.first_tensor == next_tensor, f"bucket {k} starts at tensor {b.first_tensor}, expected {next_tensor}"
        assert b.end_tensor >= b.first_tensor
        assert b.flat_start == next_start, f"bucket {k} starts at {b.flat_start}, expected {next_start}"
        assert b.flat_start % multiple == 0 and b.padded_size % multiple == 0, f"bucket {k} not padded to {multiple}"
        assert b.shard_size * s.world_size == b.padded_size, f"bucket {k} shards are unequal"
        assert b.shard_offset == shard_offset, f"bucket {k} shard offset {b.shard_offset}, expected {shard_offset}"
        members = range(b.first_tensor, b.end_tensor)
        ends = [s.offsets[i] + s.sizes[i] for i in members]
        assert b.content_end == max(ends, default=b.flat_start), f"bucket {k} content end is wrong"
        assert b.flat_start <= b.content_end <= b.flat_start + b.padded_size
        assert b.padded_size - (b.content_end - b.flat_start) < multiple, f"bucket {k} over-padded"
        for i in members:
            assert s.offsets[i] >= b.flat_start, f"tensor {i} starts before its bucket {k}"
        check_bucket_closing(s, k, b)
        next_tensor, next_start, shard_offset = b.end_tensor, b.flat_start + b.padded_size, shard_offset + b.shard_size
    assert next_tensor == len(s.sizes), "buckets do not cover every tensor"
    assert next_start == s.total_size, "buckets do not add up to the buffer"
    assert shard_offset == s.shard_size and s.shard_size * s.world_size == s.total_size


def check_bucket_closing(s: LayoutSnapshot, k: int, b: zerocore.Bucket) -> None:
    """A bucket closes at the first boundary reaching the cap; a tensor above the cap stands alone."""
    for i in range(b.first_tensor, b.end_tensor):
        filled = s.offsets[i] + s.sizes[i] - b.flat_start
        is_last = i == b.end_tensor - 1
        if not is_last:
            assert filled < s.bucket_cap, f"bucket {k} should have closed after tensor {i}"
        if s.sizes[i] > s.bucket_cap:
            assert i == b.first_tensor and is_last, f"tensor {i} is larger than the cap but shares bucket {k}"
    if k + 1 < len(s.buckets) and b.end_tensor > b.first_tensor:
        filled = b.content_end - b.flat_start
        next_size = s.sizes[b.end_tensor] if b.end_tensor < len(s.sizes) else 0
        assert filled >= s.bucket_cap or next_size > s.bucket_cap, f"bucket {k} closed before reaching the cap"


def check_pieces(s: LayoutSnapshot) -> None:
    """Each tensor element is owned by exactly one rank and the three ranges of a piece agree."""
    covered = [bytearray(size) for size in s.sizes]
    for rank, pieces in enumerate(s.pieces):
        shard_cursor = 0
        for p in pieces:
            b = s.buckets[p.bucket]
            assert p.length > 0, f"rank {rank} has an empty piece {p}"
            assert b.first_tensor <= p.tensor < b.end_tensor, f"piece {p} names a tensor outside its bucket"
            assert 0 <= p.tensor_offset and p.tensor_offset + p.length <= s.sizes[p.tensor], f"piece {p} leaves its tensor"
            assert p.flat_offset == s.offsets[p.tensor] + p.tensor_offset, f"piece {p} flat offset disagrees"
            shard_start = b.flat_start + rank * b.shard_size
            assert shard_start <= p.flat_offset and p.flat_offset + p.length <= shard_start + b.shard_size, (
                f"piece {p} lies outside rank {rank}'s shard of bucket {p.bucket}"
            )
            assert p.shard_offset == b.shard_offset + p.flat_offset - shard_start, f"piece {p} shard offset disagrees"
            assert p.shard_offset >= shard_cursor, f"rank {rank}'s pieces overlap or are out of order at {p}"
            shard_cursor = p.shard_offset + p.length
            region = covered[p.tensor]
            for e in range(p.tensor_offset, p.tensor_offset + p.length):
                assert region[e] == 0, f"element {e} of tensor {p.tensor} is owned twice"
                region[e] = 1
        assert shard_cursor <= s.shard_size
    for i, region in enumerate(covered):
        assert all(region), f"tensor {i} has elements no rank owns"


def check_all(s: LayoutSnapshot) -> None:
    check_offsets(s)
    check_buckets(s)
    check_pieces(s)
