"""This rank's part of one parameter's sharded training state, under DeepSpeed's names
(``deepspeed.utils.safe_get_local_grad`` and its siblings): per-parameter reads and writes with no
communication, for code that sums gradient norms over its own shards and all-reduces once, or checks that a
parameter's master moved.

Note [Local parameter state]
----------------------------
The elements of a trainable parameter that this rank's optimizer shards hold (Note [Full parameter state])
form one range of its flattened elements (``local_range``): every element belongs to exactly one rank, so the
ranks' local tensors tile the parameter (a sum of their squared norms is the parameter's), and a rank may
hold none (an empty tensor). DeepSpeed's stage 3 gives each rank ``ceil(numel / ranks)`` elements padded with
zeros; zerocore's ranges follow its own layout and carry no padding, at every stage. A local call is not a
collective: each rank may call it for any parameters, in any order, or not at all.

The getters return fp32 copies: the master and moments as the optimizer holds them (read from NVMe where
they live there), the gradient unscaled and averaged as ``safe_get_full_grad`` gives it, between the
accumulation boundary's ``engine.backward()`` and ``engine.step()``; a frozen parameter gives None. The
setters write this rank's range: moments and the gradient at any stage (the next ``step()`` uses them); the
fp32 master at stage 3 only (as DeepSpeed), where the parameter's shard takes its rounding: a unit gathered
after the call computes with the new values, and one already whole (the root and other persistent units,
kept gathered between forward and step) with the old ones until the step, on every rank alike; the step's
update starts from the new master either way. (Its shard then differs from the gathered copy on purpose,
which the step must not take for a write through ``.data``: ``shard_ahead_of_full``.) At stages 1-2 every rank holds the parameter whole and its own range of it is the shard the
step starts from, so a local write would leave the ranks' copies different until the next step:
``safe_set_full_fp32_param`` (a collective) writes the whole parameter instead.
"""

from __future__ import annotations

import torch
from torch import nn

from ._full_param_state import _CALLS, _Located, _locate, _optimizer_key, _own_pieces, _refusal, read_own, write_own

_LOCAL_CALLS = tuple(name.replace("_full_", "_local_") for name in _CALLS)


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's range of the parameter's fp32 master weights, flattened (Note [Local parameter state]):
    no communication. None for a frozen parameter."""
    return _get(param, "master", _LOCAL_CALLS[0])


def safe_set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Sets this rank's range of the parameter's fp32 master weights (stage 3; ``value`` has
    ``local_range``'s length): no communication."""
    _set(param, value, "master", _LOCAL_CALLS[1])


def safe_get_local_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's range of Adam's ``"exp_avg"`` or ``"exp_avg_sq"`` for the parameter, fp32, flattened: no
    communication. None for a frozen parameter."""
    return _get(param, _optimizer_key(optim_state_key), _LOCAL_CALLS[2])


def safe_set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Sets this rank's range of Adam's ``"exp_avg"`` or ``"exp_avg_sq"`` for the parameter: no communication."""
    _set(param, value, _optimizer_key(optim_state_key), _LOCAL_CALLS[3])


def safe_get_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's range of the gradient the next ``engine.step()`` applies (unscaled, averaged, before
    clipping), fp32, flattened, between the accumulation boundary's ``engine.backward()`` and ``engine.step()``:
    no communication. None for a frozen parameter."""
    return _get(param, "grad", _LOCAL_CALLS[4])


def safe_set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Sets this rank's range of the gradient the next ``engine.step()`` applies (between the accumulation
    boundary's ``engine.backward()`` and ``engine.step()``): no communication."""
    _set(param, value, "grad", _LOCAL_CALLS[5])


def local_range(param: nn.Parameter) -> tuple[int, int] | None:
    """``(start, stop)``: the elements of the flattened parameter that this rank's local tensors hold
    (``start == stop`` when it holds none). None for a frozen parameter."""
    located = _locate(param, "local_range")
    return None if located.buffer is None else _range(located)


# ---- internals ----------------------------------------------------------------------------------------

def _range(located: _Located) -> tuple[int, int]:
    pieces = sorted(_own_pieces(located), key=lambda piece: piece[2])
    if not pieces:
        return (0, 0)
    start, stop = pieces[0][2], pieces[-1][2] + pieces[-1][3]
    # a rank's shards are consecutive ranges of one flat layout, so its pieces of a parameter meet
    assert sum(piece[3] for piece in pieces) == stop - start, "a rank's pieces of a parameter are one range"
    return (start, stop)


def _get(param: nn.Parameter, key: str, call: str) -> torch.Tensor | None:
    located = _locate(param, call)
    refused = _refusal(located, key, call, writes=False)
    if refused is not None:
        raise RuntimeError(refused)
    if located.buffer is None:
        return None
    start, stop = _range(located)
    out = torch.empty(stop - start, dtype=torch.float32, device=located.engine.device)
    read_own(located, key, out, start)
    return out


def _set(param: nn.Parameter, value: object, key: str, call: str) -> None:
    located = _locate(param, call)
    refused = _refusal(located, key, call, writes=True)
    if refused is None and key == "master":
        refused = _master_refusal(located, call)
    if refused is None:
        refused = _value_problem(located, value, call)
    if refused is not None:
        raise RuntimeError(f"{refused}; nothing was changed")
    assert isinstance(value, torch.Tensor) and located.buffer is not None
    engine, buffer = located.engine, located.buffer
    start, _ = _range(located)
    flat = value.detach().reshape(-1).to(device=engine.device, dtype=torch.float32)
    with torch.no_grad():
        if key == "master":
            engine.land_param_gathers()  # a gather in flight reads the shard this writes
        write_own(located, key, flat, start)
        if key == "master" and buffer.gathered:
            buffer.shard_ahead_of_full = True


def _master_refusal(located: _Located, call: str) -> str | None:
    engine = located.engine
    buffer = located.buffer
    assert buffer is not None
    if engine.stage3 is None:
        return (f"{call}() is for stage 3, where each rank holds only its shard of the parameter (as in DeepSpeed): "
                "at stages 1-2 every rank holds it whole, and a write to one rank's range would leave the ranks' "
                "copies different until the next step. Use safe_set_full_fp32_param() (a collective) instead")
    unit = engine.stage3.unit_of_buffer(buffer)
    if unit.secondary is not None:  # hpZ's slices of the old values, for a backward still to come
        return (f"{call}(): unit {unit.name!r} holds hpZ slices of its forward's values for a backward still to "
                "come; call it after engine.backward()")
    return None


def _value_problem(located: _Located, value: object, call: str) -> str | None:
    if not isinstance(value, torch.Tensor):
        return f"{call}(): value must be a tensor, got {type(value).__name__}"
    if not value.is_floating_point():
        return f"{call}(): value must be a floating-point tensor, got {value.dtype}"
    start, stop = _range(located)
    if value.numel() != stop - start:
        return (f"{call}(): value has {value.numel()} elements, this rank holds {stop - start} of the parameter "
                f"(elements [{start}, {stop}) of the flattened parameter: zerocore.local_range(param))")
    return None
