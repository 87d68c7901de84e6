"""``python -m zerocore.checkpoint``: ``info`` (what a checkpoint holds), ``to-hf`` (:func:`to_hf`: the
model as Hugging Face safetensors), ``to-dcp`` (:func:`to_dcp`: model and AdamW state as a DCP directory
FSDP2 resumes from) and ``to-deepspeed`` (:func:`to_deepspeed`: a DeepSpeed universal checkpoint); each reads a
checkpoint directory without an engine or a process group."""

from __future__ import annotations

import argparse
import json
import numbers
import os
import re

import torch

from . import _safetensors_io as stio
from ._checkpoint_format import read_index, resolve_tag, tag_path, write_durably, write_file_durably
from ._dcp_export import to_dcp
from ._deepspeed_export import to_deepspeed
from ._saved_tensors import SavedTensors

# --help's description: the first line of checkpoint.py's docstring, as when main() was defined there.
_DESCRIPTION = ("Sharded checkpoints: ``engine.save_checkpoint`` / ``engine.load_checkpoint``, safetensors and JSON "
                "only.")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def to_hf(checkpoint_dir: str, out_dir: str, tag: str | None = None, dtype: str = "fp32",
          max_shard_size: int | str = 5 * 10**9, overwrite: bool = False, *, exclude_frozen_parameters: bool = False,
          safe_serialization: bool = True) -> list[str]:
    """Writes the checkpoint's model (fp32 masters in ``dtype``; buffers and frozen parameters as saved) as
    Hugging Face safetensors: ``model.safetensors``, or shards plus ``model.safetensors.index.json`` above
    ``max_shard_size`` (bytes, or a string as ``save_pretrained`` takes it: ``"5GB"``, ``"500MB"``). One tensor at a time: each is assembled from the ranks' pieces (reading only
    the blocks that hold them, each checked), written and dropped, so the peak memory is a small multiple of
    the largest tensor. Tied parameters are written once. A checkpoint saved with
    ``exclude_frozen_parameters`` holds no frozen parameters, so neither does the output (load it over the
    base model with ``strict=False``, as a LoRA adapter); ``exclude_frozen_parameters=True`` here leaves them out
    of any checkpoint's output. ``safe_serialization=False`` writes torch's pickled ``pytorch_model.bin`` (shards:
    ``pytorch_model-00001-of-0000N.bin`` and ``pytorch_model.bin.index.json``) instead, as ``save_pretrained``
    does: each shard is built whole in memory first (up to ``max_shard_size``), and a tied parameter is there
    under each of its names (one storage), as in the model's own state dict. Returns the files.

    ``out_dir`` may not be, hold or lie inside the checkpoint (its own ``model.safetensors`` would be
    replaced), and a previous output in it is replaced only with ``overwrite=True``, which also removes
    that output's files the new one does not have (a stale ``model.safetensors`` next to a new sharded index
    would be loaded in its place). Both are refused before anything is written."""
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    max_shard_size = _shard_size(max_shard_size)
    path = tag_path(checkpoint_dir, resolve_tag(checkpoint_dir, tag))
    check_out_dir(out_dir, [checkpoint_dir, path])
    index = read_index(path)
    entries = model_entries(index, _DTYPES[dtype], exclude_frozen_parameters)
    shards: list[list[tuple[str, list[int], torch.dtype]]] = [[]]
    size = 0
    for entry in entries:
        nbytes = stio.nbytes(entry[1], entry[2])
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    stem, suffix = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    names = ([f"{stem}.{suffix}"] if len(shards) == 1 else
             [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{suffix}" for i in range(len(shards))]
             + [f"{stem}.{suffix}.index.json"])
    previous = _previous_output(out_dir)
    if previous and not overwrite:
        raise FileExistsError(f"{out_dir} already holds {', '.join(previous)}: pass --overwrite (overwrite=True) to "
                              "replace that output, or choose another directory")
    with SavedTensors(path, index) as saved:  # every file is checked before writing
        def tensor(name: str, shape: list[int], dt: torch.dtype) -> torch.Tensor:
            value = saved.trainable(name) if name in index["params"] else saved.untracked(name)
            return value.to(dt)

        os.makedirs(out_dir, exist_ok=True)
        written, weight_map = [], {}
        for name, shard in zip(names, shards):
            if safe_serialization:
                stio.write(os.path.join(out_dir, name), shard, tensor)
            else:
                values = {entry[0]: tensor(*entry) for entry in shard}
                # a tied parameter under each name too, as the model's state dict has it (torch.save stores it once)
                aliases = {alias: values[first] for alias, first in index.get("tied", {}).items() if first in values}
                values.update(aliases)
                write_file_durably(os.path.join(out_dir, name), lambda f: torch.save(values, f))
                weight_map.update(dict.fromkeys(aliases, name))
                del values
            written.append(name)
            weight_map.update({entry[0]: name for entry in shard})
    if len(shards) > 1:
        total = sum(stio.nbytes(s, d) for _, s, d in entries)
        write_durably(os.path.join(out_dir, names[-1]), json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode())
        written.append(names[-1])
    for stale in set(previous) - set(names):  # only after the new output is complete
        os.remove(os.path.join(out_dir, stale))
    return written


# A file name to_hf writes: what a previous output in the same directory holds.
_OUTPUT_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
                          r"|pytorch_model(-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index\.json")


def model_entries(index: dict, dtype: torch.dtype, exclude_frozen_parameters: bool
                  ) -> list[tuple[str, list[int], torch.dtype]]:
    """(name, shape, dtype) of what the checkpoint's model state dict holds: every trainable parameter (its fp32
    master, written as ``dtype``), then the persistent buffers and frozen parameters as saved, the frozen ones left
    out with ``exclude_frozen_parameters``."""
    entries = [(name, shape, dtype) for name, shape in index["params"].items()]
    entries += [(name, entry["shape"], getattr(torch, entry["dtype"])) for name, entry in index["untracked"].items()
                if entry.get("persistent", True) and not (exclude_frozen_parameters and _frozen_parameter(name, entry))]
    return entries


def _frozen_parameter(name: str, entry: dict) -> bool:
    """An untracked tensor of the index that is a frozen parameter, not a buffer (checkpoints before the index
    said which: every tensor of a module's buffers has the buffer flag since)."""
    if "buffer" not in entry:
        raise ValueError(f"exclude_frozen_parameters: this checkpoint's index does not say whether {name!r} is a "
                         "buffer or a frozen parameter (an older zerocore wrote it); convert it without "
                         "exclude_frozen_parameters")
    return not entry["buffer"]


def _previous_output(out_dir: str) -> list[str]:
    if not os.path.isdir(out_dir):
        return []
    return sorted(name for name in os.listdir(out_dir) if _OUTPUT_NAME.fullmatch(name))


def check_out_dir(out_dir: str, checkpoint_paths: list[str]) -> None:
    """Refuses an output directory that is, holds or lies inside a checkpoint path, symlinks resolved: the
    output's model.safetensors would replace the checkpoint's own (or its files sit where a sharded output
    lands), leaving it unloadable."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise NotADirectoryError(f"output {out_dir} exists and is not a directory")
    out = os.path.realpath(out_dir)
    for checkpoint in checkpoint_paths:
        real = os.path.realpath(checkpoint)
        if os.path.commonpath([out, real]) in (out, real):
            raise ValueError(f"output {out_dir} overlaps the checkpoint {checkpoint} ({out} and {real}): "
                             "writing there would overwrite the checkpoint's files; choose a directory outside it")


# ---- command line -----------------------------------------------------------------------------------------
def _info(path: str, tag: str | None) -> None:
    from ._dcp_checkpoint import dcp_directories
    from ._dcp_checkpoint import describe as describe_dcp
    from ._deepspeed_checkpoint import describe as describe_deepspeed
    from ._deepspeed_checkpoint import is_deepspeed_checkpoint

    # DeepSpeed's universal checkpoints (ds_to_universal's output) are named by latest_universal alone
    pointer = "latest_universal" if not os.path.exists(os.path.join(path, "latest")) else "latest"
    if tag is not None or os.path.exists(os.path.join(path, pointer)):
        tag = resolve_tag(path, tag, pointer)  # the pointer's content is checked as a tag is: "../../etc" is not followed
    directory = tag_path(path, tag) if tag else path
    if is_deepspeed_checkpoint(directory) or dcp_directories(directory) is not None:  # the formats a load reads
        dcp = dcp_directories(directory)
        print("\n".join(describe_dcp(directory, dcp) if dcp is not None else describe_deepspeed(directory)))
        return
    index = read_index(directory)
    total = sum(sum(s["numel"] for s in r["shards"]) for r in index["ranks"])
    held = "buffers (frozen parameters excluded)" if index.get("frozen_excluded") else "buffers/frozen tensors"
    print(f"{directory}: zerocore {index['zerocore_version']}, stage {index['stage']}, world size "
          f"{index['world_size']}, compute dtype {index['compute_dtype']}")
    print(f"steps: {index['counters']}; loss scaler: {index['loss_scaler']}")
    print(f"{len(index['params'])} trainable parameters, {total} shard elements (with padding), "
          f"{len(index['untracked'])} {held}; lr scheduler: "
          f"{'yes' if index['lr_scheduler'] is not None else 'no'}; client_state keys: {sorted(index['client_state'])}")
    for name, shape in index["params"].items():
        print(f"  {name} {shape}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerocore.checkpoint", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print what a checkpoint holds (zerocore's, DeepSpeed's or a DCP one)")
    info.add_argument("checkpoint_dir")
    info.add_argument("--tag")
    hf = sub.add_parser("to-hf", help="write the model as Hugging Face safetensors, one tensor at a time")
    hf.add_argument("checkpoint_dir")
    hf.add_argument("out_dir")
    hf.add_argument("--tag")
    hf.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES))
    hf.add_argument("--max-shard-size", default="5GB", type=_parse_size, help="e.g. 5GB, 500MB, or bytes")
    hf.add_argument("--overwrite", action="store_true",
                    help="replace a previous to-hf output in OUT_DIR (its model*.safetensors and index)")
    to_dcp_parser = sub.add_parser("to-dcp", help="write the model and AdamW state as a torch.distributed.checkpoint "
                                                  "directory that FSDP2 resumes from, one tensor at a time")
    to_dcp_parser.add_argument("checkpoint_dir")
    to_dcp_parser.add_argument("out_dir")
    to_dcp_parser.add_argument("--tag")
    to_dcp_parser.add_argument("--overwrite", action="store_true",
                               help="replace a previous DCP checkpoint in OUT_DIR (.metadata, *.distcp)")
    to_ds = sub.add_parser("to-deepspeed", help="write a DeepSpeed universal checkpoint (OUT_DIR/global_step<N>, "
                                                "OUT_DIR/latest_universal) that DeepSpeed resumes from at any world "
                                                "size and stage")
    to_ds.add_argument("checkpoint_dir")
    to_ds.add_argument("out_dir")
    to_ds.add_argument("--tag")
    to_ds.add_argument("--overwrite", action="store_true", help="replace OUT_DIR/global_step<N> if it exists")
    to_ds.add_argument("--group-steps", action="store_true",
                       help="continue parameters that took fewer optimizer steps than their group (they got no "
                            "gradient in some) at the group's step, which DeepSpeed keeps for all of them")
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            _info(args.checkpoint_dir, args.tag)
        elif args.command == "to-deepspeed":
            written = to_deepspeed(args.checkpoint_dir, args.out_dir, args.tag, args.overwrite, args.group_steps)
            print(f"wrote {len(written)} files under {args.out_dir} (tag {written[0].split('/')[0]}, named by "
                  "latest_universal). DeepSpeed resumes from it with \"checkpoint\": {\"load_universal\": true} in its "
                  f"config and engine.load_checkpoint({args.out_dir!r}); buffers and frozen parameters come from the "
                  "model the script builds (Note [DeepSpeed export])")
        elif args.command == "to-dcp":
            written = to_dcp(args.checkpoint_dir, args.out_dir, args.tag, args.overwrite)
            print("wrote " + ", ".join(os.path.join(args.out_dir, name) for name in written))
        else:
            written = to_hf(args.checkpoint_dir, args.out_dir, args.tag, args.dtype, args.max_shard_size,
                            args.overwrite)
            print("wrote " + ", ".join(os.path.join(args.out_dir, name) for name in written))
    except (ValueError, OSError) as error:  # a refusal or a damaged checkpoint: one line, as argparse does
        parser.error(str(error))
    return 0


def _shard_size(value: int | str) -> int:
    """``to_hf``'s ``max_shard_size`` from Python: what the command line takes, or an int of bytes >= 1."""
    if isinstance(value, str):
        try:
            return _parse_size(value)
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"max_shard_size: {error}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value < 2**63:
        raise ValueError(f"max_shard_size must be a number of bytes >= 1 or a size such as '5GB', got {value!r}")
    return int(value)


def _parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``1.5GB`` or a number of bytes: a whole number of bytes >= 1."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    number, factor = text.strip(), 1
    for unit, scale in units.items():
        if number.upper().endswith(unit):
            number, factor = number[: -len(unit)], scale
            break
    try:
        value = float(number) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB, or bytes)") from None
    if not 1 <= value < 2**63:  # nan, inf, 0 and negatives fail here (a shard per tensor is 1)
        raise argparse.ArgumentTypeError(f"a size must be at least 1 byte and finite, got {text!r}")
    return int(value)
