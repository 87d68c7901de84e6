"""The one owner of the sharded optimizer state: fp32 master weights, Adam moments and the step count.

Note [Optimizer state ownership]
--------------------------------
Whatever the stage, a rank's optimizer state is a list of *shards*: contiguous stretches of a flat
parameter buffer that this rank updates (stages 1-2: this rank's part of every bucket of the model's
buffer; stage 3: this rank's part of every unit). The parameter storage owns the compute-dtype values and
the reduced gradients; this object owns, for every shard,

* ``master``      fp32 weights; in fp32 training the shard of the parameter buffer itself (no copy),
* ``exp_avg``, ``exp_avg_sq``  fp32 moments,

all allocated as one flat tensor each (``placement`` says where: the parameters' device today; the CPU or
NVMe for offload later), plus one step count. ``step()`` updates every shard of a param group in one call
into C++ (``ops.multi_tensor_adam_step``). Each shard knows which param group every element belongs to
(``runs``) and which parameter elements it holds (``pieces``, global coordinates for checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import ops

_NORM_BLOCK = 16384  # elements reduced in fp32 before the float64 sum (see grad_sum_of_squares)


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


class Shard:
    """One shard's optimizer state. ``params`` and ``grads`` belong to the parameter storage; ``master``,
    ``exp_avg`` and ``exp_avg_sq`` are views of the owner's flat tensors (``master`` is ``params`` itself in
    fp32 training)."""

    def __init__(self, label: str, params: torch.Tensor, grads: torch.Tensor, runs: Sequence[ShardRun],
                 pieces: Sequence[ShardPiece]) -> None:
        self.label = label
        self.params = params
        self.grads = grads
        self.runs = tuple(runs)
        self.pieces = tuple(pieces)
        self.master: torch.Tensor = params
        self.exp_avg: torch.Tensor = torch.empty(0)
        self.exp_avg_sq: torch.Tensor = torch.empty(0)
        self.initial_master: torch.Tensor | None = None  # 16-bit training: fp32 values until build()

    @property
    def numel(self) -> int:
        return self.params.numel()

    @property
    def separate_master(self) -> bool:
        return self.master is not self.params


class OptimizerState:
    """Sharded Adam/AdamW state for every shard of this rank, and its one step count."""

    def __init__(self, placement: torch.device) -> None:
        self.placement = placement
        self.shards: list[Shard] = []
        self.step_count = 0
        self._built = False

    def add_shard(self, label: str, params: torch.Tensor, grads: torch.Tensor, runs: Sequence[ShardRun],
                  pieces: Sequence[ShardPiece], master_values: torch.Tensor | None = None) -> Shard:
        """Registers a shard before :meth:`build`. ``params`` (1-D, compute dtype) receives the updated
        weights; in 16-bit training ``master_values`` gives its fp32 values (the 16-bit ones lost bits)."""
        if self._built:
            raise RuntimeError("OptimizerState.add_shard() after build()")
        if params.numel() != grads.numel():
            raise ValueError(f"shard {label}: {params.numel()} parameter elements but {grads.numel()} gradients")
        shard = Shard(label, params, grads, runs, pieces)
        shard.initial_master = master_values
        self.shards.append(shard)
        return shard

    def build(self) -> None:
        """Allocates the flat fp32 tensors at ``placement`` and gives every shard its views."""
        total = sum(s.numel for s in self.shards)
        separate = [s for s in self.shards if s.params.dtype != torch.float32]
        self.master = torch.zeros(sum(s.numel for s in separate), dtype=torch.float32, device=self.placement)
        self.exp_avg = torch.zeros(total, dtype=torch.float32, device=self.placement)
        self.exp_avg_sq = torch.zeros(total, dtype=torch.float32, device=self.placement)
        offset = master_offset = 0
        for shard in self.shards:
            n = shard.numel
            shard.exp_avg = self.exp_avg[offset : offset + n]
            shard.exp_avg_sq = self.exp_avg_sq[offset : offset + n]
            offset += n
            values, shard.initial_master = shard.initial_master, None
            if shard.params.dtype != torch.float32:
                shard.master = self.master[master_offset : master_offset + n]
                master_offset += n
                shard.master.copy_(values if values is not None else shard.params)
        self._slices_by_group = self._group_slices(self.shards)
        self._slices_by_shard = [self._group_slices([shard]) for shard in self.shards]
        self._built = True

    def reload_master(self, shard: Shard) -> None:
        """The compute-dtype parameters of ``shard`` were overwritten: the master follows them."""
        if shard.separate_master:
            shard.master.copy_(shard.params)

    def absorb_written(self, shard: Shard) -> None:
        """Some compute-dtype parameters of ``shard`` were written by the user: the master takes every
        element that no longer equals its own rounding (the others keep their fp32 bits)."""
        if shard.separate_master:
            shard.master.copy_(torch.where(shard.master.to(shard.params.dtype) == shard.params, shard.master,
                                           shard.params.to(torch.float32)))

    def grad_sum_of_squares(self) -> torch.Tensor:
        """Sum of squares of every gradient shard as a float64 scalar on the shards' device (padding is zero
        and adds nothing); inf or NaN when any gradient is. Each block of ``_NORM_BLOCK`` elements is reduced
        in fp32 and the blocks are summed in float64: one fp32 reduction over a whole shard loses ~1e-3
        relative at 16M elements, this stays within ~3e-7 at any size, at the same speed."""
        device = self.shards[0].grads.device if self.shards else self.placement
        total = torch.zeros((), dtype=torch.float64, device=device)
        for shard in self.shards:
            grads = shard.grads
            whole = grads.numel() // _NORM_BLOCK * _NORM_BLOCK
            if whole:
                blocks = torch.linalg.vector_norm(grads[:whole].view(-1, _NORM_BLOCK), dim=1, dtype=torch.float32)
                total += blocks.double().square().sum()
            if whole < grads.numel():
                total += torch.linalg.vector_norm(grads[whole:], dtype=torch.float32).double().square()
        return total

    def step(self, param_groups: Sequence[dict[str, Any]], grad_scale: float,
             after_shard: Callable[[int], None] | None = None) -> None:
        """One Adam/AdamW update of every shard, ``grad_scale`` multiplying the gradients (loss-scale
        unscaling and clipping): one C++ call per param group; or, with ``after_shard``, shard by shard
        (one call per param group within it), calling ``after_shard(i)`` once shard ``i`` is updated, so the
        caller can start sending it while the next shard computes."""
        self.step_count += 1
        if after_shard is None:
            self._update(self._slices_by_group, param_groups, grad_scale)
            return
        for index, calls in enumerate(self._slices_by_shard):
            self._update(calls, param_groups, grad_scale)
            after_shard(index)

    def _update(self, calls: list[tuple[int, tuple[list[torch.Tensor], ...]]],
                param_groups: Sequence[dict[str, Any]], grad_scale: float) -> None:
        for group, (masters, grads, exp_avgs, exp_avg_sqs, outs) in calls:
            hyper = param_groups[group]
            beta1, beta2 = hyper["betas"]
            ops.multi_tensor_adam_step(
                masters, grads, exp_avgs, exp_avg_sqs, step=self.step_count, lr=hyper["lr"], beta1=beta1,
                beta2=beta2, eps=hyper["eps"], weight_decay=hyper["weight_decay"], adamw=hyper["adamw_mode"],
                grad_scale=grad_scale, bias_correction=hyper["bias_correction"], param_outs=outs)

    def _group_slices(self, shards: Sequence[Shard]) -> list[tuple[int, tuple[list[torch.Tensor], ...]]]:
        """Per param group, the views ``step()`` hands to C++ (every tensor behind them lives as long as this
        object, so they are made once): masters, grads, moments, and 16-bit outputs (None in fp32)."""
        per_group: dict[int, list[tuple[torch.Tensor | None, ...]]] = {}
        for shard in shards:
            for run in shard.runs:
                out = shard.params[run.start : run.end] if shard.separate_master else None
                per_group.setdefault(run.group, []).append((
                    shard.master[run.start : run.end], shard.grads[run.start : run.end],
                    shard.exp_avg[run.start : run.end], shard.exp_avg_sq[run.start : run.end], out))
        result = []
        for group, slices in sorted(per_group.items()):
            masters, grads, exp_avgs, exp_avg_sqs, outs = (list(column) for column in zip(*slices))
            result.append((group, (masters, grads, exp_avgs, exp_avg_sqs,
                                   None if all(o is None for o in outs) else outs)))
        return result

    def pieces(self) -> Iterator[tuple[Shard, ShardPiece]]:
        """Every (shard, piece): which parameter elements this rank's state holds, for checkpoints."""
        for shard in self.shards:
            for piece in shard.pieces:
                yield shard, piece

    def memory(self) -> dict[str, int]:
        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        return {"master_params": nbytes(self.master),
                "optimizer_moments": nbytes(self.exp_avg) + nbytes(self.exp_avg_sq)}
