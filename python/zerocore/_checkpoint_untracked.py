"""What a checkpoint's ``model.safetensors`` holds: the model state the optimizer does not own (buffers,
frozen parameters), by state-dict name, written by rank 0 and read back by every rank.

Note [Sharded frozen parameters in checkpoints]
-----------------------------------------------
Stage 3 shards frozen parameters (Note [Frozen shards] in _sharded_buffer.py), and the model file holds
them whole, by name, as a plain model would (``to-hf`` and a load at any world size or stage read them by
name). No rank ever holds all of them whole: a save gathers their units one at a time on every rank (a
collective, in unit order), and rank 0 streams each unit's parameters into the file while the unit is
gathered (the file's header is known from the shapes alone); a load reads on each rank only the byte
ranges its shard covers (one per parameter, Note [Block checksums]) into the shard. So a LoRA model's frozen
base costs one unit of memory to save and its shard to load, not the whole base per rank. A rank 0 whose
write fails still issues every remaining gather, so its peers finish theirs before all learn of the failure.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from . import _safetensors_io as stio
from ._names import named_buffers, named_parameters

if TYPE_CHECKING:
    from ._sharded_buffer import ShardedBuffer
    from ._stage3_unit import Unit
    from .engine import Engine


def untracked_state(engine: Engine, frozen: bool = True) -> dict[str, torch.Tensor]:
    """Buffers and (with ``frozen``) frozen parameters by state-dict name (each tensor once). A frozen
    parameter stage 3 shards is the parameter itself (its shape is right, its values are not here:
    ``write_untracked`` and ``read_untracked`` move them)."""
    trainable = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    sharded = {id(p) for storage in engine.frozen_buffers for p in storage.params}
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, param in named_parameters(engine.module):
        if id(param) not in trainable and id(param) not in seen:
            seen.add(id(param))
            if frozen:
                out[name] = param if id(param) in sharded else param.data
    for name, buffer in named_buffers(engine.module):
        if id(buffer) not in seen:
            seen.add(id(buffer))
            out[name] = buffer
    return out


def _sharded_storages(engine: Engine, untracked: Mapping[str, torch.Tensor]) -> list[ShardedBuffer]:
    """The frozen buffers whose parameters ``untracked`` holds (all of them, or none when frozen parameters
    are excluded)."""
    held = {id(t) for t in untracked.values()}
    return [storage for storage in engine.frozen_buffers if all(id(p) in held for p in storage.params)]


def write_untracked(engine: Engine, path: str | None, untracked: Mapping[str, torch.Tensor]) -> dict[str, Any] | None:
    """Writes ``untracked`` whole as the model file at ``path`` (the writing rank; None elsewhere) and returns
    its checksums. A collective on every rank where stage 3 shards frozen parameters: Note [Sharded frozen
    parameters in checkpoints]."""
    stage3 = engine.stage3
    name_of = {id(t): name for name, t in untracked.items()}
    held = {id(p) for storage in _sharded_storages(engine, untracked) for p in storage.params}
    units: list[Unit] = [] if stage3 is None else [
        unit for unit in stage3.units if any(id(p) in held for storage in unit.frozen for p in storage.params)]
    unit_of = {name_of[id(p)]: unit for unit in units for storage in unit.frozen for p in storage.params
               if id(p) in held}
    # the whole tensors first, then the sharded ones unit by unit, in the order every rank gathers them
    names = [name for name in untracked if name not in unit_of] + list(unit_of)
    gathered: Iterator[Unit] = stage3.gathered_in_turn(units) if units else iter(())
    current: Unit | None = None

    def tensor(name: str, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        nonlocal current
        unit = unit_of.get(name)
        while unit is not None and current is not unit:
            current = next(gathered)  # (the previous unit is released)
        return untracked[name].detach()

    try:
        if path is None:
            return None
        return stio.write(path, [(name, list(untracked[name].shape), untracked[name].dtype) for name in names],
                          tensor)
    finally:
        for _ in gathered:  # the gathers still due: all of them on a rank that writes nothing
            pass


def read_untracked(engine: Engine, model_file: stio.VerifiedFile, untracked: Mapping[str, torch.Tensor]
                   ) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """From the checked model file: the whole values of ``untracked``'s buffers and unsharded frozen
    parameters by name, and this rank's shard of each sharded frozen buffer by the buffer's id, read as
    the byte ranges the shard covers (Note [Sharded frozen parameters in checkpoints]). Changes nothing."""
    name_of = {id(t): name for name, t in untracked.items()}
    storages = _sharded_storages(engine, untracked)
    shards = {id(storage): _read_shard(storage, [name_of[id(p)] for p in storage.params], model_file)
              for storage in storages}
    sharded = {id(p) for storage in storages for p in storage.params}
    whole = {name: model_file.tensor(name) for name, t in untracked.items() if id(t) not in sharded}
    return whole, shards


def _read_shard(storage: ShardedBuffer, names: list[str], model_file: stio.VerifiedFile) -> torch.Tensor:
    """This rank's shard of ``storage`` (padding zero) in its dtype, from the saved whole parameters ``names``
    (in the storage's order), whatever dtype they were saved in."""
    ranges, places = [], []
    for b in range(len(storage.buckets)):
        for piece in storage.layout.pieces(storage.rank, b):
            start, dtype, _ = model_file.tensor_range(names[piece.tensor])
            size = dtype.itemsize
            ranges.append((start + piece.tensor_offset * size, piece.length * size))
            places.append((piece.shard_offset, piece.length, dtype))
    shard = torch.zeros(sum(b.shard_size for b in storage.buckets), dtype=storage.dtype)
    for data, (at, length, dtype) in zip(model_file.read(ranges), places):
        shard[at : at + length] = stio.as_elements(data, dtype)
    return shard


def load_untracked(engine: Engine, untracked: Mapping[str, torch.Tensor], whole: Mapping[str, torch.Tensor],
                   shards: Mapping[int, torch.Tensor]) -> None:
    """Every tensor of ``untracked`` takes its value: a buffer or unsharded frozen parameter from ``whole``
    in place, a sharded frozen buffer its shard from ``shards`` (its unit is released by the load's
    ``reload_params_from_shards``)."""
    for storage in engine.frozen_buffers:
        if id(storage) in shards:
            storage.set_shard(shards[id(storage)])
    for name, value in whole.items():
        untracked[name].copy_(value)
