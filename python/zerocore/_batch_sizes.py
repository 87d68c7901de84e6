"""DeepSpeed's ``set_train_batch_size`` / ``set_train_micro_batch_size`` on a running engine.

Note [Batch size changes]
-------------------------
Megatron-DeepSpeed's batch-size ramp-up (and DeepSpeed's data-efficiency library) grows the global batch while
training: ``set_train_batch_size(n)`` keeps the micro-batch and changes the micro-batches per optimizer step,
``set_train_micro_batch_size(m)`` keeps the steps and changes the micro-batch. Both take effect at a window's
end only: inside one, the micro-batches already accumulated had their losses divided by the old count
(``scale_wrt_gas``), so the window would average them wrongly. The change is a collective: ranks asked for
different sizes would accumulate different numbers of micro-batches and leave their gradient reductions
unpaired (a hang), and a refusal on one rank (inside its window, a size it cannot split) must not leave the
others changed. So every rank first puts its request and its verdict in one all-reduce; then all raise alike,
nothing changed, or all apply it. ``global_samples`` counts every step at the batch it was taken at, as
DeepSpeed's running sum does: the count so far is kept as a mark, and the steps after it add the new batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ._config_values import as_int
from ._lifecycle import USABLE, EngineState

if TYPE_CHECKING:
    from .engine import Engine


def sizes_for_batch(engine: Engine, train_batch_size: Any) -> tuple[int, int, int]:
    """(global batch, micro-batch, accumulation steps) for ``set_train_batch_size``."""
    batch = as_int(train_batch_size, "train_batch_size", 1)
    micro = engine.config.train_micro_batch_size_per_gpu
    if micro is None:
        raise ValueError("set_train_batch_size(): the config gives no train_micro_batch_size_per_gpu or "
                         "train_batch_size, so there is no micro-batch size to keep")
    if batch % (micro * engine.world_size):
        raise ValueError(f"set_train_batch_size({batch}): not divisible by train_micro_batch_size_per_gpu ({micro}) "
                         f"* data-parallel ranks ({engine.world_size}); no gradient_accumulation_steps fits")
    return batch, micro, batch // (micro * engine.world_size)


def sizes_for_micro_batch(engine: Engine, micro_batch_size: Any) -> tuple[int, int, int]:
    """(global batch, micro-batch, accumulation steps) for ``set_train_micro_batch_size``."""
    micro = as_int(micro_batch_size, "micro_batch_size", 1)
    steps = engine.config.gradient_accumulation_steps
    return micro * steps * engine.world_size, micro, steps


def set_batch_sizes(engine: Engine, action: str, sizes: Callable[[], tuple[int, int, int]]) -> None:
    """Note [Batch size changes]: agreed on every rank, then applied to ``engine.config``."""
    engine.lifecycle.require(action, *USABLE)  # (closed, or inside a backward: no exchange is possible)
    error: Exception | None = None
    batch = micro = steps = 0
    try:
        batch, micro, steps = sizes()
        engine._end_unstepped_micro_step()
        engine.lifecycle.require(action, EngineState.IDLE)
        engine._refuse_inside_window(action, "would scale the micro-batches already accumulated for another count")
    except (ValueError, RuntimeError) as caught:
        error = caught
    rows = torch.zeros(engine.world_size, 4, dtype=torch.int64, device=engine.device)
    rows[engine.rank] = torch.tensor([batch, micro, steps, int(error is not None)], dtype=torch.int64)
    engine.comm.all_reduce(rows.view(-1)).wait()
    table = rows.tolist()
    if error is not None:
        raise error
    refused = [rank for rank, row in enumerate(table) if row[3]]
    if refused:
        raise RuntimeError(f"{action} was refused on rank(s) {refused} (their error says why); nothing was changed on "
                           "any rank")
    if any(row != table[0] for row in table):
        asked = {rank: f"{row[0]} ({row[1]} x {row[2]} micro-batches)" for rank, row in enumerate(table)}
        raise ValueError(f"{action}: the ranks asked for different batch sizes ({asked}); call it on every rank with "
                         "the same value. Nothing was changed on any rank")
    engine._samples_mark = (engine.global_samples, engine.global_steps)
    engine.config = dataclasses.replace(engine.config, train_batch_size=batch, train_micro_batch_size_per_gpu=micro,
                                        gradient_accumulation_steps=steps)
