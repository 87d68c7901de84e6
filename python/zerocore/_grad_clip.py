"""``engine.clip_grad_norm_(max_norm)``: FSDP1's ``model.clip_grad_norm_`` for sharded gradients.

Note [Clipping by hand]
-----------------------
After the accumulation boundary's backward every rank holds only its shard of the reduced gradients and
``.grad`` is None, so ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` finds nothing to clip. This
is the call that does (FSDP1 has the same method for the same reason): each rank reduces its shards to one
partial (the sum of ``|g|^p``, or the largest ``|g|`` for ``p = inf``), one all-reduce makes the global norm,
the same on every rank, and the gradients are multiplied by ``max_norm / (norm + 1e-6)`` clamped at 1,
torch's coefficient computed as torch computes it (fp32), so a clipped window equals DDP's with torch's
function. The norm returned is the one before clipping, unscaled from fp16's loss scale.

The multiplication is not a pass over the shards: the optimizer state keeps the coefficient beside them
(``OptimizerState.grad_coefficient``) and every reader applies it, in fp32: the step's norm and Adam's
gradient scale (fp32 gradients times the fp32 coefficient: the bits torch's in-place multiply gives), the
gradient getters (``safe_get_full_grad`` returns the clipped gradient, as ``.grad`` is after torch's call)
and a later clip. 16-bit gradients are not rounded again, as an in-place multiply would; a write into the
gradients (``safe_set_full_grad``) multiplies the coefficient in first and is then taken as given.

A window clipped by hand is not clipped again by the step at the config's ``gradient_clipping`` (1.0 unless
the config says otherwise): a second clip at another threshold would silently train differently from the
torch program the call stands in for. ``engine.get_global_grad_norm()`` after the step is the norm the step
saw (the clipped one).

The call is a collective: every rank calls it with the same arguments. A rank that cannot (a call outside
the window between the boundary's ``backward()`` and ``step()``, a bad argument) still joins the all-reduce,
with its refusal flagged, and every rank raises with nothing changed, instead of the others waiting; so do
ranks given different arguments.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from ._full_param_state import outside_grad_window
from ._optimizer_state import _NORM_CHUNK

if TYPE_CHECKING:
    from ._optimizer_state import Shard
    from .engine import Engine


def clip_grad_norm(engine: Engine, max_norm: float, norm_type: float | str, error_if_nonfinite: bool) -> torch.Tensor:
    """Engine.clip_grad_norm_'s body (Note [Clipping by hand])."""
    bad_argument = _arguments_problem(max_norm, norm_type)
    refused = bad_argument or outside_grad_window(engine, "the reduced gradients exist")
    p = float(norm_type) if refused is None else 2.0
    state = engine.optimizer_state
    if refused is None:
        for buffer in engine.buffers:
            buffer.settle_grads()
        partial = (state.grad_sum_of_squares() if p == 2.0
                   else _local_partial(state.shards, p, state.grad_coefficient))
    else:
        partial = torch.zeros((), dtype=torch.float64)
    # Per rank: refused, its partial, norm_type, max_norm; each rank fills its own row of a sum, so every rank
    # reads every row (a max and a sum of partials from one all-reduce, and arguments compared)
    device = state.shards[0].grads.device if state.shards else engine.device
    rows = torch.zeros(engine.world_size, 4, dtype=torch.float64, device=device)
    mine = [1.0, 0.0, math.nan, math.nan] if refused is not None else [0.0, 0.0, p, float(max_norm)]
    rows[engine.rank] = torch.tensor(mine, dtype=torch.float64).to(device)
    rows[engine.rank, 1] = partial.to(device)
    engine.comm.all_reduce(rows.view(-1)).wait()
    engine.host_syncs += 1
    table = rows.tolist()
    if refused is not None:
        error = ValueError if bad_argument is not None else RuntimeError
        raise error(f"engine.clip_grad_norm_(): {refused}; nothing was changed on any rank")
    refusing = [rank for rank, row in enumerate(table) if row[0]]
    if refusing:
        raise RuntimeError(f"engine.clip_grad_norm_() was refused on rank(s) {refusing} (their error says why); "
                           "nothing was changed on any rank")
    if any(row[2:] != table[0][2:] for row in table):
        asked = "; ".join(f"rank {rank}: max_norm={row[3]}, norm_type={row[2]}" for rank, row in enumerate(table))
        raise ValueError(f"engine.clip_grad_norm_() got different arguments on different ranks ({asked}): each rank "
                         "would clip its shard differently; pass the same on every rank (nothing was changed on any "
                         "rank)")
    partials = [row[1] for row in table]
    if math.isinf(p):  # (Python's max would drop a NaN that is not first)
        total = math.nan if any(math.isnan(x) for x in partials) else max(partials)
    else:
        total = sum(partials)
    unscale = 1.0 / engine.loss_scaler.scale if engine.config.fp16.enabled else 1.0  # fp16 gradients are held scaled
    norm = (total if math.isinf(p) else total ** (1.0 / p)) * unscale
    total_norm = torch.tensor(norm, dtype=torch.float32)  # (on the host: the coefficient needs no device sync)
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(f"engine.clip_grad_norm_(): the total norm of order {p} of the gradients is {norm}, so "
                           "they cannot be clipped; nothing was changed on any rank. Set error_if_nonfinite=False "
                           "to clip anyway (the step then applies non-finite gradients, as torch's AdamW would)")
    state.clip_by_hand(float(torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)))  # torch's, in fp32
    return total_norm.to(engine.device)


def _arguments_problem(max_norm: object, norm_type: object) -> str | None:
    scalar = isinstance(max_norm, torch.Tensor) and max_norm.dim() == 0
    if isinstance(max_norm, (torch.Tensor, Iterable)) and not scalar:
        return ("max_norm must be a number: engine.clip_grad_norm_(max_norm, norm_type) clips every trainable "
                "parameter of the engine, as FSDP1's model.clip_grad_norm_ does (torch's function takes the "
                f"parameters first), got {type(max_norm).__name__}")
    try:
        limit = float(max_norm)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return f"max_norm must be a number, got {max_norm!r}"
    if not limit >= 0.0:
        return f"max_norm must be >= 0 (inf: measure without clipping), got {max_norm!r}"
    try:
        p = float(norm_type)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return f"norm_type must be a number or 'inf', got {norm_type!r}"
    if not p > 0.0:
        return f"norm_type must be > 0 (2.0: the Euclidean norm; 'inf': the largest element), got {norm_type!r}"
    return None


def _local_partial(shards: list[Shard], p: float, coefficient: float) -> torch.Tensor:
    """This rank's share of a p-norm other than 2 (which the step's own sum of squares gives) as a float64
    scalar: the sum of |g|^p over its gradients (the shards' values times ``coefficient``), or the largest |g|
    when p is inf. Each chunk is reduced in fp32 (16-bit gradients widened a chunk at a time, as the step's
    norm does), the chunks combined in float64, with no host sync."""
    parts = [torch.linalg.vector_norm(shard.grads[start:start + _NORM_CHUNK], ord=p, dtype=torch.float32).double()
             for shard in shards for start in range(0, shard.grads.numel(), _NORM_CHUNK)]
    if not parts:
        return torch.zeros((), dtype=torch.float64)
    norms = torch.stack(parts)
    return norms.max() * coefficient if math.isinf(p) else norms.pow(p).sum() * coefficient ** p
