"""Sharded checkpoints: ``engine.save_checkpoint`` / ``engine.load_checkpoint``, safetensors and JSON only.

Note [Checkpoint format]
------------------------
A checkpoint is a directory ``save_dir/<tag>`` (``tag`` defaults to ``global_step<N>``) holding

* ``rank<r>.safetensors`` per rank: for every optimizer shard ``i`` of that rank (Note [Optimizer state
  ownership]) the flat fp32 ``i.master``, ``i.exp_avg`` and ``i.exp_avg_sq``, plus the rank's RNG states;
* ``model.safetensors`` (rank 0): what the optimizer does not own: buffers and frozen parameters, by name
  (Note [Sharded frozen parameters in checkpoints] in _checkpoint_untracked.py);
* ``index.json`` (rank 0, written last inside the directory): zerocore's version, world size, stage, the
  trainable parameters' names and shapes, for every rank and shard the *pieces* (which elements of which
  parameter each shard range holds), step counters, the loss scaler's and the lr scheduler's state, the
  param groups' hyper-parameters and the names of their parameters, the per-parameter idle step counts
  (Note [Parameters without gradients]), ``client_state``, for every file its size and a CRC-32C per 8 MiB
  block (Note [Block checksums] in _safetensors_io.py), and a CRC-32 of the index itself (a flipped digit in a
  piece's offset would otherwise load wrong values that every file checksum still passes).

Nothing is pickled, so loading an untrusted checkpoint cannot run code. The compute-dtype parameters are
not stored: they are the master's rounding (the fused Adam writes them so), recomputed at load.

Atomic: every rank writes into ``save_dir/.<tag>.tmp``, files are fsynced, rank 0 writes the index,
renames the directory to ``<tag>`` and only then replaces ``latest`` (written to a temporary file, fsynced
and renamed), so a process killed at any moment leaves the previous checkpoint loadable and named by
``latest``. A save that fails on one rank (a full disk, a path that cannot be made) does not leave the others
waiting in the next collective: after each step that can fail, every rank learns whether any failed, and all
raise alike, the temporary directory removed (``_agreed``).

Reshard at load: a rank loading at any world size and stage walks its own shards' pieces and copies each
from the saved pieces that cover the same parameter elements, reading only those byte ranges (safetensors
blocks around them through the C++ I/O engine, each block checked). A shard laid out exactly like a saved
one (the same world size and stage) reads each state as one range, padding included. Everything is read and
validated (index, files, checksums, names and shapes) on every rank before any rank changes its engine.
The stages 1-2 parameter all-gathers that follow a load are left in flight, as after ``step()``.

This module moves state between an engine and a checkpoint (``save_checkpoint``, ``load_checkpoint``);
_checkpoint_format.py reads and writes the directory itself, and _checkpoint_cli.py is
``python -m zerocore.checkpoint`` (``info``, ``to-hf``, ``to-dcp``, ``to-deepspeed``) and :func:`to_hf`, :func:`to_dcp`,
:func:`to_deepspeed`, importable from here.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import _json_state as json_state
from . import _safetensors_io as stio
from ._checkpoint_cli import main, to_dcp, to_deepspeed, to_hf  # noqa: F401  (zerocore.checkpoint.to_*, the CLI)
from ._checkpoint_format import (CHECKPOINT_IO, FORMAT, check_tag, covering, fsync_dir, fsync_file, index_bytes,
                                 index_identity,
                                 open_file, piece_sources, read_index, resolve_tag, tag_path, write_durably)
from ._checkpoint_match import (agree_on_reading, check_model, check_param_groups, check_untracked, global_steps,
                                group_names, optimizer_steps, persistent_names, trainable_shapes)
from ._checkpoint_untracked import load_untracked, read_untracked, untracked_state, write_untracked
from ._dcp_checkpoint import dcp_directories
from ._deferred_signals import deferred_interrupts
from ._model_checks import all_gather_json
from ._names import named_buffers, tied_aliases
from .lr_schedules import apply_current_values
from .optimizer import group_for_saving, set_group_value

if TYPE_CHECKING:
    from .engine import Engine

_STATES = ("master", "exp_avg", "exp_avg_sq")


def save_checkpoint(engine: Engine, save_dir: str | os.PathLike[str], tag: str | None = None,
                    client_state: Mapping[str, Any] | None = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> str:
    """See :meth:`Engine.save_checkpoint`."""
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"  # DeepSpeed's str(tag) too
    problem: str | None = None
    client: dict[str, Any] = {}
    scheduler: Any = None
    # every rank reads what the untracked model state holds (buffers are broadcast like DDP's; frozen
    # parameters are replicated, or sharded at stage 3 and gathered as rank 0 writes them), rank 0 writes it
    untracked = untracked_state(engine, frozen=not exclude_frozen_parameters)
    try:
        check_tag(tag)
        if client_state is not None and not isinstance(client_state, Mapping):
            raise TypeError(f"save_checkpoint(client_state=...) must be a dict, not {type(client_state).__name__}")
        client = json_state.encode(dict(client_state or {}), "save_checkpoint(client_state=...)")
        if engine.lr_scheduler is not None:
            scheduler = json_state.encode(engine.lr_scheduler.state_dict(), "engine.lr_scheduler.state_dict()")
        for name, value in untracked.items():
            if not stio.writable(value.dtype):
                raise TypeError(f"buffer or frozen parameter {name!r} is {value.dtype}, which safetensors cannot "
                                "store")
    except (ValueError, TypeError) as error:
        problem = str(error)
    # every rank learns every rank's tag and argument check before any rank writes or raises, so a rank that
    # raises never leaves the others waiting in the save's collectives
    verdicts = all_gather_json(engine.comm, [tag, problem], engine.device)
    if problem is not None:
        raise ValueError(problem)
    failed = [(rank, message) for rank, (_, message) in enumerate(verdicts) if message is not None]
    if failed:
        raise ValueError(f"save_checkpoint: rank {failed[0][0]} refused its arguments ({failed[0][1]}); nothing "
                         "was written")
    if len({t for t, _ in verdicts}) > 1:  # each rank would write into another directory: no complete checkpoint
        raise ValueError(f"save_checkpoint: the ranks passed different tags ({_by_rank([t for t, _ in verdicts])}); "
                         "a checkpoint is one directory that every rank writes its part of: pass the same tag on "
                         "every rank (nothing was written)")
    engine.absorb_param_writes()
    save_dir = os.fspath(save_dir)
    tmp = os.path.join(save_dir, f".{tag}.tmp")
    with _agreed(engine, "create the checkpoint directory", tmp):
        if engine.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)

    state = engine.optimizer_state
    entries: list[tuple[str, list[int], torch.dtype]] = []
    ranks_pieces = []
    for shard in state.shards:
        ranks_pieces.append({"numel": shard.numel, "pieces": [
            [p.name, p.tensor_offset, p.shard_offset, p.length] for p in shard.pieces]})
    # The file holds each state's shards one after the other, as the flat state does, so a load at the same
    # world size reads each state as one range in phase with where it lands; state read back from NVMe is
    # written a shard at a time instead, so that each shard is read once.
    numbered = list(enumerate(state.shards))
    if state.store is None:
        entries += [(f"{i}.{name}", [shard.numel], torch.float32) for name in _STATES for i, shard in numbered]
    else:
        entries += [(f"{i}.{name}", [shard.numel], torch.float32) for i, shard in numbered for name in _STATES]
    rng = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and engine.device.type == "cuda":
        rng["rng.cuda"] = torch.cuda.get_rng_state(engine.device)
    entries += [(name, list(t.shape), t.dtype) for name, t in rng.items()]
    current: dict[str, Any] = {}

    def tensor(name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        if name in rng:
            return rng[name]
        index, key = name.split(".")
        if current.get("index") != index:  # one shard's state at a time (read back from NVMe if it lives there)
            current.clear()
            shard = state.shards[int(index)]
            with state.resident(shard) as values:
                current.update(values, index=index)
                if shard.param_home is not None:  # an fp32 master on NVMe is the parameter shard: it leaves RAM
                    current["master"] = values["master"].detach().float().cpu().clone()
        return current[key].detach().float().cpu()

    rank_file = f"rank{engine.rank}.safetensors"
    try:
        checksums = stio.write(os.path.join(tmp, rank_file), entries, tensor)
        mine = {"file": rank_file, "checksums": checksums, "shards": ranks_pieces,
                "python_rng": _json_rng(random.getstate())}
    except Exception as error:  # noqa: BLE001 - every rank learns it from the exchange below (_fail_together)
        mine = {"error": f"{type(error).__name__}: {error}"}
        failure: Exception | None = error
    else:
        failure = None
    current.clear()
    everyone = all_gather_json(engine.comm, mine, engine.device)
    _fail_together(engine, [entry.get("error") for entry in everyone], failure, "write its file", tmp)
    shapes = trainable_shapes(engine)
    persistent = persistent_names(engine)
    with _agreed(engine, "write the model file and the index", tmp):
        # a collective where stage 3 shards frozen parameters (Note [Sharded frozen parameters in checkpoints])
        model_checksums = write_untracked(engine, os.path.join(tmp, "model.safetensors") if engine.rank == 0
                                          else None, untracked)
        if engine.rank == 0:
            _write_index(engine, tmp, model_checksums, untracked, shapes, persistent, everyone, client, scheduler,
                         exclude_frozen_parameters)
        fsync_file(os.path.join(tmp, rank_file))  # every rank's file is durable before the rename
    final = os.path.join(save_dir, tag)
    with _agreed(engine, "move the checkpoint into place", tmp):
        if engine.rank == 0:
            fsync_dir(tmp)
            old = os.path.join(save_dir, f".{tag}.old")
            if os.path.exists(final):  # re-saving a tag: the old copy goes only once the new one is complete
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(tmp, final)
            fsync_dir(save_dir)
            if save_latest:
                write_durably(os.path.join(save_dir, "latest"), tag.encode())
            shutil.rmtree(old, ignore_errors=True)
    return final


@contextlib.contextmanager
def _agreed(engine: Engine, what: str, tmp: str) -> Iterator[None]:
    """Runs the block on every rank, then every rank learns whether it raised anywhere and all raise alike
    (the partial checkpoint under ``tmp`` removed), so none is left waiting in a collective for a rank that
    failed (Note [Checkpoint format]). Any exception, not only an OSError: rank 0 alone writes the index, and
    a ValueError there must not leave the other ranks in the next collective until the timeout."""
    failure: Exception | None = None
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised below, on this rank and (named) on the others
        failure = error
    verdicts = all_gather_json(engine.comm, None if failure is None else f"{type(failure).__name__}: {failure}",
                               engine.device)
    _fail_together(engine, verdicts, failure, what, tmp)


def _fail_together(engine: Engine, verdicts: list[str | None], failure: Exception | None, what: str,
                   tmp: str) -> None:
    """Given every rank's error message (None: it succeeded), raises on every rank if any failed: the failing
    rank its own error, the others one naming it; the partial checkpoint under ``tmp`` is removed."""
    failed = [(rank, message) for rank, message in enumerate(verdicts) if message is not None]
    if not failed:
        return
    if engine.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if failure is not None:
        raise failure
    raise OSError(f"save_checkpoint: rank {failed[0][0]} could not {what} ({failed[0][1]}); the checkpoint was not "
                  f"saved and 'latest' still names the previous one")


def _write_index(engine: Engine, tmp: str, model_checksums: Any, untracked: dict[str, torch.Tensor],
                 shapes: Mapping[str, Any], persistent: set[str], everyone: list[Any], client: Any, scheduler: Any,
                 frozen_excluded: bool) -> None:
    """Rank 0: the JSON index naming every rank's file and the model file (buffers, frozen parameters)."""
    buffers = {name for name, _ in named_buffers(engine.module, remove_duplicate=False)}
    index = {
        "format": FORMAT,
        "zerocore_version": _version(),
        "world_size": engine.world_size,
        "stage": engine.stage,
        "compute_dtype": str(engine.compute_dtype).removeprefix("torch."),
        "params": {name: list(shape) for name, shape in shapes.items()},
        # "buffer": a buffer, not a frozen parameter (exports tell them apart without the model: to-deepspeed)
        "untracked": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch."),
                          "persistent": k in persistent, "buffer": k in buffers} for k, v in untracked.items()},
        "model_file": {"file": "model.safetensors", "checksums": model_checksums},
        "frozen_excluded": frozen_excluded,  # a load keeps the model's own frozen parameters
        "tied": tied_aliases(engine.module),  # the names a tied parameter also has (exports write them: to-dcp)
        "ranks": everyone,
        "counters": {"global_steps": engine.global_steps, "global_steps_count_skipped": True,
                     "optimizer_steps": engine.optimizer_state.step_count, "skipped_steps": engine.skipped_steps,
                     "micro_steps": engine.micro_steps, "global_samples": engine.global_samples,
                     # per parameter: the applied steps it got no gradient for (its own step count lags)
                     "idle_steps": dict(sorted(engine.optimizer_state.idle_steps.items()))},
        "loss_scaler": engine.loss_scaler.state_dict(),
        "param_groups": [group_for_saving(g, i) for i, g in enumerate(engine.optimizer.param_groups)],
        "param_group_names": group_names(engine),  # which parameters each group holds, checked at load
        "lr_scheduler": scheduler,  # both through _json_state: a Counter of milestones stays one
        "client_state": client,
    }
    write_durably(os.path.join(tmp, "index.json"), index_bytes(index))


def load_checkpoint(engine: Engine, load_dir: str | os.PathLike[str], tag: str | None = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> tuple[str | None, dict[str, Any]]:
    """See :meth:`Engine.load_checkpoint`."""
    try:
        deepspeed_dir = _deepspeed_checkpoint_dir(os.fspath(load_dir), tag, engine.config.load_universal)
    except (OSError, ValueError) as error:  # (no latest_universal here): the one verdict exchange the DeepSpeed
        agree_on_reading(engine, error, "the checkpoint")  # reader's ranks issue, so they all raise together
    if deepspeed_dir is not None:  # Note [DeepSpeed checkpoints]
        from ._deepspeed_checkpoint import load as load_deepspeed

        return deepspeed_dir, load_deepspeed(engine, deepspeed_dir, load_optimizer_states, load_lr_scheduler_states,
                                             load_module_only)
    dcp_path = os.path.join(os.fspath(load_dir), str(tag)) if tag is not None else os.fspath(load_dir)
    dcp_dirs = dcp_directories(dcp_path)
    if dcp_dirs is not None:  # Note [DCP checkpoints]
        from ._dcp_checkpoint import load as load_dcp

        return dcp_path, load_dcp(engine, dcp_path, dcp_dirs, load_optimizer_states, load_lr_scheduler_states,
                                  load_module_only)
    problem: BaseException | None = None
    staged: _Staged | None = None
    try:
        staged = _read_validated(engine, os.fspath(load_dir), tag, load_optimizer_states and not load_module_only)
    except (OSError, ValueError) as error:
        problem = error
    # every rank learns whether every rank read and validated everything, so all go on or all raise (none is
    # left in a collective) and no rank changes its engine unless every rank can
    # and that every rank read the same checkpoint: shards of different ones would mix two trainings silently
    verdicts = all_gather_json(engine.comm, [
        None if problem is None else f"{type(problem).__name__}: {problem}",
        None if staged is None else [staged.path, index_identity(staged.index)]], engine.device)
    if problem is not None:
        raise problem
    failed = [(rank, message) for rank, (message, _) in enumerate(verdicts) if message is not None]
    if failed:
        rank, message = failed[0]
        raise ValueError(f"load_checkpoint: rank {rank} refused the checkpoint ({message}); nothing was changed")
    if len({identity for _, (_, identity) in verdicts}) > 1:
        raise ValueError("load_checkpoint: the ranks read different checkpoints ("
                         + _by_rank([f"{path} (index crc32 {identity})" for _, (path, identity) in verdicts])
                         + "): pass the same tag on every rank, and give every rank the same checkpoint; "
                         "nothing was changed")
    assert staged is not None
    index = staged.index
    # everything is read and checked on every rank: from here on the engine changes, and an interrupt waits until
    # it has changed whole (Note [Interrupts deferred in an update] in _deferred_signals.py)
    with deferred_interrupts("the checkpoint load"):
        _apply_staged(engine, staged, load_optimizer_states, load_lr_scheduler_states, load_module_only)
    # no barrier: every rank read everything before the verdicts, and a barrier here would wait for the
    # parameter all-gathers that reload_params_from_shards leaves in flight for the next forward to overlap
    return staged.path, json_state.decode(index["client_state"])


def _deepspeed_checkpoint_dir(directory: str, tag: str | None, universal: bool) -> str | None:
    """The checkpoint's directory when it is DeepSpeed's (its ZeRO optimizer files, no zerocore index);
    ``universal`` (the config's ``checkpoint.load_universal``): without a tag, the one ``latest_universal``
    names, as DeepSpeed resolves it."""
    from ._deepspeed_checkpoint import is_deepspeed_checkpoint

    if tag is None and is_deepspeed_checkpoint(directory):  # the tag's directory itself (a universal one, say)
        return directory
    if tag is None and universal:  # raises when the pointer is missing, as DeepSpeed's load would
        return tag_path(directory, resolve_tag(directory, None, "latest_universal"))
    try:
        path = tag_path(directory, resolve_tag(directory, tag))
    except (OSError, ValueError):
        return None  # (the zerocore path names what is wrong)
    return path if is_deepspeed_checkpoint(path) else None


def _apply_staged(engine: Engine, staged: _Staged, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                  load_module_only: bool) -> None:
    """Puts what ``load_checkpoint`` read and checked into the engine (see its arguments)."""
    index = staged.index
    with torch.no_grad():
        state = engine.optimizer_state
        if staged.fresh:
            state.adopt({key: value.view(torch.float32) for key, value in staged.fresh.items()})
        for shard in state.shards:
            with state.resident(shard, write=True) as values:
                for key, at, source in staged.copies.get(shard.index, ()):
                    values[key][at : at + source.numel()].copy_(source)
                if not load_optimizer_states and not load_module_only:  # a fresh optimizer: zero moments
                    values["exp_avg"].zero_()
                    values["exp_avg_sq"].zero_()
                if shard.separate_master:  # the compute-dtype values are the master's rounding
                    shard.params.copy_(values["master"])
        load_untracked(engine, staged.untracked, staged.untracked_values, staged.frozen_shards)
    engine.reload_params_from_shards()
    if load_module_only:  # DeepSpeed's: the weights change, the training state (moments, counters, ...) stays
        return
    counters = index["counters"]
    # DeepSpeed's: the step counts continue; a fresh optimizer's own count (Adam's t) starts over
    engine.restore_counters(global_steps(counters), optimizer_steps(counters) if load_optimizer_states else 0,
                            counters["skipped_steps"], counters["micro_steps"],
                            counters.get("idle_steps", {}) if load_optimizer_states else {},
                            counters.get("global_samples"))
    if load_optimizer_states:
        # Only a dynamic fp16 scale resumes, and only from fp16 training: a bf16 or fp32 engine's scale is 1
        # (given an fp16 checkpoint's 32768, every gradient would be 32768x too large: norms, clipping and Adam's
        # eps all wrong), and a static scale is the config's.
        if engine.loss_scaler.dynamic and index["compute_dtype"] == "float16":
            engine.loss_scaler.load_state_dict(index["loss_scaler"])
        for group, saved in zip(engine.optimizer.param_groups, index["param_groups"]):
            for key, value in saved.items():
                set_group_value(group, key, value)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and index["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(json_state.decode(index["lr_scheduler"]))
        if not load_optimizer_states:  # the fresh groups hold the schedule's first values, not its current ones
            apply_current_values(engine.lr_scheduler)
    if staged.rng is not None:  # RNG streams continue (another world size has other streams)
        torch.set_rng_state(staged.rng["rng.cpu"])
        if engine.device.type == "cuda" and "rng.cuda" in staged.rng:
            torch.cuda.set_rng_state(staged.rng["rng.cuda"], engine.device)
        random.setstate(_python_rng(index["ranks"][engine.rank]["python_rng"]))


class _Staged:
    """Everything a load changes, read and checked, not yet applied: ``copies`` maps a shard's index to
    (state name, element offset, checked fp32 values from the files); with the files' bytes held once, the
    extra host memory is this rank's share of the checkpoint plus the blocks around it (Note [Block
    checksums])."""

    def __init__(self, path: str, index: dict[str, Any]) -> None:
        self.path = path
        self.index = index
        self.copies: dict[int, list[tuple[str, int, torch.Tensor]]] = {}
        self.fresh: dict[str, torch.Tensor] = {}  # flat states to adopt whole (bytes; see _fresh_state)
        self.untracked: dict[str, torch.Tensor] = {}
        self.untracked_values: dict[str, torch.Tensor] = {}  # whole buffers and unsharded frozen parameters
        self.frozen_shards: dict[int, torch.Tensor] = {}  # this rank's shard of each sharded frozen buffer
        self.rng: dict[str, torch.Tensor] | None = None


def _read_validated(engine: Engine, load_dir: str, tag: str | None, load_optimizer_states: bool) -> _Staged:
    """Reads and checks the index, the model's names and shapes and every byte this rank needs; changes
    nothing and issues no collective."""
    tag = resolve_tag(load_dir, None if tag is None else str(tag))
    path = tag_path(load_dir, tag)
    index = read_index(path)
    check_model(engine, index)
    if load_optimizer_states:
        check_param_groups(engine, index)
    staged = _Staged(path, index)
    sources = piece_sources(index)
    states = _STATES if load_optimizer_states else _STATES[:1]
    # per saved file, the (shard, state, element offset, saved tensor, saved offset, length) this rank takes
    wanted: dict[int, list[tuple[int, str, int, str, int, int]]] = {}
    for shard in engine.optimizer_state.shards:
        covers = [(piece, cover) for piece in shard.pieces
                  for cover in covering(sources, piece.name, piece.tensor_offset, piece.length)]
        whole = _same_shard_saved(index, shard, [cover for _, cover in covers])
        if whole is not None:  # one range a state, padding included, instead of one a parameter
            rank, saved_shard = whole
            for state in states:
                wanted.setdefault(rank, []).append((shard.index, state, 0, f"{saved_shard}.{state}", 0,
                                                    shard.numel))
            continue
        for piece, (lo, hi, rank, saved_shard, saved_offset) in covers:
            at = piece.shard_offset + (lo - piece.tensor_offset)
            for state in states:
                wanted.setdefault(rank, []).append((shard.index, state, at, f"{saved_shard}.{state}",
                                                    saved_offset, hi - lo))
    same_world = index["world_size"] == engine.world_size
    if same_world:
        wanted.setdefault(engine.rank, [])  # its RNG states
    io = stio.open_io(CHECKPOINT_IO)
    files: dict[int, stio.VerifiedFile] = {}
    try:
        ranges: dict[int, list[tuple[int, int]]] = {}
        for rank in sorted(wanted):
            f = files[rank] = open_file(io, path, index["ranks"][rank])
            ranges[rank] = []
            for _, _, _, name, offset, length in wanted[rank]:
                start, dtype, shape = f.tensor_range(name)
                if dtype != torch.float32 or len(shape) != 1 or offset + length > shape[0]:
                    raise ValueError(f"checkpoint file {f.path}: tensor {name!r} ({dtype}, {shape}) does not hold "
                                     f"the elements [{offset}, {offset + length}) its index.json entry promises")
                ranges[rank].append((start + 4 * offset, 4 * length))
        staged.fresh = _fresh_state(engine.optimizer_state, states, wanted, ranges)
        for rank in sorted(wanted):
            into: list[torch.Tensor | None] = []
            kept_apart: list[int] = []
            for i, ((shard_index, state, at, *_), (start, nbytes)) in enumerate(zip(wanted[rank], ranges[rank])):
                shard = engine.optimizer_state.shards[shard_index]
                if state in staged.fresh and state in shard.flat_offsets:
                    at_byte = 4 * (shard.flat_offsets[state] + at)
                    into.append(staged.fresh[state][at_byte : at_byte + nbytes])
                else:  # kept apart and copied in once every rank has validated
                    into.append(None)
                    kept_apart.append(i)
            for i, buffer in _staging(ranges[rank], kept_apart):
                into[i] = buffer
                shard_index, state, at, *_ = wanted[rank][i]
                staged.copies.setdefault(shard_index, []).append((state, at, buffer.view(torch.float32)))
            files[rank].read(ranges[rank], into=into)
            if same_world and rank == engine.rank:
                staged.rng = {name: files[rank].tensor(name).clone() for name in ("rng.cpu", "rng.cuda")
                              if name in files[rank].header}
        model = files[-1] = open_file(io, path, index["model_file"])
        staged.untracked = check_untracked(untracked_state(engine, frozen=not index.get("frozen_excluded", False)),
                                           index, model, path, persistent_names(engine))
        staged.untracked_values, staged.frozen_shards = read_untracked(engine, model, staged.untracked)
    finally:
        for f in files.values():
            f.close()
    return staged


def _staging(ranges: Sequence[tuple[int, int]], which: Sequence[int]) -> Iterator[tuple[int, torch.Tensor]]:
    """A buffer for each of ``ranges[i]``, ``i`` in ``which``: one aligned allocation per run of ranges that
    follow each other in the file, each range a slice of it, so the reader reads such a run as one range."""
    order = sorted(which, key=lambda i: ranges[i][0])
    while order:
        run = [order.pop(0)]
        while order and ranges[order[0]][0] == sum(ranges[run[-1]]):
            run.append(order.pop(0))
        first = ranges[run[0]][0]
        buffer = stio.aligned_empty(sum(ranges[run[-1]]) - first, skew=first)
        for i in run:
            start, nbytes = ranges[i]
            yield i, buffer[start - first : start - first + nbytes]


def _same_shard_saved(index: Mapping[str, Any], shard: Any, covers: Sequence[tuple[int, int, int, int, int]]
                      ) -> tuple[int, int] | None:
    """``(rank, saved shard)`` when every element of ``shard`` comes from one saved shard laid out exactly
    like it (same size, same pieces at the same offsets: a load at the world size and stage of the save), so
    its states can be read whole; None otherwise."""
    sources = {(rank, saved_shard) for _, _, rank, saved_shard, _ in covers}
    if len(sources) != 1:
        return None
    rank, saved_shard = next(iter(sources))
    saved = index["ranks"][rank]["shards"][saved_shard]
    mine = [[p.name, p.tensor_offset, p.shard_offset, p.length] for p in shard.pieces]
    return (rank, saved_shard) if saved["numel"] == shard.numel and saved["pieces"] == mine else None


def _fresh_state(state: Any, keys: Sequence[str], wanted: Mapping[int, list[tuple[int, str, int, str, int, int]]],
                 ranges: Mapping[int, list[tuple[int, int]]]) -> dict[str, torch.Tensor]:
    """Where the optimizer state can be replaced wholesale (``OptimizerState.replaceable``), fresh flat
    tensors (as bytes) for the states being loaded, for the files' bytes to land in directly; adopted once
    every rank has validated, so a load copies nothing. Each is placed so that its largest incoming range
    sits at its file offset modulo 4 KiB (read with O_DIRECT); padding between pieces is zeroed."""
    if not state.replaceable():
        return {}
    fresh: dict[str, torch.Tensor] = {}
    for key in keys:
        flat = state.flat(key)
        if not flat.numel():
            continue
        best, skew = -1, 0
        for rank, entries in wanted.items():
            for (shard_index, name, at, *_), (start, nbytes) in zip(entries, ranges[rank]):
                offsets = state.shards[shard_index].flat_offsets
                if name == key and key in offsets and nbytes > best:
                    best, skew = nbytes, (start - 4 * (offsets[key] + at)) % stio.ALIGN // 4 * 4
        fresh[key] = stio.aligned_empty(4 * flat.numel(), skew=skew)
        values = fresh[key].view(torch.float32)
        for shard in state.shards:
            if key not in shard.flat_offsets:
                continue
            base, covered = shard.flat_offsets[key], 0
            for piece in sorted(shard.pieces, key=lambda p: p.shard_offset):
                values[base + covered : base + piece.shard_offset].zero_()
                covered = piece.shard_offset + piece.length
            values[base + covered : base + shard.numel].zero_()
    return fresh


def _by_rank(values: Sequence[Any]) -> str:
    return ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))


def _json_rng(state: Any) -> Any:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_rng(saved: Any) -> Any:
    version, internal, gauss = saved
    return (version, tuple(internal), gauss)


def _version() -> str:
    from . import __version__

    return __version__


if __name__ == "__main__":
    sys.exit(main())
