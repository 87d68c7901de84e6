"""Which elements of a rank's optimizer shard are which parameter (``ShardPiece``) of which param group
(``ShardRun``), and which stretches of it a step updates, with which step (``shard_segments``).

Note [Parameters without gradients]
-----------------------------------
A trainable parameter that got no gradient in an accumulation window on any rank (never used, used on
alternate steps only, or frozen with ``requires_grad_(False)`` after ``initialize``) is not updated by that
step: no weight decay, no moment decay, and its own step count (Adam's bias correction) does not advance.
That is what torch's Adam/AdamW does with DDP or FSDP2, where such a parameter's ``.grad`` stays None; a flat
update over whole shards (DeepSpeed's) would instead decay it and keep moving it with stale momentum, so a
layer frozen mid-training would go on changing. Which parameters got a gradient travels with the step's one
all-reduce (the engine's per-parameter flags, summed over ranks). ``OptimizerState.idle_steps`` counts, per
parameter name, the applied steps it sat out; its step is ``step_count`` minus that. While no parameter has
sat out a step (the common case) the update is the one call per param group over whole shards; otherwise
each parameter's stretch of a shard is updated (or left alone) with its own step, one call per (param
group, step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ShardRun:
    """Elements ``[start, end)`` of a shard whose parameters share param group ``group``."""

    start: int
    end: int
    group: int


@dataclass(frozen=True)
class ShardPiece:
    """Elements ``[shard_offset, shard_offset + length)`` of a shard hold elements
    ``[tensor_offset, tensor_offset + length)`` of the flattened parameter ``name`` (global shape ``shape``)."""

    name: str
    shape: tuple[int, ...]
    tensor_offset: int
    shard_offset: int
    length: int


def shard_geometry(layout: Any, rank: int, bucket: int, names: Sequence[str], shapes: Sequence[tuple[int, ...]],
                   groups: Sequence[int]) -> tuple[list[ShardRun], list[ShardPiece]]:
    """The runs and pieces of ``rank``'s shard of ``bucket`` of a ``FlatLayout`` whose tensor ``i`` is the
    parameter ``names[i]`` of param group ``groups[i]``. Offsets are relative to that bucket's shard."""
    base = layout.buckets[bucket].shard_offset
    runs: list[ShardRun] = []
    pieces: list[ShardPiece] = []
    for piece in layout.pieces(rank, bucket):
        start, end, group = piece.shard_offset - base, piece.shard_offset - base + piece.length, groups[piece.tensor]
        pieces.append(ShardPiece(names[piece.tensor], tuple(shapes[piece.tensor]), piece.tensor_offset, start,
                                 piece.length))
        if runs and runs[-1].group == group:
            runs[-1] = ShardRun(runs[-1].start, end, group)  # padding between pieces is zero and stays zero
        else:
            runs.append(ShardRun(start, end, group))
    return runs, pieces


def shard_segments(shard: Any, plan: Any) -> list[tuple[int, int, int, int]]:
    """The stretches ``(start, end, group, lag)`` of ``shard`` a step updates, ``lag`` being how many steps
    behind ``step_count`` their parameters' own step is: the whole runs while no parameter lags or is left
    alone (``plan`` None), else each parameter's piece, those without a gradient left out (Note [Parameters
    without gradients]). Adjacent stretches alike merge (the padding between pieces is zero and stays zero)."""
    if plan is None:
        return [(run.start, run.end, run.group, 0) for run in shard.runs]
    without_grad, lags = plan
    lag_of = dict(lags)
    out: list[tuple[int, int, int, int]] = []
    runs = iter(shard.runs)
    run = next(runs, None)
    extends = False  # whether the last piece was updated, so the next one may extend its stretch
    for piece in shard.pieces:
        while run is not None and run.end <= piece.shard_offset:
            run = next(runs, None)
        if piece.name in without_grad or run is None:
            extends = False
            continue
        start, end, lag = piece.shard_offset, piece.shard_offset + piece.length, lag_of.get(piece.name, 0)
        if extends and out[-1][2] == run.group and out[-1][3] == lag:
            out[-1] = (out[-1][0], end, run.group, lag)
        else:
            out.append((start, end, run.group, lag))
        extends = True
    return out
