"""The flat-partition layout (C++ core, `cpp/include/zerocore/layout.hpp`), for the engine and for other
frameworks that want ZeRO's geometry without the engine.

See Note [Flat-partition geometry] in layout.hpp: tensors sit at aligned offsets in one flat buffer, the
buffer is cut into buckets at tensor boundaries, every bucket is padded to a multiple of
``world_size * alignment`` and split into ``world_size`` equal shards, and a rank's shard of the buffer is
the concatenation of its bucket shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ._arguments import as_int
from ._native import _C


class Bucket(NamedTuple):
    """One bucket: tensors ``[first_tensor, end_tensor)`` and the bucket's place in the flat buffer."""

    flat_start: int  # first element; a multiple of world_size * alignment
    content_end: int  # one past the last tensor element
    padded_size: int  # length with padding; a multiple of world_size * alignment
    shard_size: int  # padded_size // world_size, the same for every rank
    shard_offset: int  # where this bucket's shard starts in every rank's concatenated shard
    first_tensor: int
    end_tensor: int


class Piece(NamedTuple):
    """Where tensor ``tensor`` meets one rank's shard: three ranges of ``length`` elements."""

    tensor: int
    bucket: int
    tensor_offset: int  # start inside the flattened tensor
    shard_offset: int  # start inside the rank's concatenated shard
    flat_offset: int  # start inside the flat buffer
    length: int


class FlatLayout:
    """Offsets, buckets and per-rank shards of ``len(sizes)`` tensors in one flat buffer.

    Args:
        sizes: element count of each tensor, in order (a sequence of ints or a 1-D integer tensor).
        world_size: number of data-parallel ranks (>= 1).
        alignment: every tensor offset and every shard boundary is a multiple of this many elements (>= 1).
        bucket_cap: a bucket closes at the first tensor boundary where it holds at least this many
            elements (>= 1); a tensor larger than the cap is a bucket of its own.

    Raises:
        ValueError: naming the bad value (a negative size, world_size < 1, alignment < 1, bucket_cap < 1).
    """

    def __init__(self, sizes: Sequence[int] | torch.Tensor, world_size: int, alignment: int, bucket_cap: int):
        if not isinstance(sizes, torch.Tensor):
            if not hasattr(sizes, "__iter__"):
                raise ValueError(f"sizes must be a sequence of ints or a tensor, got {sizes!r}")
            sizes = [as_int(f"sizes[{index}]", size) for index, size in enumerate(sizes)]
        self._native = _C.FlatLayout(sizes, as_int("world_size", world_size), as_int("alignment", alignment),
                                     as_int("bucket_cap", bucket_cap))
        self._buckets: list[Bucket] | None = None

    @property
    def num_tensors(self) -> int:
        return self._native.num_tensors

    @property
    def num_buckets(self) -> int:
        return self._native.num_buckets

    @property
    def world_size(self) -> int:
        return self._native.world_size

    @property
    def alignment(self) -> int:
        return self._native.alignment

    @property
    def bucket_cap(self) -> int:
        return self._native.bucket_cap

    @property
    def total_size(self) -> int:
        """Length of the flat buffer, padding included."""
        return self._native.total_size

    @property
    def shard_size(self) -> int:
        """Length of every rank's concatenated shard (``total_size // world_size``)."""
        return self._native.shard_size

    def sizes(self) -> torch.Tensor:
        """Element count per tensor (int64)."""
        return self._native.sizes()

    def offsets(self) -> torch.Tensor:
        """Flat offset per tensor (int64); each a multiple of ``alignment``."""
        return self._native.offsets()

    def tensor_buckets(self) -> torch.Tensor:
        """Bucket index per tensor (int64)."""
        return self._native.tensor_buckets()

    def buckets_tensor(self) -> torch.Tensor:
        """``[num_buckets, 7]`` int64 with the fields of :class:`Bucket`."""
        return self._native.buckets()

    @property
    def buckets(self) -> list[Bucket]:
        if self._buckets is None:
            self._buckets = [Bucket(*row) for row in self._native.buckets().tolist()]
        return self._buckets

    def pieces_tensor(self, rank: int, bucket: int | None = None) -> torch.Tensor:
        """``[pieces, 6]`` int64 with the fields of :class:`Piece` for ``rank`` (in one bucket if given)."""
        if bucket is None:
            return self._native.rank_pieces(as_int("rank", rank))
        return self._native.bucket_rank_pieces(as_int("bucket", bucket), as_int("rank", rank))

    def pieces(self, rank: int, bucket: int | None = None) -> list[Piece]:
        """The places where tensors meet ``rank``'s shard, in shard order."""
        return [Piece(*row) for row in self.pieces_tensor(rank, bucket).tolist()]

    def bucket_cuts(self) -> list[list[int]]:
        """Per bucket: the offsets, relative to its ``flat_start``, where its non-empty tensors begin and end
        (sorted, distinct). A quantized collective starts a scale group at each, so no two tensors share one."""
        return self._native.bucket_cuts()

    def shard_range(self, bucket: int, rank: int) -> tuple[int, int]:
        """``rank``'s shard of ``bucket`` as a ``[start, end)`` range of the flat buffer.

        Raises:
            IndexError: ``bucket`` outside ``[0, num_buckets)`` (a negative one does not count from the end).
            ValueError: ``rank`` outside ``[0, world_size)``, or either is not an int.
        """
        bucket, rank = as_int("bucket", bucket), as_int("rank", rank)
        if not 0 <= bucket < self.num_buckets:
            raise IndexError(f"bucket must be in [0, {self.num_buckets}), got {bucket}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        b = self.buckets[bucket]
        start = b.flat_start + rank * b.shard_size
        return start, start + b.shard_size

    def __repr__(self) -> str:
        return (
            f"FlatLayout(tensors={self.num_tensors}, buckets={self.num_buckets}, world_size={self.world_size}, "
            f"alignment={self.alignment}, total_size={self.total_size}, shard_size={self.shard_size})"
        )
