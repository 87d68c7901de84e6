"""Pretrained weights in Hugging Face's safetensors layout loaded into a running engine, each rank reading only
the bytes its shards hold: ``engine.load_hf_weights(path)``.

Note [Loading Hugging Face weights]
-----------------------------------
``path`` is a ``.safetensors`` file, or a directory holding ``model.safetensors`` or the shards named by
``model.safetensors.index.json`` (what ``save_pretrained``, ``save_16bit_model`` and ``python -m
zerocore.checkpoint to-hf`` write); older checkpoints' ``pytorch_model.bin`` (and its sharded index), a
``torch.save`` file, are memory-mapped (``torch.load(mmap=True, weights_only=True)``) so that a rank's reads
touch only its elements' pages there too. Tensors are matched to the model by name, as ``load_state_dict`` matches
them (without ``torch.compile``'s and checkpoint wrappers' name parts: Note [Names without wrappers]); a tied
parameter is found under any of its names, as ``save_pretrained`` keeps one; a Hugging Face model's
``base_model_prefix`` is added or taken off where that matches more names, as ``from_pretrained`` does.

Every rank reads each file's header and checks it against the model (names, shapes, floating dtypes, byte
ranges inside the file) and the ranks compare what they read (the headers, and each file's first and last 64
KiB of data), so a missing or misshapen tensor, a truncated file or ranks given different files raise on every
rank before anything changes. Then each rank reads, for a
trainable parameter, only the elements its optimizer shards hold (``preadv`` of that byte range, 4M elements
at a time, straight into a tensor), writes them into its fp32 master and the parameter shard, and the parameters are gathered again from the shards as after a
checkpoint load: a rank's reads and its memory beyond the model's are its share of the trainable weights, not
the whole file (DeepSpeed's ``zero.Init`` loading reads every tensor on rank 0 and broadcasts it). Frozen
parameters are read on rank 0 and written through ``zerocore.gathered(..., modifier_rank=0)``, a group of
them at a time; persistent buffers are read whole on every rank. The optimizer's moments and counters stay
(DeepSpeed's ``load_module_only``): load before training, or keep them on purpose.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ._deferred_signals import deferred_interrupts
from ._full_param_state import _locate, _own_pieces, write_master_range
from ._model_checks import all_gather_json, failing_together
from ._names import canonical
from ._safetensors_io import _TORCH_DTYPE

if TYPE_CHECKING:
    from .engine import Engine

_SAMPLE = 1 << 16  # bytes of each file's data start and end that the ranks compare
_CHUNK_ELEMENTS = 1 << 22  # read and written at once: a rank's memory beyond its shards stays 16-32 MiB


@dataclass(frozen=True)
class _Tensor:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset of its data in ``file``
    nbytes: int
    mapped: torch.Tensor | None = None  # a pickled file's tensor, memory-mapped (``start`` unused)


def load_hf_weights(engine: Engine, path: str, strict: bool) -> _IncompatibleKeys:
    """See :meth:`Engine.load_hf_weights`."""
    problem: BaseException | None = None
    plan: _Plan | None = None
    try:
        plan = _plan(engine, _read_headers(path), strict)
    except (OSError, ValueError) as error:
        problem = error
    except Exception as error:  # noqa: BLE001 - a header of another shape: refused on every rank, not a hang
        problem = ValueError(f"load_hf_weights: {path} is not laid out as Hugging Face weights "
                             f"({type(error).__name__}: {error}); nothing was changed")
    verdicts = all_gather_json(engine.comm, [None if problem is None else f"{type(problem).__name__}: {problem}",
                                             None if plan is None else plan.digest], engine.device)
    if problem is not None:
        raise problem
    failed = [(rank, message) for rank, (message, _) in enumerate(verdicts) if message is not None]
    if failed:
        raise ValueError(f"load_hf_weights: rank {failed[0][0]} refused {path} ({failed[0][1]}); nothing was changed")
    if len({digest for _, digest in verdicts}) > 1:
        raise ValueError(f"load_hf_weights: the ranks read different weights under {path} (header digests "
                         f"{[digest for _, digest in verdicts]}): give every rank the same files; nothing was changed")
    assert plan is not None
    with deferred_interrupts("the weights load"), torch.no_grad():
        _apply(engine, plan)
    return _IncompatibleKeys(plan.missing, plan.unexpected)


# ---- reading and checking --------------------------------------------------------------------------------

def _read_headers(path: str) -> dict[str, _Tensor]:
    path = os.fspath(path)
    if os.path.isdir(path):
        files = None
        for base in ("model.safetensors", "pytorch_model.bin"):  # safetensors first, as from_pretrained
            index, single = os.path.join(path, base + ".index.json"), os.path.join(path, base)
            if os.path.exists(index):
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise ValueError(f"load_hf_weights: {index} has no weight_map")
                files = sorted({os.path.join(path, name) for name in weight_map.values()})
                break
            if os.path.exists(single):
                files = [single]
                break
        if files is None:
            raise FileNotFoundError(f"load_hf_weights: {path} holds none of model.safetensors, "
                                    "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"load_hf_weights: {path} does not exist")
    tensors: dict[str, _Tensor] = {}
    for file in files:
        for name, tensor in (_header(file) if file.endswith(".safetensors") else _pickled(file)).items():
            if name in tensors:
                raise ValueError(f"load_hf_weights: tensor {name!r} is in both {tensors[name].file} and {file}")
            tensors[name] = tensor
    return tensors


def _header(file: str) -> dict[str, _Tensor]:
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"load_hf_weights: {file} is not a safetensors file (shorter than its header size)")
        length = int.from_bytes(head, "little")
        if length > size - 8:
            raise ValueError(f"load_hf_weights: {file} is not a safetensors file (a header of {length} bytes in a "
                             f"file of {size})")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"load_hf_weights: {file} is not a safetensors file ({error})") from None
    data = 8 + length
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _TORCH_DTYPE.get(entry.get("dtype"))
        shape = tuple(entry.get("shape", ()))
        begin, end = entry.get("data_offsets", (0, -1))
        numel = 1
        for dim in shape:
            numel *= dim
        if dtype is None:
            raise ValueError(f"load_hf_weights: {file}: tensor {name!r} has dtype {entry.get('dtype')!r}, which "
                             "this reader does not know")
        if end - begin != numel * dtype.itemsize or begin < 0 or data + end > size:
            raise ValueError(f"load_hf_weights: {file}: tensor {name!r} ({list(shape)}, {entry.get('dtype')}) has "
                             f"bytes [{begin}, {end}) of a data section of {size - data}: the file is truncated or "
                             "damaged")
        out[name] = _Tensor(file, dtype, shape, data + begin, end - begin)
    return out


def _pickled(file: str) -> dict[str, _Tensor]:
    """A ``torch.save`` state dict (``pytorch_model.bin``), memory-mapped (``torch.load(mmap=True)``, weights
    only): a rank's reads then touch only the pages of the elements it takes."""
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch raises several kinds for a file it cannot map
        raise ValueError(f"load_hf_weights: {file} is neither a safetensors file nor a torch.save state dict in "
                         f"the zip format ({type(error).__name__}: {error})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"load_hf_weights: {file} does not hold a flat state dict of tensors")
    return {name: _Tensor(file, value.dtype, tuple(value.shape), 0, value.numel() * value.dtype.itemsize, value)
            for name, value in state.items()}


@dataclass
class _Plan:
    trainable: list[tuple[nn.Parameter, _Tensor]]
    frozen: list[tuple[nn.Parameter, _Tensor]]
    buffers: list[tuple[torch.Tensor, _Tensor]]
    missing: list[str]
    unexpected: list[str]
    digest: str


def _model_names(module: nn.Module, tensors: dict[str, _Tensor]) -> dict[str, str]:
    """The model's name for each file tensor's name. A Hugging Face model's files may hold its base model
    alone (``BertModel``'s, keys without ``bert.``) or the other way round: as ``from_pretrained`` does, the
    ``base_model_prefix`` is added or taken off when that matches more of the model's names."""
    ours = {canonical(name) for name, _ in module.named_parameters(remove_duplicate=False)}
    as_saved = {canonical(name): name for name in tensors}
    prefix = getattr(module, "base_model_prefix", "")
    if not prefix or not isinstance(prefix, str):
        return as_saved
    dotted = prefix + "."
    added = {dotted + name: saved for name, saved in as_saved.items()}
    removed = {name[len(dotted):]: saved for name, saved in as_saved.items() if name.startswith(dotted)}
    return max((as_saved, added, removed), key=lambda mapping: len(ours & set(mapping)))


def _plan(engine: Engine, tensors: dict[str, _Tensor], strict: bool) -> _Plan:
    by_name = _model_names(engine.module, tensors)
    trainable_ids = {id(p) for buffer in engine.buffers for p in buffer.params}
    aliases: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), (param, []))[1].append(canonical(name))
    used: set[str] = set()
    missing: list[str] = []
    trainable, frozen, buffers = [], [], []
    for param, names in aliases.values():
        found = next((n for n in names if n in by_name), None)
        if found is None:
            missing.append(names[0])
            continue
        used.update(n for n in names if n in by_name)
        tensor = tensors[by_name[found]]
        if tensor.shape != tuple(param.shape) or not tensor.dtype.is_floating_point:
            raise ValueError(f"load_hf_weights: parameter {found!r} is {list(param.shape)} in the model but "
                             f"{list(tensor.shape)} {tensor.dtype} in {tensor.file}; nothing was changed")
        (trainable if id(param) in trainable_ids else frozen).append((param, tensor))
    for module_name, module in engine.module.named_modules():
        for buffer_name, buffer in module._buffers.items():
            if buffer is None or buffer_name in module._non_persistent_buffers_set:
                continue
            name = canonical(f"{module_name}.{buffer_name}" if module_name else buffer_name)
            if name not in by_name:
                missing.append(name)
                continue
            used.add(name)
            tensor = tensors[by_name[name]]
            if tensor.shape != tuple(buffer.shape):
                raise ValueError(f"load_hf_weights: buffer {name!r} is {list(buffer.shape)} in the model but "
                                 f"{list(tensor.shape)} in {tensor.file}; nothing was changed")
            buffers.append((buffer, tensor))
    unexpected = sorted(set(tensors) - {by_name[n] for n in used})  # as the files name them
    if strict and (missing or unexpected):
        raise ValueError(f"load_hf_weights: the weights do not match the model (missing: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}; unexpected: {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}); pass strict=False to load the rest; nothing "
                         "was changed")
    return _Plan(trainable, frozen, buffers, sorted(missing), unexpected, _digest(tensors))


def _digest(tensors: dict[str, _Tensor]) -> str:
    """What the ranks compare: every tensor's name, file, dtype, shape and bytes, and a sample of each file's
    data (its first and last 64 KiB), so ranks given different copies of one layout (another training step's
    weights) are caught without any rank reading every file whole."""
    described = sorted((name, os.path.basename(t.file), str(t.dtype), t.shape, t.start, t.nbytes)
                       for name, t in tensors.items())
    crc = zlib.crc32(json.dumps(described).encode())
    for file in sorted({t.file for t in tensors.values()}):
        start = min(t.start for t in tensors.values() if t.file == file)
        size = os.path.getsize(file)
        with open(file, "rb", buffering=0) as f:
            crc = zlib.crc32(os.pread(f.fileno(), min(_SAMPLE, size - start), start), crc)
            crc = zlib.crc32(os.pread(f.fileno(), _SAMPLE, max(start, size - _SAMPLE)), crc)
    return f"{crc:08x}"


# ---- applying it -----------------------------------------------------------------------------------------

def _elements(tensor: _Tensor, first: int, count: int) -> torch.Tensor:
    """Elements ``[first, first + count)`` of the flattened tensor, in its own dtype, read straight into the
    tensor returned (``preadv`` into its memory: no intermediate bytes object)."""
    if tensor.mapped is not None:
        return tensor.mapped.reshape(-1)[first : first + count].clone()
    item = tensor.dtype.itemsize
    out = torch.empty(count * item, dtype=torch.uint8)
    done = 0
    with open(tensor.file, "rb", buffering=0) as f:
        while done < out.numel():
            view = (ctypes.c_char * (out.numel() - done)).from_address(out.data_ptr() + done)
            got = os.preadv(f.fileno(), [view], tensor.start + first * item + done)
            if got <= 0:
                raise OSError(f"load_hf_weights: {tensor.file} ended while reading tensor bytes (truncated after "
                              "the check?)")
            done += got
    return out.view(tensor.dtype)


def _read(tensor: _Tensor, first: int, count: int) -> torch.Tensor:
    """A range of a trainable parameter's elements (this rank's share)."""
    return _elements(tensor, first, count)


def _whole(tensor: _Tensor) -> torch.Tensor:
    return _elements(tensor, 0, tensor.nbytes // tensor.dtype.itemsize).view(tensor.shape)


def _apply(engine: Engine, plan: _Plan) -> None:
    """Each rank reads and writes its own elements, then rank 0 the frozen parameters' and every rank the
    buffers. The files were checked on every rank, but a read can still fail (a disk error, a file truncated while
    read) on one rank: after each part every rank learns whether any failed and all raise alike, never one rank
    raising while the others go on into the next collective (the weights are then partly loaded)."""
    from ._gathered import write_whole_in_groups

    state = engine.optimizer_state
    with _agreed(engine, "its share of the trainable parameters"):
        for param, tensor in plan.trainable:  # this rank's elements only, a chunk at a time
            located = _locate(param, "load_hf_weights")
            for shard, piece_at_shard, piece_at, piece_length in _own_pieces(located):
                for offset in range(0, piece_length, _CHUNK_ELEMENTS):
                    at_shard, at = piece_at_shard + offset, piece_at + offset
                    length = min(_CHUNK_ELEMENTS, piece_length - offset)
                    write_master_range(state, shard, at_shard,
                                       _read(tensor, at, length).to(device=engine.device, dtype=torch.float32))
    engine.reload_params_from_shards()  # every rank: stages 1-2 gather the rest, stage 3 releases its units
    # read on rank 0 only, a group at a time (each group's reads agreed on before it is written)
    write_whole_in_groups(engine, [(param, functools.partial(_whole, tensor)) for param, tensor in plan.frozen])
    with _agreed(engine, "the buffers"):
        for buffer, tensor in plan.buffers:
            buffer.copy_(_whole(tensor))


def _agreed(engine: Engine, what: str) -> contextlib.AbstractContextManager[None]:
    """The block's reads run on every rank; then every rank raises if any rank's failed."""
    return failing_together(engine.comm, engine.device, lambda rank, message: OSError(
        f"load_hf_weights: rank {rank} could not read {what} ({message}); the weights are partly loaded: load them "
        "again"))
