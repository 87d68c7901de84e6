"""torch.distributed.checkpoint (DCP) directories, as FSDP2, torchtitan and Accelerate save them, loaded by
``engine.load_checkpoint``: a run moves from FSDP to zerocore mid-training with its weights, AdamW moments,
step counts and buffers, at any world size and stage.

Note [DCP checkpoints]
----------------------
A DCP checkpoint is a directory with a ``.metadata`` file (every saved entry: a tensor's global shape, dtype
and chunks, or a pickled object) and the ranks' ``.distcp`` files. Entries are keyed by their path in the
state dict that was saved, which differs by framework: torch's recipe saves ``{"model": ..., "optim": ...}``
from ``get_state_dict(model, optimizer)`` (the optimizer nested: ``state/<fqn>/exp_avg``,
``param_groups/<i>/lr`` with ``params`` naming the parameters), torchtitan saves the model's keys at the top
level and the optimizer flattened under ``optimizer`` (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``),
with ``lr_scheduler`` and ``train_state`` beside them, and Accelerate writes the model and the optimizer to two
DCP directories (``pytorch_model_fsdp_0/``, ``optimizer_0/``) in one checkpoint folder. So the reader goes by
structure, not by names: an optimizer is where ``param_groups`` entries are; the model is the one container
whose tensors cover every trainable parameter of this engine's model by name (without wrapper segments, Note
[Names without wrappers]); everything else that is not a tensor (a train state, a scheduler's state, a data
loader's position) comes back as the client state.

FSDP2 keeps fp32 parameters (a ``MixedPrecisionPolicy`` computes in bf16 from them), so the model's values are
the fp32 masters; AdamW's ``exp_avg`` and ``exp_avg_sq`` are the moments and its per-parameter ``step`` the
bias-correction count: the engine's optimizer step is the largest, and a parameter whose step is smaller (or
that has no state: it never got a gradient) counts the difference as steps it got no gradient for, as
zerocore's own idle-step count does (torch's AdamW does not advance a parameter without a gradient either).
Any other optimizer state (SGD's momentum, AMSGrad's ``max_exp_avg_sq``) is refused by name: zerocore's
optimizer is Adam/AdamW, and moments of another rule would train on silently wrong. The param groups'
hyperparameters (lr, betas, eps, weight_decay) are taken per engine param group from the checkpoint's groups
of its parameters; a group whose parameters had different ones is refused, naming them. An engine LR
scheduler from the config is stepped to the loaded step count, as a run that trained those steps would
have stepped it (FSDP's own scheduler object is the script's, not in the engine).

Every rank reads the metadata and checks it against the model (names, shapes, frozen or not, the files'
sizes against the byte ranges the metadata names, so a truncated file is found before anything changes);
the ranks agree on the verdict, then each reads only the rows of each trainable tensor (value and moments)
that hold its own elements, as DCP reads a DTensor's local chunk, about 256 MiB per ``dcp.load`` with no
collective in DCP (``no_dist``), and writes its pieces; frozen parameters are read whole on rank 0 and reach
the others as a ``gathered(modifier_rank=0)`` write does, and buffers whole on every rank. Objects in the checkpoint are
unpickled, as DCP's own load does: load checkpoints you trust.
"""

from __future__ import annotations

import functools
import math
import os
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ._checkpoint_match import agree_on_reading, group_names, trainable_params
from ._deferred_signals import deferred_interrupts
from ._full_param_state import _locate, write_own
from ._local_param_state import local_range
from ._names import canonical, named_buffers, named_parameters
from ._user_frames import user_stacklevel
from .optimizer import ADAM_HYPERPARAMETERS, set_group_value

if TYPE_CHECKING:
    from .engine import Engine

_METADATA = ".metadata"
_MOMENTS = ("exp_avg", "exp_avg_sq")
_ADAM_STATE = frozenset({*_MOMENTS, "step"})
_FLAT_STATE = re.compile(r"^state\.(.+)\.([A-Za-z_]\w*)$")  # torchtitan: state.<fqn>.<field>
_FLAT_GROUP = re.compile(r"^param_groups\.(.+)\.([A-Za-z_]\w*)$")  # torchtitan: param_groups.<fqn>.<field>
Path = tuple[Any, ...]


def dcp_directories(path: str) -> list[str] | None:
    """The DCP directories of a checkpoint: ``path`` itself when it holds DCP's ``.metadata``, else its
    subdirectories that do (Accelerate's ``pytorch_model_fsdp_0/`` and ``optimizer_0/``); None for neither."""
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, _METADATA)):
        return [path]
    found = sorted(os.path.join(path, name) for name in os.listdir(path)
                   if os.path.isfile(os.path.join(path, name, _METADATA)))
    return found or None


@dataclass(frozen=True)
class _Entry:
    directory: str
    key: str  # the metadata's flattened key
    shape: torch.Size | None  # None: a pickled object
    dtype: torch.dtype | None
    metadata: Any = field(compare=False, repr=False, default=None)  # its directory's, read once


@dataclass
class _Checkpoint:
    path: str
    model: dict[str, _Entry]  # name -> the model's tensor (parameters and buffers)
    has_optimizer: bool = False
    state: dict[str, dict[str, _Entry]] = field(default_factory=lambda: defaultdict(dict))  # name -> field -> entry
    hyper: dict[str, dict[str, _Entry]] = field(default_factory=lambda: defaultdict(dict))  # name -> hyperparameter
    client: dict[Path, _Entry] = field(default_factory=dict)  # objects outside the model and the optimizer
    indexed_state: bool = False  # optimizer state keyed by parameter index (optimizer.state_dict() saved as is)


def _read_metadata(directory: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(directory).read_metadata()
    except Exception as error:  # noqa: BLE001 - a torn or foreign .metadata: named with its path
        raise ValueError(f"load_checkpoint: cannot read the DCP metadata {os.path.join(directory, _METADATA)}: "
                         f"{type(error).__name__}: {error}") from None


def _check_files(directory: str, metadata: Any) -> None:
    """Every byte range the metadata names lies inside its file: a rank's missing or truncated ``.distcp``
    file is found here, before anything changes, instead of part-way through the load."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = os.path.join(directory, name)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None or size < end:
            raise ValueError(f"load_checkpoint: the DCP file {file} is "
                             f"{'missing' if size is None else f'{size} bytes, its entries end at byte {end}'} "
                             "(a save that did not finish, or a partial copy); nothing was changed")


def _optimizer_root(path: Path) -> Path | None:
    """Where an optimizer state dict sits, if ``path`` is one of its ``param_groups`` entries."""
    for i, part in enumerate(path):
        if part == "param_groups" and i + 1 < len(path):
            return path[:i]
    if path and isinstance(path[-1], str) and _FLAT_GROUP.match(path[-1]):
        return path[:-1]
    return None


def read(path: str, directories: list[str], trainable: set[str]) -> _Checkpoint:
    """Reads and sorts the entries of a DCP checkpoint (Note [DCP checkpoints]); nothing is loaded yet."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries: list[tuple[Path, _Entry]] = []
    for directory in directories:
        metadata = _read_metadata(directory)
        _check_files(directory, metadata)
        planner = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        for key, meta in metadata.state_dict_metadata.items():
            tensor = isinstance(meta, TensorStorageMetadata)
            where = tuple(planner.get(key, (key,)))
            entries.append((where, _Entry(directory, key, meta.size if tensor else None,
                                          meta.properties.dtype if tensor else None, metadata)))
    holders = sorted({entry.directory for where, entry in entries if _optimizer_root(where) is not None})
    if len(holders) > 1:  # a folder of checkpoints (torchtitan's step-N), not one split in two (Accelerate's)
        names = ", ".join(os.path.relpath(d, path) for d in holders)
        raise ValueError(f"load_checkpoint: {path} holds several DCP checkpoints with optimizer state ({names}): "
                         "pass tag= to load one of them; nothing was changed")
    optimizers = {root for where, _ in entries if (root := _optimizer_root(where)) is not None}
    if len(optimizers) > 1:
        raise ValueError(f"load_checkpoint: the DCP checkpoint {path} holds {len(optimizers)} optimizers (under "
                         f"{sorted('/'.join(map(str, r)) or '<top>' for r in optimizers)}): zerocore loads one; "
                         "nothing was changed")
    optimizer = next(iter(optimizers), None)
    models: dict[Path, dict[str, _Entry]] = defaultdict(dict)
    client: dict[Path, _Entry] = {}
    nested_groups: dict[Any, dict[str, _Entry]] = defaultdict(dict)
    state: dict[str, dict[str, _Entry]] = defaultdict(dict)
    flat_hyper: dict[str, dict[str, _Entry]] = defaultdict(dict)
    for where, entry in entries:
        if optimizer is not None and where[:len(optimizer)] == optimizer and len(where) > len(optimizer):
            rest = where[len(optimizer):]
            if rest[0] == "state" and len(rest) == 3:
                state[canonical(str(rest[1]))][str(rest[2])] = entry
            elif rest[0] == "param_groups" and len(rest) == 3:
                nested_groups[rest[1]][str(rest[2])] = entry
            elif len(rest) == 1 and (match := _FLAT_STATE.match(str(rest[0]))):
                state[canonical(match.group(1))][match.group(2)] = entry
            elif len(rest) == 1 and (match := _FLAT_GROUP.match(str(rest[0]))):
                flat_hyper[canonical(match.group(1))][match.group(2)] = entry
            else:
                raise ValueError(f"load_checkpoint: the DCP checkpoint {path} has an optimizer entry this version "
                                 f"does not read ({entry.key!r}); nothing was changed")
        elif entry.shape is not None and where:
            models[where[:-1]][canonical(str(where[-1]))] = entry
        else:
            client[where] = entry
    for root, names in models.items():  # ddp.state_dict() saved as it is: DDP's wrapper names every tensor
        if not trainable <= names.keys() and names and all(name.startswith("module.") for name in names):
            models[root] = {name.removeprefix("module."): entry for name, entry in names.items()}
    covering = [root for root, names in models.items() if trainable <= names.keys()]
    if len(covering) != 1:
        if covering:
            raise ValueError(f"load_checkpoint: the DCP checkpoint {path} holds several models with the trainable "
                             f"parameters' names (under {sorted('/'.join(map(str, r)) or '<top>' for r in covering)}"
                             "); nothing was changed")
        best = max(models.items(), key=lambda item: len(trainable & item[1].keys()), default=((), {}))
        missing = sorted(trainable - best[1].keys())
        raise ValueError(f"load_checkpoint: the DCP checkpoint {path} does not hold the model's trainable "
                         f"parameters (missing: {missing[:5]}{' ...' if len(missing) > 5 else ''}); nothing was "
                         "changed")
    root = covering[0]
    for other, names in models.items():  # tensors beside the model and the optimizer (another model, an EMA)
        if other != root:
            warnings.warn(f"load_checkpoint: the DCP checkpoint {path} also holds tensors under "
                          f"{'/'.join(map(str, other)) or '<top>'} ({len(names)}), which are not loaded",
                          RuntimeWarning, stacklevel=user_stacklevel())
    checkpoint = _Checkpoint(path, models[root], optimizer is not None, state, client=client)
    if nested_groups:
        names_of = _load_objects([group["params"] for group in nested_groups.values() if "params" in group])
        # optimizer.state_dict() saved as it is numbers the parameters (its state keys are those numbers):
        # which parameter is which would be a guess
        checkpoint.indexed_state = any(isinstance(name, int) for names in names_of for name in names)
        for group, names in zip((g for g in nested_groups.values() if "params" in g), names_of):
            for name in names:
                checkpoint.hyper[canonical(str(name))] = {k: v for k, v in group.items() if k != "params"}
    for name, hyper in flat_hyper.items():
        checkpoint.hyper[name] = hyper
    return checkpoint


@functools.cache
def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    class MetadataReadOnce(FileSystemReader):
        """dcp.load asks its reader for the metadata at every call, and the load calls it per parameter: a
        large run's metadata names every rank's chunk of every tensor, so it is read once, in read()."""

        def __init__(self, directory: str, metadata: Any) -> None:
            super().__init__(directory)
            self._metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self._metadata

    return MetadataReadOnce


@functools.cache
def _rows_planner_class() -> type:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import _create_read_items, create_read_items_for_chunk_list

    class RowsPlanner(DefaultLoadPlanner):
        """Reads rows ``[first, first + len(target))`` of a tensor into the target (the chunk a rank's range of
        the flattened parameter lies in), as DCP reads a DTensor's local chunk; other keys whole."""

        def __init__(self, first_rows: dict[str, int]) -> None:
            super().__init__()
            self.first_rows = first_rows

        def create_local_plan(self) -> Any:
            requests = []
            for key, target in self.state_dict.items():
                meta = self.metadata.state_dict_metadata[key]
                if key in self.first_rows:
                    offsets = torch.Size([self.first_rows[key]] + [0] * (target.dim() - 1))
                    chunk = ChunkStorageMetadata(offsets=offsets, sizes=target.size())
                    requests += create_read_items_for_chunk_list(key, meta, [chunk])
                else:
                    requests += _create_read_items(key, meta, target)
            return LoadPlan(requests)

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            # the rows' target, whose own offsets the read items' destination offsets are relative to
            return self.state_dict[index.fqn] if index.fqn in self.first_rows else super().lookup_tensor(index)

    return RowsPlanner


def describe(path: str, directories: list[str]) -> list[str]:
    """``python -m zerocore.checkpoint info`` for a DCP checkpoint: per directory, its tensors by container
    (the model's, the optimizer's) and its objects, without reading any data."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    lines = [f"{path}: a torch.distributed.checkpoint (DCP) checkpoint; engine.load_checkpoint reads it (Note [DCP "
             "checkpoints])"]
    for directory in directories:
        metadata = _read_metadata(directory)
        planner = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        tensors: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        objects: list[str] = []
        wheres = {key: tuple(planner.get(key, (key,))) for key in metadata.state_dict_metadata}
        roots = {root for where in wheres.values() if (root := _optimizer_root(where)) is not None}
        optimizers = {"/".join(map(str, root)) or "<top>" for root in roots}
        for key, meta in metadata.state_dict_metadata.items():
            where = wheres[key]
            root = next((r for r in roots if where[:len(r)] == r), None)
            if isinstance(meta, TensorStorageMetadata):
                container = (("/".join(map(str, root)) or "<top>") + " (optimizer state)" if root is not None
                             else "/".join(map(str, where[:-1])) or "<top>")
                tensors[container][0] += 1
                tensors[container][1] += math.prod(meta.size) * meta.properties.dtype.itemsize
            else:
                objects.append(".".join(map(str, where)))
        files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
        lines.append(f"{directory}: {len(files)} data files; optimizer state under "
                     f"{sorted(optimizers) or 'none (a model-only save)'}")
        for container, (count, nbytes) in sorted(tensors.items()):
            lines.append(f"  tensors under {container}: {count} ({nbytes / 1e6:.1f} MB)")
        shown = [o for o in objects if ".param_groups." not in f".{o}."]
        listed = ", ".join(shown[:8]) + (" ..." if len(shown) > 8 else "") if shown else "param groups"
        lines.append(f"  objects: {len(objects)} ({listed})")
    return lines


def _load(entries: dict[str, _Entry], rows: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """Loads entries (tensors whole, or rows ``[first, stop)`` of those in ``rows``; objects unpickled) by their
    DCP keys, one ``dcp.load`` per directory."""
    import torch.distributed.checkpoint as dcp

    rows = rows or {}
    by_directory: dict[str, dict[str, Any]] = defaultdict(dict)
    first_rows: dict[str, dict[str, int]] = defaultdict(dict)
    metadata: dict[str, Any] = {}
    for name, entry in entries.items():
        if entry.shape is None:
            value = None
        elif name in rows:
            first, stop = rows[name]
            value = torch.empty((stop - first, *entry.shape[1:]), dtype=entry.dtype)
            first_rows[entry.directory][entry.key] = first
        else:
            value = torch.empty(entry.shape, dtype=entry.dtype)
        by_directory[entry.directory][entry.key] = value
        metadata[entry.directory] = entry.metadata
    loaded: dict[tuple[str, str], Any] = {}
    for directory, state_dict in by_directory.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # (DCP: "loading in a single process")
            dcp.load(state_dict, storage_reader=_reader_class()(directory, metadata[directory]),
                     planner=_rows_planner_class()(first_rows[directory]), no_dist=True)
        loaded.update({(directory, key): value for key, value in state_dict.items()})
    return {name: loaded[(entry.directory, entry.key)] for name, entry in entries.items()}


def _load_objects(entries: list[_Entry]) -> list[Any]:
    values = _load({str(i): entry for i, entry in enumerate(entries)})
    return [values[str(i)] for i in range(len(entries))]


def _nested(client: dict[Path, Any]) -> dict[str, Any]:
    """The client state's objects as nested dicts by their paths (``train_state/step`` -> {"train_state":
    {"step": ...}})."""
    out: dict[str, Any] = {}
    for where, value in client.items():
        node = out
        for part in where[:-1]:
            node = node.setdefault(str(part), {})
        node[str(where[-1])] = value
    return out


@dataclass
class _Plan:
    """What the load writes, decided (and checked) before anything changes."""
    optimizer_step: int = 0
    steps: dict[str, int] = field(default_factory=dict)
    hyperparameters: list[dict[str, Any] | None] = field(default_factory=list)  # per engine param group


def _check_against(engine: Engine, checkpoint: _Checkpoint, optimizer_states: bool) -> _Plan:
    path = checkpoint.path
    ours = trainable_params(engine)
    known = {name for name, _ in named_parameters(engine.module, remove_duplicate=False)}  # (tied: every name)
    known |= {name for name, _ in named_buffers(engine.module, remove_duplicate=False)}
    extra = sorted(set(checkpoint.model) - known)
    if extra:
        raise ValueError(f"load_checkpoint: the DCP checkpoint {path} holds tensors the model does not have "
                         f"({extra[:5]}{' ...' if len(extra) > 5 else ''}): another model's checkpoint?; nothing was "
                         "changed")
    frozen = [name for name, _ in named_parameters(engine.module) if name not in ours]
    saved = [name for name in frozen if name in checkpoint.model]
    if saved and len(saved) != len(frozen):  # none saved: the model's own stay, as for DeepSpeed's checkpoints
        raise ValueError(f"load_checkpoint: frozen parameters {sorted(set(frozen) - set(saved))[:5]} are not in the "
                         f"DCP checkpoint {path}; nothing was changed")
    for name, param in named_parameters(engine.module):
        entry = checkpoint.model.get(name)
        if entry is None:
            continue
        if tuple(entry.shape) != tuple(param.shape):
            raise ValueError(f"load_checkpoint: parameter {name!r} is {list(param.shape)} in the model but "
                             f"{list(entry.shape)} in the DCP checkpoint {path}; nothing was changed")
    for name, buffer in named_buffers(engine.module):
        entry = checkpoint.model.get(name)
        if entry is not None and tuple(entry.shape) != tuple(buffer.shape):
            raise ValueError(f"load_checkpoint: buffer {name!r} is {list(buffer.shape)} in the model but "
                             f"{list(entry.shape)} in the DCP checkpoint {path}; nothing was changed")
    plan = _Plan(hyperparameters=[None] * len(engine.optimizer.param_groups))
    if not optimizer_states:
        return plan
    if not checkpoint.has_optimizer:
        raise ValueError(f"load_checkpoint: the DCP checkpoint {path} holds no optimizer state (a model-only save); "
                         "pass load_optimizer_states=False to load its weights with a fresh optimizer; nothing was "
                         "changed")
    if checkpoint.indexed_state:
        raise ValueError(f"load_checkpoint: the DCP checkpoint {path} holds optimizer state by parameter index "
                         "(optimizer.state_dict() saved as it is), not by name: save it through torch.distributed."
                         "checkpoint.state_dict.get_state_dict(model, optimizer), as torch's recipe and FSDP2 do, or "
                         "pass load_optimizer_states=False; nothing was changed")
    for name, fields in checkpoint.state.items():
        if name not in ours:
            raise ValueError(f"load_checkpoint: the DCP checkpoint {path} has optimizer state for {name!r}, which is "
                             "not a trainable parameter of this model (frozen here, or another model's); nothing "
                             "was changed")
        other = sorted(set(fields) - _ADAM_STATE)
        if other:
            raise ValueError(f"load_checkpoint: the DCP checkpoint {path} holds optimizer state {other} for {name!r}: "
                             "not Adam/AdamW's (exp_avg, exp_avg_sq, step), which zerocore's optimizer continues; "
                             "pass load_optimizer_states=False to load the weights alone; nothing was changed")
        for key in _MOMENTS:
            entry = fields.get(key)
            if entry is None or entry.shape is None or tuple(entry.shape) != tuple(ours[name].shape):
                raise ValueError(f"load_checkpoint: the DCP checkpoint {path} holds no {key} of the parameter's "
                                 f"shape for {name!r}; nothing was changed")
    steps = _load({name: fields["step"] for name, fields in checkpoint.state.items() if "step" in fields})
    plan.steps = {name: int(torch.as_tensor(value).item()) for name, value in steps.items()}
    plan.optimizer_step = max(plan.steps.values(), default=0)
    hyper = _load({f"{name}/{key}": entry for name, fields in checkpoint.hyper.items() if name in ours
                   for key, entry in fields.items()
                   if key in (*ADAM_HYPERPARAMETERS, "amsgrad", "maximize", "decoupled_weight_decay")})
    decoupled = engine.config.optimizer.adamw_mode
    for name in ours:
        for flag in ("amsgrad", "maximize"):
            if hyper.get(f"{name}/{flag}"):
                raise ValueError(f"load_checkpoint: the DCP checkpoint {path} trained {name!r} with {flag}=True, "
                                 "which zerocore's AdamW does not do; nothing was changed")
        # torch's Adam adds weight decay to the gradient (L2), its AdamW decouples it: the loaded weight_decay
        # must keep meaning what it meant
        saved = hyper.get(f"{name}/decoupled_weight_decay")
        if saved is not None and bool(saved) != decoupled and hyper.get(f"{name}/weight_decay"):
            raise ValueError(
                f"load_checkpoint: the DCP checkpoint {path} trained {name!r} with "
                f"{'decoupled (AdamW)' if saved else 'L2 (torch.optim.Adam)'} weight decay, this engine's optimizer "
                f"applies it {'decoupled' if decoupled else 'as L2'}: configure "
                f"{'type AdamW' if saved else 'type Adam with adam_w_mode false'}; nothing was changed")
    for index, names in enumerate(group_names(engine)):
        seen = {}
        for name in names:
            values = {key: hyper[f"{name}/{key}"] for key in ADAM_HYPERPARAMETERS if f"{name}/{key}" in hyper}
            if values:
                seen[name] = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        distinct = {tuple(sorted(v.items())) for v in seen.values()}
        if len(distinct) > 1:
            raise ValueError(f"load_checkpoint: param group {index}'s parameters had different hyperparameters in the "
                             f"DCP checkpoint {path} ({dict(list(seen.items())[:3])}): build the engine's param groups "
                             "as the run that saved it had them; nothing was changed")
        if seen:
            plan.hyperparameters[index] = next(iter(seen.values()))
    return plan


def load(engine: Engine, path: str, directories: list[str], load_optimizer_states: bool,
         load_lr_scheduler_states: bool, load_module_only: bool) -> dict[str, Any]:
    """Reads, checks (every rank agreeing) and applies a DCP checkpoint; returns its objects as client state."""
    optimizer_states = load_optimizer_states and not load_module_only
    checkpoint, plan, client, problem = None, None, None, None
    try:
        checkpoint = read(path, directories, set(trainable_params(engine)))
        plan = _check_against(engine, checkpoint, optimizer_states)
        client = _nested(dict(zip(checkpoint.client, _load_objects(list(checkpoint.client.values())))))
    except (OSError, ValueError) as error:
        problem = error
    except (KeyError, TypeError, IndexError, AttributeError, RuntimeError) as error:  # a layout not read here
        problem = ValueError(f"load_checkpoint: {path} is not a DCP checkpoint this version reads "
                             f"({type(error).__name__}: {error}); nothing was changed")
    agree_on_reading(engine, problem, "the DCP checkpoint")
    assert checkpoint is not None and plan is not None and client is not None
    with deferred_interrupts("the checkpoint load"):  # (Note [Interrupts deferred in an update])
        _apply(engine, checkpoint, plan, optimizer_states, load_lr_scheduler_states, load_module_only)
    return client


_LOAD_BATCH_BYTES = 256 << 20  # what one dcp.load reads at most (unless one parameter is larger): each call has
# a fixed cost (its plan over the whole metadata) that a parameter at a time paid per parameter


@dataclass
class _Rows:
    """The rows of a trainable parameter that hold this rank's elements ``[start, stop)`` of it, flattened."""
    first: int
    stop: int
    row: int  # elements per row

    @property
    def base(self) -> int:  # the flattened parameter's element at the rows' start
        return self.first * self.row


def _own_rows(param: Any) -> _Rows | None:
    """None when this rank holds none of the parameter."""
    start, stop = local_range(param)
    if start == stop:
        return None
    row = math.prod(param.shape[1:]) if param.dim() > 1 else 1
    return _Rows(start // row, -(-stop // row), row)


def _batches(ours: dict[str, Any], checkpoint: _Checkpoint, optimizer_states: bool
             ) -> list[tuple[dict[str, _Entry], dict[str, _Rows]]]:
    """The rows of the trainable parameters' values (and moments) this rank holds, ``key/name`` -> entry, in
    batches of about ``_LOAD_BATCH_BYTES``, in the engine's order."""
    batches: list[tuple[dict[str, _Entry], dict[str, _Rows]]] = [({}, {})]
    size = 0
    for name, param in ours.items():
        rows = _own_rows(param)
        if rows is None:
            continue
        wanted = {"master": checkpoint.model[name]}
        if optimizer_states:
            wanted.update({key: entry for key, entry in checkpoint.state.get(name, {}).items() if key in _MOMENTS})
        nbytes = sum((rows.stop - rows.first) * rows.row * e.dtype.itemsize for e in wanted.values())
        if batches[-1][0] and size + nbytes > _LOAD_BATCH_BYTES:
            batches.append(({}, {}))
            size = 0
        batches[-1][0].update({f"{key}/{name}": entry for key, entry in wanted.items()})
        batches[-1][1].update({f"{key}/{name}": rows for key in wanted})
        size += nbytes
    return [batch for batch in batches if batch[0]]


def _apply(engine: Engine, checkpoint: _Checkpoint, plan: _Plan, optimizer_states: bool, scheduler_states: bool,
           module_only: bool) -> None:
    from ._gathered import write_whole_in_groups

    ours = trainable_params(engine)
    with torch.no_grad():
        # this rank's elements only (the rows that hold them), as each rank reads its share of a DTensor
        for batch, rows_of in _batches(ours, checkpoint, optimizer_states):
            loaded = _load(batch, {key: (rows.first, rows.stop) for key, rows in rows_of.items()
                                   if len(batch[key].shape) > 0})  # (a 0-dim tensor is read whole)
            for name in dict.fromkeys(key.split("/", 1)[1] for key in batch):
                located, rows = _locate(ours[name], "load_checkpoint"), rows_of[f"master/{name}"]
                for key in ("master", *_MOMENTS):
                    value = loaded.get(f"{key}/{name}")
                    if value is None and (key == "master" or module_only):
                        continue
                    flat = (value.reshape(-1).float() if value is not None  # (no state: it never got a gradient)
                            else torch.zeros((rows.stop - rows.first) * rows.row))
                    write_own(located, key, flat.to(engine.device), rows.base)
        engine.reload_params_from_shards()  # every rank: stages 1-2 gather the rest, stage 3 releases its units
        write_whole_in_groups(engine, [
            (param, lambda entry=checkpoint.model[name]: _load({"value": entry})["value"])
            for name, param in named_parameters(engine.module) if name not in ours and name in checkpoint.model])
        buffers = {name: buffer for name, buffer in named_buffers(engine.module) if name in checkpoint.model}
        for name, value in _load({name: checkpoint.model[name] for name in buffers}).items():
            buffers[name].copy_(value)
    if module_only:
        return
    step = plan.optimizer_step
    idle = {name: step - plan.steps.get(name, 0) for name in ours if step - plan.steps.get(name, 0) > 0}
    engine.restore_counters(step, step, 0, step * engine.config.gradient_accumulation_steps, idle)
    for group, saved in zip(engine.optimizer.param_groups, plan.hyperparameters):
        if saved is not None:
            for key, value in saved.items():
                set_group_value(group, key, value)
    if scheduler_states and engine.lr_scheduler is not None and step > 0:
        # the schedule where a run that took these steps has it (FSDP's scheduler is the script's own object)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # (torch: a scheduler step before an optimizer step)
            for _ in range(step):
                engine.lr_scheduler.step()
