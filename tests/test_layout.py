"""Properties of the flat-partition layout (C++ core through zerocore._C)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import zerocore
from layout_checker import LayoutSnapshot, check_all, check_buckets, check_offsets, check_pieces, snapshot

sizes_strategy = st.lists(
    st.one_of(st.just(0), st.integers(1, 8), st.integers(1, 400)), min_size=0, max_size=24
)
world_strategy = st.integers(1, 9)
alignment_strategy = st.sampled_from([1, 2, 3, 4, 8, 16, 64])
cap_strategy = st.integers(1, 1200)


def build(sizes, world_size, alignment, cap) -> tuple[zerocore.FlatLayout, LayoutSnapshot]:
    layout = zerocore.FlatLayout(sizes, world_size, alignment, cap)
    return layout, snapshot(layout, sizes)


@given(sizes_strategy, world_strategy, alignment_strategy, cap_strategy)
def test_every_element_owned_by_exactly_one_rank(sizes, world_size, alignment, cap):
    _, s = build(sizes, world_size, alignment, cap)
    check_pieces(s)


@given(sizes_strategy, world_strategy, alignment_strategy, cap_strategy)
def test_offsets_aligned_and_disjoint(sizes, world_size, alignment, cap):
    _, s = build(sizes, world_size, alignment, cap)
    check_offsets(s)


@given(sizes_strategy, world_strategy, alignment_strategy, cap_strategy)
def test_bucket_invariants_and_equal_shards(sizes, world_size, alignment, cap):
    layout, s = build(sizes, world_size, alignment, cap)
    check_buckets(s)
    assert layout.shard_size * world_size == layout.total_size
    assert layout.tensor_buckets().tolist() == [
        k for k, b in enumerate(s.buckets) for _ in range(b.first_tensor, b.end_tensor)
    ]


@given(sizes_strategy, world_strategy, alignment_strategy, cap_strategy)
def test_pieces_agree_with_per_bucket_queries_and_ranges(sizes, world_size, alignment, cap):
    layout, s = build(sizes, world_size, alignment, cap)
    for rank in range(world_size):
        per_bucket = [p for k in range(layout.num_buckets) for p in layout.pieces(rank, bucket=k)]
        assert per_bucket == s.pieces[rank]
        for k in range(layout.num_buckets):
            start, end = layout.shard_range(k, rank)
            assert end - start == s.buckets[k].shard_size


@given(sizes_strategy, world_strategy, alignment_strategy, cap_strategy)
def test_bucket_cuts_are_exactly_the_tensor_boundaries(sizes, world_size, alignment, cap):
    """A quantized collective starts a scale group at every cut: each non-empty tensor must begin and end at
    one with none inside it, and a cut anywhere else would split a group for nothing."""
    layout = zerocore.FlatLayout(sizes, world_size, alignment, cap)
    cuts = layout.bucket_cuts()
    offsets = layout.offsets().tolist()
    assert len(cuts) == layout.num_buckets
    for k, bucket in enumerate(layout.buckets):
        assert cuts[k] == sorted(set(cuts[k]))
        spans = [(offsets[t] - bucket.flat_start, offsets[t] + sizes[t] - bucket.flat_start)
                 for t in range(bucket.first_tensor, bucket.end_tensor) if sizes[t] > 0]
        for begin, end in spans:
            assert begin in cuts[k] and end in cuts[k]
            assert not [c for c in cuts[k] if begin < c < end]
        assert set(cuts[k]) <= {c for span in spans for c in span}
        assert all(0 <= c <= bucket.content_end - bucket.flat_start for c in cuts[k])


@given(sizes_strategy, world_strategy, alignment_strategy, cap_strategy)
def test_layout_is_deterministic(sizes, world_size, alignment, cap):
    _, first = build(sizes, world_size, alignment, cap)
    _, second = build(sizes, world_size, alignment, cap)
    _, from_tensor = build(torch.tensor(sizes, dtype=torch.int64), world_size, alignment, cap)
    assert first == second
    assert dataclasses.replace(from_tensor, sizes=list(sizes)) == first


@given(sizes_strategy, world_strategy, alignment_strategy, cap_strategy)
def test_gather_of_all_shards_reassembles_every_tensor(sizes, world_size, alignment, cap):
    """What the engine does: scatter tensors into rank shards by pieces, all-gather, read back by offset."""
    layout, s = build(sizes, world_size, alignment, cap)
    tensors = [torch.arange(size, dtype=torch.float64) + 1000 * i for i, size in enumerate(sizes)]
    shards = torch.full((world_size, layout.shard_size), float("nan"), dtype=torch.float64)
    for rank in range(world_size):
        for p in s.pieces[rank]:
            shards[rank, p.shard_offset : p.shard_offset + p.length] = tensors[p.tensor][
                p.tensor_offset : p.tensor_offset + p.length
            ]
    flat = torch.empty(layout.total_size, dtype=torch.float64)
    for b in s.buckets:  # the all-gather of each bucket: rank r's bucket shard lands at r * shard_size
        for rank in range(world_size):
            flat[b.flat_start + rank * b.shard_size : b.flat_start + (rank + 1) * b.shard_size] = shards[
                rank, b.shard_offset : b.shard_offset + b.shard_size
            ]
    for i, offset in enumerate(s.offsets):
        assert torch.equal(flat[offset : offset + sizes[i]], tensors[i])


def test_edge_cases():
    empty = zerocore.FlatLayout([], 4, 8, 100)
    assert (empty.num_tensors, empty.num_buckets, empty.total_size, empty.shard_size) == (0, 0, 0, 0)
    assert empty.pieces(3) == []
    zeros = zerocore.FlatLayout([0, 0, 0], 2, 4, 10)
    check_all(snapshot(zeros, [0, 0, 0]))
    assert zeros.total_size == 0
    more_ranks = zerocore.FlatLayout([3], 16, 1, 10)  # more ranks than elements: most shards are padding
    check_all(snapshot(more_ranks, [3]))
    assert [len(more_ranks.pieces(r)) for r in range(16)] == [1, 1, 1] + [0] * 13
    big = zerocore.FlatLayout([5, 100, 5], 2, 1, 10)  # the tensor over the cap gets its own bucket
    assert [(b.first_tensor, b.end_tensor) for b in big.buckets] == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize(
    "args, named",
    [
        (([4, -1, 2], 2, 1, 10), "sizes[1]"),
        (([4], 0, 1, 10), "world_size"),
        (([4], -3, 1, 10), "world_size"),
        (([4], 2, 0, 10), "alignment"),
        (([4], 2, 1, 0), "bucket_cap"),
        (([4, 1.5], 2, 1, 10), "sizes[1]"),
    ],
)
def test_invalid_input_raises_value_error_naming_the_value(args, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        zerocore.FlatLayout(*args)


def test_invalid_rank_and_tensor_input():
    layout = zerocore.FlatLayout([4, 4], 2, 1, 10)
    with pytest.raises(ValueError, match="rank"):
        layout.pieces(2)
    with pytest.raises(ValueError, match="sizes"):
        zerocore.FlatLayout(torch.tensor([1.0, 2.0]), 2, 1, 10)
    with pytest.raises(ValueError, match="sizes\\[0\\]"):
        zerocore.FlatLayout(torch.tensor([-5]), 2, 1, 10)


# The checker itself must be able to fail: each fake layout breaks one invariant.
def _valid_snapshot() -> LayoutSnapshot:
    layout = zerocore.FlatLayout([5, 3, 7], 2, 2, 6)
    return snapshot(layout, [5, 3, 7])


def _break_overlap(s: LayoutSnapshot) -> None:
    s.offsets[1] = s.offsets[0] + 2


def _break_alignment(s: LayoutSnapshot) -> None:
    s.offsets[2] += 1


def _break_double_ownership(s: LayoutSnapshot) -> None:
    s.pieces[1].append(s.pieces[0][0]._replace(shard_offset=s.shard_size - 1, length=1))


def _break_missing_element(s: LayoutSnapshot) -> None:
    piece = s.pieces[0][0]
    s.pieces[0][0] = piece._replace(length=piece.length - 1)


def _break_unequal_shards(s: LayoutSnapshot) -> None:
    s.buckets[0] = s.buckets[0]._replace(shard_size=s.buckets[0].shard_size + 1)


def _break_bucket_over_cap(s: LayoutSnapshot) -> None:
    s.bucket_cap = 1


@pytest.mark.parametrize(
    "breaker",
    [_break_overlap, _break_alignment, _break_double_ownership, _break_missing_element, _break_unequal_shards,
     _break_bucket_over_cap],
)
def test_checker_catches_a_broken_layout(breaker):
    s = _valid_snapshot()
    check_all(s)
    breaker(s)
    with pytest.raises(AssertionError):
        check_all(s)
