"""Whole parameters outside training: the full state dict, save_16bit_model's file and ``zerocore.gathered``'s
gather and write-back, for every stage (stage 3 gathers unit by unit; stages 1-2 hold whole parameters already)."""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from ._buffer_sync import broadcast_tensors
from ._model_checks import failing_together
from ._names import canonical, named_parameters

if TYPE_CHECKING:
    from ._sharded_buffer import ShardedBuffer
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
        for unit in stage3.gathered_in_turn(stage3.units):
            for param in unit.all_params:
                sharded.add(id(param))
                if keep:
                    for name in names_of.get(id(param), []):
                        take(name, param)
    if keep:
        for name, tensor in entries.items():
            if id(tensor) not in sharded:
                take(name, tensor)
    return {name: out[name] for name in entries if name in out}


def gather_for_user(engine: Engine, params: list[nn.Parameter]) -> None:
    """Entering ``zerocore.gathered``: a gather that raises part-way (an unreadable NVMe parameter shard)
    lets go of the units held so far, so no later step is refused for a block that never began."""
    stage3, held = engine.stage3, []
    try:
        for buffer in _buffers_of(engine, params):
            if stage3 is not None:
                stage3.hold(stage3.unit_of_buffer(buffer))
            held.append(buffer)
            buffer.keep_own_values()
    except BaseException:
        for buffer in held:
            buffer.forget_own_values()
            if stage3 is not None:
                stage3.unhold(stage3.unit_of_buffer(buffer))
        raise


def _buffers_of(engine: Engine, params: list[nn.Parameter]) -> list[ShardedBuffer]:
    wanted = {id(p) for p in params}
    return [buffer for buffer in engine.param_storages if any(id(p) in wanted for p in buffer.params)]


def release_for_user(engine: Engine, params: list[nn.Parameter], modifier_rank: int | None) -> None:
    """With ``modifier_rank``, that rank's values reach every rank's shard and fp32 master (and the frozen
    parameters every rank holds whole, stages 1-2). Without it,
    changes made inside the block are discarded on every rank, also where the parameters stay whole
    afterwards (stages 1-2, stage-3 units kept gathered): whether any rank wrote is agreed by one tiny
    all-reduce (so every rank issues the same collectives), and then the whole values come back from the
    shards. A parameter given a tensor of another shape on the modifier rank is refused on every rank, with
    the block's writes discarded everywhere."""
    stage3 = engine.stage3
    buffers = _buffers_of(engine, params)
    try:
        if modifier_rank is not None:
            # a tensor of another shape given on the modifier rank (p.data = t) is refused on every rank before
            # anything is sent, and every rank drops the block's writes: the modifier alone raising would leave
            # the others waiting in the broadcasts below
            refused: RuntimeError | None = None
            if engine.rank == modifier_rank:
                try:
                    for buffer in buffers:
                        buffer.check_rebound_shapes()
                except RuntimeError as error:
                    refused = error
            flag = torch.tensor([float(refused is not None)], dtype=torch.float64)
            engine.comm.all_reduce(flag, False).wait()
            if flag.item() > 0:
                _discard_writes(engine, buffers, written=True)
                for buffer in buffers:  # (released below: a parameter given other storage is the engine's again)
                    buffer.reattach_rebound(keep_values=False)
                if refused is None:
                    refused = RuntimeError(
                        f"zerocore.gathered(..., modifier_rank={modifier_rank}): rank {modifier_rank} gave a parameter "
                        "a tensor of another shape inside the block (p.data = ...; its error names it)")
                refused.add_note("zerocore: the block's writes were discarded on every rank")
                raise refused
            broadcast_tensors(engine.comm, [p for p in params if id(p) in engine.whole_frozen_ids], modifier_rank)
            for buffer in buffers:
                if engine.rank == modifier_rank:
                    buffer.reattach_rebound()  # ``p.data = t`` inside the block: t's values are broadcast
                engine.comm.broadcast(buffer.full, modifier_rank).wait()
                buffer.take_shard_from_full()
                buffer.mark_rewritten()  # a graph recorded with the values before the block is stale
        else:
            _discard_writes(engine, buffers, written=None)
    finally:
        for buffer in buffers:
            buffer.forget_own_values()
            if stage3 is not None:
                stage3.unhold(stage3.unit_of_buffer(buffer))


def _discard_writes(engine: Engine, buffers: list[ShardedBuffer], written: bool | None) -> None:
    """Undoes the block's writes on every rank (a collective): only parameters that stay whole need it (stages
    1-2, stage-3 units kept gathered), and which ones do is the same on every rank. ``written`` None: whether
    any rank wrote is agreed first, by one tiny all-reduce."""
    stage3 = engine.stage3
    stay = [b for b in buffers if stage3 is None or stage3.unit_of_buffer(b).persistent]
    if stay and written is None:
        flag = torch.tensor([float(any(buffer.params_written() for buffer in stay))], dtype=torch.float64)
        engine.comm.all_reduce(flag, False).wait()
        written = flag.item() > 0
    if written:
        for buffer in stay:
            buffer.discard_param_writes(engine.comm)
            buffer.mark_rewritten()


def save_16bit_model(engine: Engine, save_dir: str | os.PathLike[str], save_filename: str,
                     exclude_frozen_parameters: bool = False) -> str | Literal[False]:
    """Engine.save_16bit_model: the full state dict in the compute dtype, one safetensors file on rank 0
    (tied parameters once, under their first name); a collective. False, with nothing written, where the config
    asks stage 3 not to gather the weights for it (as DeepSpeed returns)."""
    if not engine.zero_gather_16bit_weights_on_model_save():
        # (the same config on every rank, checked at initialize: every rank returns here, no collective issued)
        warnings.warn(f"save_16bit_model() wrote nothing to {os.fspath(save_dir)!r}: the config's "
                      "zero_optimization.stage3_gather_16bit_weights_on_model_save is false, so stage 3 does not "
                      "gather the whole weights for it (as DeepSpeed). save_checkpoint() keeps them sharded ("
                      "python -m zerocore.checkpoint to-hf then writes them whole), or set it true", RuntimeWarning,
                      stacklevel=3)
        return False
    state = engine.full_state_dict(engine.compute_dtype)
    path = os.path.join(os.fspath(save_dir), save_filename)
    # every rank learns whether rank 0's write failed (a bad directory, a full disk) and all raise alike; the
    # exchange is also the barrier that has every rank return once the file is there
    with failing_together(engine.comm, engine.device, lambda rank, message: OSError(
            f"save_16bit_model: rank {rank} could not write {path!r} ({message}); nothing was saved")):
        if engine.rank == 0:
            _write_16bit_file(engine, state, save_dir, path, exclude_frozen_parameters)
    return path


def _write_16bit_file(engine: Engine, state: dict[str, torch.Tensor], save_dir: str | os.PathLike[str], path: str,
                      exclude_frozen_parameters: bool) -> None:
    from ._checkpoint_format import write_file_durably
    from ._safetensors_io import write_tensors

    first = {name for name, _ in named_parameters(engine.module)}  # a tied parameter's first name
    left_out = {name for name, _ in named_parameters(engine.module, remove_duplicate=False)} - first  # tied
    if exclude_frozen_parameters:
        left_out |= {name for name, p in named_parameters(engine.module, remove_duplicate=False)
                     if not p.requires_grad}
    # named as the unwrapped model names them (Note [Names without wrappers]): loadable into its class
    kept = {canonical(k): v.contiguous() for k, v in state.items() if canonical(k) not in left_out}
    os.makedirs(os.fspath(save_dir), exist_ok=True)
    if path.endswith(".safetensors"):
        write_tensors(path, kept)
    else:  # DeepSpeed's default name, pytorch_model.bin: a torch.save file, which is what loaders expect there
        write_file_durably(path, lambda f: torch.save(kept, f))  # durable and whole, as write_tensors' file
