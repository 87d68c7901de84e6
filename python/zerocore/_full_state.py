"""Whole parameters outside training: the full state dict and ``zerocore.gathered``'s gather and write-back,
for every stage (stage 3 gathers unit by unit; stages 1-2 hold whole parameters already)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .engine import Engine


def full_state_dict(engine: Engine, dtype: torch.dtype | None, rank0_only: bool) -> dict[str, torch.Tensor]:
    """See :meth:`Engine.full_state_dict`; the engine has waited for its pending gathers."""
    keep = not rank0_only or engine.rank == 0
    stage3 = engine.stage3
    if stage3 is not None:
        stage3.reading_state = True  # the units are gathered one at a time below
    try:
        entries = engine.module.state_dict(keep_vars=True)
    finally:
        if stage3 is not None:
            stage3.reading_state = False
    out: dict[str, torch.Tensor] = {}

    def take(name: str, tensor: torch.Tensor) -> None:
        value = tensor.detach()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        out[name] = value.to("cpu", copy=True)

    names_of: dict[int, list[str]] = {}
    for name, tensor in entries.items():
        names_of.setdefault(id(tensor), []).append(name)
    sharded: set[int] = set()
    if stage3 is not None:
        for unit in stage3.units:
            stage3.ensure_gathered(unit, "all_gather_state_dict")
            for param in unit.params:
                sharded.add(id(param))
                if keep:
                    for name in names_of.get(id(param), []):
                        take(name, param)
            if not unit.persistent:
                stage3.release(unit)
    if keep:
        for name, tensor in entries.items():
            if id(tensor) not in sharded:
                take(name, tensor)
    return {name: out[name] for name in entries if name in out}


def gather_for_user(engine: Engine, params: list[nn.Parameter]) -> None:
    if engine.stage3 is not None:
        for unit in engine.stage3.units_of(params):
            engine.stage3.ensure_gathered(unit, "all_gather_user")


def release_for_user(engine: Engine, params: list[nn.Parameter], modifier_rank: int | None) -> None:
    stage3 = engine.stage3
    if stage3 is not None:
        for unit in stage3.units_of(params):
            if modifier_rank is not None:
                engine.comm.broadcast(unit.full, modifier_rank).wait()
                stage3.write_back(unit)
            if not unit.persistent:
                stage3.release(unit)
        return
    if modifier_rank is not None:
        wanted = {id(p) for p in params}
        for buffer in engine.buffers:
            if any(id(p) in wanted for p in buffer.params):
                engine.comm.broadcast(buffer.full, modifier_rank).wait()
                buffer.take_shard_from_full()
