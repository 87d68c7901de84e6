"""One parameter's sharded training state, whole: its fp32 master weights, Adam moments and reduced gradient
assembled from every rank's shard, and written back into them, under DeepSpeed's names
(``deepspeed.utils.safe_get_full_grad`` and its siblings), so code that logs per-layer gradient norms, edits
optimizer state or inspects the master weights keeps working after the switch.

Note [Full parameter state]
---------------------------
A trainable parameter's elements are spread over the ranks' optimizer shards (``ShardPiece``: which elements
of which shard hold which elements of the parameter). A ``safe_get_full_*`` call copies this rank's pieces
into a zeroed fp32 tensor of the parameter's size and all-reduces it as int32: every element comes from
exactly one rank and is zero on the others, so the integer sum is that rank's bit pattern (-0.0 and NaN
payloads included), on every rank. A ``safe_set_full_*`` call writes each rank's own pieces of the value (every
rank passes the same value); setting the fp32 weights also gives the parameter itself their rounding, as the
step would (stages 1-2 hold it whole on every rank, stage 3 in its shard and in the gathered unit), without
counting as the user's write (Note [Writes to parameters] in _step.py), and its autograd version moves, so a
graph recorded before raises instead of pairing old activations with new weights.

Each call is a collective: every rank calls it for the same parameter in the same order. A fixed-size tag
exchange comes first (the function, the parameter, and whether this rank can go on), so ranks that asked for
different parameters, or a rank that refused the call (a wrong shape, a call out of place), make every rank
raise instead of pairing mismatched all-reduces.

What is read: the fp32 master and moments as the optimizer holds them (in memory, on the host, or read from
the NVMe state file, only the sub-groups that hold the parameter); a write to a parameter since the last step reaches its master at the next step, so
read the parameter itself for its current value. The gradient is the one the next ``step()`` applies, before
clipping, unscaled from fp16's loss scale and averaged over the ranks and the accumulation window: it exists
between the boundary's ``engine.backward()`` and ``engine.step()`` only (mid-window a rank holds partial or
local sums, and after the step none), and a call elsewhere raises. A frozen parameter has no master, moments
or gradient: the getters return None for it, as DeepSpeed's do.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._gathered import engine_for
from ._lifecycle import EngineState

if TYPE_CHECKING:
    from ._optimizer_state import Shard
    from ._sharded_buffer import ShardedBuffer
    from .engine import Engine

_OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq")
# what each call is, by its position here, in the tag every rank compares
_CALLS = ("safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
          "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_set_full_grad")
_TAG_FIELDS = 4  # per rank: call, optimizer key, parameter ordinal (-1: frozen), refused
# per engine, each trainable parameter's (buffer, index in it, ordinal); per buffer, each parameter's pieces
_PLACES: weakref.WeakKeyDictionary[Any, dict[int, tuple[Any, int, int]]] = weakref.WeakKeyDictionary()
_PIECES: weakref.WeakKeyDictionary[Any, dict[str, list[tuple[Any, int, int, int]]]] = weakref.WeakKeyDictionary()


@dataclass
class _Located:
    engine: Engine
    buffer: ShardedBuffer | None  # None: a frozen parameter (no optimizer state)
    index: int  # in ``buffer.params``
    ordinal: int  # among the engine's trainable parameters (-1 when frozen)


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The parameter's fp32 master weights, whole, on every rank (a collective; Note [Full parameter state]).
    None for a frozen parameter."""
    return _get(param, "master", _CALLS[0])


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Sets the parameter's fp32 master weights to ``value`` (the same on every rank; a collective), and the
    parameter to their rounding in the compute dtype."""
    _set(param, value, "master", _CALLS[1])


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """Adam's ``"exp_avg"`` or ``"exp_avg_sq"`` of the parameter, whole, fp32, on every rank (a collective).
    None for a frozen parameter."""
    return _get(param, _optimizer_key(optim_state_key), _CALLS[2])


def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Sets Adam's ``"exp_avg"`` or ``"exp_avg_sq"`` of the parameter to ``value`` (the same on every rank;
    a collective)."""
    _set(param, value, _optimizer_key(optim_state_key), _CALLS[3])


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient the next ``engine.step()`` applies to the parameter (averaged over ranks and the
    accumulation window, unscaled, before clipping), whole, fp32, on every rank (a collective): between the
    accumulation boundary's ``engine.backward()`` and ``engine.step()``. None for a frozen parameter."""
    return _get(param, "grad", _CALLS[4])


def safe_set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Sets the gradient the next ``engine.step()`` applies to the parameter (the same ``value`` on every
    rank; a collective), between the accumulation boundary's ``engine.backward()`` and ``engine.step()``.
    It is stored in the gradients' dtype; the step clips and applies it as one the backward produced."""
    _set(param, value, "grad", _CALLS[5])


def safe_update_full_grad_vectorized(param_list: Iterable[nn.Parameter],
                                     update_func: Callable[[torch.Tensor, nn.Parameter], torch.Tensor]) -> None:
    """Replaces the gradient of every trainable parameter in ``param_list`` by ``update_func(grad, param)``
    (``grad`` as ``safe_get_full_grad`` gives it; the result of the parameter's shape), as DeepSpeed's function of
    that name: a collective per parameter, so every rank passes the same parameters in the same order and an
    ``update_func`` that computes the same values on every rank. Frozen parameters are skipped."""
    for param in param_list:
        if isinstance(param, torch.Tensor) and not param.requires_grad:
            continue
        grad = safe_get_full_grad(param)
        if grad is not None:
            safe_set_full_grad(param, update_func(grad, param))


# ---- internals ----------------------------------------------------------------------------------------

def _optimizer_key(key: Any) -> str:
    if key not in _OPTIMIZER_KEYS:
        raise ValueError(f"optim_state_key must be one of {list(_OPTIMIZER_KEYS)} (Adam's moments), got {key!r}")
    return key


def _locate(param: Any, call: str) -> _Located:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"{call}() takes a parameter of a model given to zerocore.initialize(), "
                        f"got {type(param).__name__}")
    engine = engine_for(param)
    if engine is None:
        raise ValueError(f"{call}() got a parameter that no live zerocore engine manages (shape "
                         f"{list(param.shape)}); pass a parameter of a model given to zerocore.initialize() "
                         "before engine.close()")
    places = _PLACES.get(engine)
    if places is None:  # built once per engine: a loop over a model's parameters stays linear
        places, ordinal = {}, 0
        for buffer in engine.buffers:
            for index, held in enumerate(buffer.params):
                places[id(held)] = (buffer, index, ordinal + index)
            ordinal += len(buffer.params)
        _PLACES[engine] = places
    buffer, index, ordinal = places.get(id(param), (None, -1, -1))
    if buffer is not None and buffer.params[index] is not param:  # (ids are checked: a reused id is not it)
        buffer, index, ordinal = None, -1, -1
    return _Located(engine, buffer, index, ordinal)


def _refusal(located: _Located, key: str, call: str, writes: bool) -> str | None:
    """Why this rank cannot take part in ``call`` now (None: it can)."""
    engine = located.engine
    state = engine.lifecycle.state
    if state in (EngineState.BACKWARD, EngineState.CLOSED):
        return f"{call}() is not allowed while the engine is {state.value!r}"
    if key == "grad":
        outside = outside_grad_window(engine, "the reduced gradient exists")
        if outside is not None:
            return f"{call}(): {outside}"
    elif writes and (state is EngineState.FORWARD or engine.lifecycle.forward_pending):
        return (f"{call}() between a forward and its backward would pair the forward's activations with other "
                "weights; call it before the forward or after engine.backward()")
    if writes and engine.user_gathers:
        return (f"{call}() inside a zerocore.gathered() block: leaving the block restores or overwrites the "
                "parameters it holds; call it outside the block")
    if writes and key == "master" and located.buffer is not None:
        buffer = located.buffer
        if buffer.gathered and located.index in buffer.rebound_params():
            return (f"{call}(): parameter {buffer.names[located.index]!r} was given another tensor (p.data = ...), "
                    "which the next step takes as the user's values; point it back at its own storage first")
    if writes and located.buffer is None:
        return (f"{call}(): the parameter is frozen, so it has no fp32 master, moments or gradient; change its "
                "values inside `with zerocore.gathered(params, modifier_rank=0):`")
    return None


def outside_grad_window(engine: Engine, subject: str) -> str | None:
    """Why the reduced gradients cannot be read or changed now, as a sentence beginning with ``subject`` (what
    exists only in the window); None between the accumulation boundary's ``backward()`` and ``step()``."""
    state = engine.lifecycle.state
    if state is EngineState.AWAITING_STEP and engine._backward_boundary:
        return None
    return (f"{subject} only between the accumulation boundary's engine.backward() and engine.step() (the engine "
            f"is {state.value!r}{'' if state is not EngineState.AWAITING_STEP else ', mid-window'}): mid-window a "
            "rank holds partial or local sums, and step() consumes them. Call it after the backward for which "
            "engine.is_gradient_accumulation_boundary() was True")


def _agree(located: _Located, call: str, key: str, refused: str | None) -> None:
    """The tag exchange (Note [Full parameter state]): raises on every rank when the ranks asked for
    different things or one refused."""
    engine = located.engine
    world, rank = engine.world_size, engine.rank
    tag = torch.zeros(_TAG_FIELDS * world, dtype=torch.int64, device=engine.device)
    key_code = ("master", "grad", *_OPTIMIZER_KEYS).index(key)
    mine = [_CALLS.index(call), key_code, located.ordinal, int(refused is not None)]
    tag[_TAG_FIELDS * rank : _TAG_FIELDS * (rank + 1)] = torch.tensor(mine, dtype=torch.int64)
    engine.comm.all_reduce(tag).wait()
    rows = tag.view(world, _TAG_FIELDS).tolist()
    if refused is not None:
        raise RuntimeError(f"{refused}; nothing was changed on any rank")
    refusing = [r for r, row in enumerate(rows) if row[3]]
    if refusing:
        raise RuntimeError(f"{call}() was refused on rank(s) {refusing} (their error says why); nothing was "
                           "changed on any rank")
    if any(row[:3] != rows[0][:3] for row in rows):
        def describe(row: list[int]) -> str:
            return f"{_CALLS[row[0]]}({_describe_ordinal(engine, row[2])})"
        calls = "; ".join(f"rank {r}: {describe(row)}" for r, row in enumerate(rows))
        raise RuntimeError(f"ranks called different per-parameter collectives ({calls}): every rank must call "
                           "them for the same parameters in the same order; nothing was changed on any rank")


def _describe_ordinal(engine: Engine, ordinal: int) -> str:
    if ordinal < 0:
        return "a frozen parameter"
    for buffer in engine.buffers:
        if ordinal < len(buffer.params):
            return repr(buffer.names[ordinal])
        ordinal -= len(buffer.params)
    return f"parameter #{ordinal}"


def _own_pieces(located: _Located) -> list[tuple[Shard, int, int, int]]:
    """(shard, start in the shard, start in the flattened parameter, length) of this rank's pieces."""
    buffer = located.buffer
    assert buffer is not None
    pieces = _PIECES.get(buffer)
    if pieces is None:  # built once per buffer (its layout is fixed at initialize)
        pieces = {}
        for shard in buffer.optimizer_shards:
            for piece in shard.pieces:
                pieces.setdefault(piece.name, []).append((shard, piece.shard_offset, piece.tensor_offset, piece.length))
        _PIECES[buffer] = pieces
    return pieces.get(buffer.names[located.index], [])


def _get(param: nn.Parameter, key: str, call: str) -> torch.Tensor | None:
    located = _locate(param, call)
    refused = _refusal(located, key, call, writes=False)
    _agree(located, call, key, refused)
    if located.buffer is None:
        return None
    engine = located.engine
    out = torch.zeros(param.numel(), dtype=torch.float32, device=engine.device)
    read_own(located, key, out, 0)
    engine.comm.all_reduce(out.view(torch.int32)).wait()  # one rank holds each element: the sum is its bits
    return out.view(param.shape)


def read_own(located: _Located, key: str, out: torch.Tensor, base: int) -> None:
    """Copies this rank's pieces of ``key`` (the gradient, unscaled; the master or a moment) into ``out``, element
    ``i`` of the flattened parameter at ``out[i - base]``."""
    engine, buffer = located.engine, located.buffer
    assert buffer is not None
    if key == "grad":
        buffer.settle_grads()  # (the boundary's backward left none stale; kept for the rule's sake)
        unscale = 1.0 / engine.loss_scaler.scale if engine.config.fp16.enabled else 1.0
        unscale *= engine.optimizer_state.grad_coefficient  # a clip by hand (Note [Clipping by hand])
        for shard, start, at, length in _own_pieces(located):
            out[at - base : at - base + length] = shard.grads[start : start + length].float() * unscale
    else:
        state = engine.optimizer_state
        for shard, start, at, length in _own_pieces(located):
            with state.resident_range(shard, start, start + length) as values:
                out[at - base : at - base + length] = values[key]


def _set(param: nn.Parameter, value: Any, key: str, call: str) -> None:
    located = _locate(param, call)
    refused = _refusal(located, key, call, writes=True)
    if refused is None:
        refused = _value_problem(param, value, call)
    _agree(located, call, key, refused)
    _write(located, key, value)


def write_full_state(param: nn.Parameter, values: dict[str, torch.Tensor]) -> None:
    """Writes whole values of a trainable parameter's ``"master"``, ``"exp_avg"`` or ``"exp_avg_sq"`` into this
    rank's pieces, as the setters do but with no tag exchange: for a caller whose ranks agreed already (a
    checkpoint load, every rank writing every parameter in the same order)."""
    located = _locate(param, "write_full_state")
    assert located.buffer is not None, "a trainable parameter"
    for key, value in values.items():
        _write(located, key, value)


def _write(located: _Located, key: str, value: torch.Tensor) -> None:
    """Writes ``value`` (the parameter's shape) into this rank's pieces of ``key``: the gradient, the master
    (and the parameter's rounding) or a moment."""
    flat = value.detach().reshape(-1).to(device=located.engine.device, dtype=torch.float32)
    with torch.no_grad():
        if key == "master":
            _set_master(located, flat)
        else:
            write_own(located, key, flat, 0)


def write_own(located: _Located, key: str, flat: torch.Tensor, base: int) -> None:
    """Writes ``flat`` (element ``i`` of the flattened parameter at ``flat[i - base]``) into this rank's pieces
    of ``key``: the gradient (scaled as the gradients are held), a moment, or the master and the parameter
    shard's rounding. Nothing else: the whole parameter a rank may hold is the caller's."""
    engine, buffer = located.engine, located.buffer
    assert buffer is not None
    if key == "grad":
        buffer.settle_grads()
        engine.optimizer_state.apply_grad_coefficient()  # the value written is the gradient as given
        scale = engine.loss_scaler.scale if engine.config.fp16.enabled else 1.0  # the gradients are held scaled
        for shard, start, at, length in _own_pieces(located):
            shard.grads[start : start + length] = flat[at - base : at - base + length] * scale
        engine.gradients.mark_got_grad(buffer, located.index)  # else a parameter without one would sit the step out
        return
    state = engine.optimizer_state
    for shard, start, at, length in _own_pieces(located):
        piece = flat[at - base : at - base + length]
        if key == "master":
            write_master_range(state, shard, start, piece)
        else:
            with state.resident_range(shard, start, start + length, write=True) as values:
                values[key].copy_(piece)


def write_master_range(state: Any, shard: Shard, start: int, values: torch.Tensor) -> None:
    """Elements ``[start, start + len(values))`` of ``shard``'s fp32 master, and of its parameter shard (what a
    later gather sends) their rounding, as the step leaves them."""
    with state.resident_range(shard, start, start + values.numel(), write=True) as held:
        held["master"].copy_(values)
        if shard.separate_master:  # (in fp32 training the master is the parameter shard itself)
            with shard.params_loaded(write=True):
                shard.params[start : start + values.numel()] = values


def _value_problem(param: nn.Parameter, value: Any, call: str) -> str | None:
    if not isinstance(value, torch.Tensor):
        return f"{call}(): value must be a tensor, got {type(value).__name__}"
    if value.shape != param.shape:
        return f"{call}(): value has shape {list(value.shape)}, the parameter {list(param.shape)}"
    if not value.is_floating_point():
        return f"{call}(): value must be a floating-point tensor, got {value.dtype}"
    return None


def _set_master(located: _Located, flat: torch.Tensor) -> None:
    engine, buffer = located.engine, located.buffer
    assert buffer is not None
    engine.land_param_gathers()  # a gather in flight would land the old values over the new ones
    write_own(located, "master", flat, 0)
    param = buffer.params[located.index]
    if buffer.gathered:  # the whole parameter too: every rank writes it alike (stages 1-2, a gathered unit)
        buffer.views[located.index].copy_(flat.view(param.shape))
    if engine.stage3 is not None:
        engine.stage3.forget_partition_slices()  # hpZ's slices hold the old values
    # a graph recorded with the old values raises in its backward, and the write is the engine's, not the user's
    torch.autograd.graph.increment_version([param])
    buffer.renote_param_version(located.index)
