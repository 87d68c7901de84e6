"""``deepspeed.utils.zero_to_fp32`` for scripts switched to zerocore: the model's fp32 weights from a checkpoint that
``engine.save_checkpoint`` wrote, with DeepSpeed's functions and command line
(``python -m zerocore.deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization]
[--max_shard_size 5GB] [-t TAG] [--exclude_frozen_parameters]``), where DeepSpeed's users run the
``zero_to_fp32.py`` it copies beside each checkpoint.

As DeepSpeed's: the tag is ``latest``'s unless given; the state dict holds every trainable parameter's fp32
master, the frozen parameters (unless ``exclude_frozen_parameters``) and the persistent buffers as saved, and a
tied parameter under each of its names (the same tensor), so ``model.load_state_dict`` takes it as it is. The
tensors are read from the ranks' files without an engine or a process group (``zerocore.checkpoint``'s exports'
reader: only the blocks that hold them, each checked). ``lazy_mode=True`` returns stand-ins read one at a time by
``.contiguous()``, for models larger than memory. A DeepSpeed checkpoint is refused naming DeepSpeed's own
script; ``python -m zerocore.checkpoint to-hf`` is the same conversion in safetensors only.
"""

from __future__ import annotations

import argparse
import os
import sys
import weakref
from typing import Any

import torch
from torch import nn

from ..._checkpoint_cli import _parse_size, model_entries, to_hf
from ..._checkpoint_format import read_index, resolve_tag, tag_path
from ..._saved_tensors import SavedTensors

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]


class LazyTensor:
    """A tensor of the checkpoint not read yet: ``.contiguous()`` reads it (DeepSpeed's lazy_mode stand-in)."""

    def __init__(self, reader: _Reader, name: str, shape: list[int], dtype: torch.dtype) -> None:
        self._reader, self.name, self.shape, self.dtype = reader, name, torch.Size(shape), dtype

    def contiguous(self) -> torch.Tensor:
        return self._reader.read(self.name)

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={list(self.shape)}, dtype={self.dtype})"


class _Reader:
    """The checkpoint's files, open (and checked) once, closed when the last stand-in is dropped."""

    def __init__(self, path: str, index: dict[str, Any]) -> None:
        self.index = index
        self.saved = SavedTensors(path, index)
        weakref.finalize(self, self.saved.close)

    def read(self, name: str) -> torch.Tensor:
        if name in self.index["params"]:
            return self.saved.trainable(name)
        return self.saved.untracked(name)


def _checkpoint_path(checkpoint_dir: str, tag: str | None) -> str:
    if tag is None and not os.path.exists(os.path.join(checkpoint_dir, "latest")) and \
            os.path.isfile(os.path.join(checkpoint_dir, "index.json")):
        parent, name = os.path.split(os.path.abspath(checkpoint_dir))
        raise ValueError(f"{checkpoint_dir} is a checkpoint tag's directory; pass the directory above it ({parent}) "
                         f"and tag={name!r}, as DeepSpeed's zero_to_fp32 takes them")
    path = tag_path(checkpoint_dir, resolve_tag(checkpoint_dir, tag))
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "index.json")) and any(
            name.endswith("_model_states.pt") for name in os.listdir(path)):
        raise ValueError(f"{path} is a DeepSpeed checkpoint: run the zero_to_fp32.py DeepSpeed saved beside it, or "
                         "load it into a zerocore engine with engine.load_checkpoint and save that")
    return path


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, Any]:
    """The model's state dict from a zerocore checkpoint, on the CPU: fp32 masters, frozen parameters and
    persistent buffers as saved, tied parameters under each name (the module's docstring). ``lazy_mode``: stand-ins
    whose ``.contiguous()`` reads the tensor."""
    path = _checkpoint_path(os.fspath(checkpoint_dir), tag)
    index = read_index(path)
    reader = _Reader(path, index)
    state = {name: LazyTensor(reader, name, shape, dt)
             for name, shape, dt in model_entries(index, torch.float32, exclude_frozen_parameters)}
    if not lazy_mode:
        state = {name: value.contiguous() for name, value in state.items()}
    for alias, name in index.get("tied", {}).items():
        if name in state:
            state[alias] = state[name]
    return state


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str],
                                               output_dir: str | os.PathLike[str], max_shard_size: int | str = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[str]:
    """Writes the state dict into ``output_dir``: ``pytorch_model.bin`` (torch.save) or, with
    ``safe_serialization``, ``model.safetensors``; sharded above ``max_shard_size`` with an index, as DeepSpeed's
    (and ``save_pretrained``'s) names have it. Tied parameters are written once (Hugging Face's loaders tie them
    again). Returns the files written."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    _checkpoint_path(checkpoint_dir, tag)  # (the refusals with DeepSpeed's words)
    return to_hf(checkpoint_dir, os.fspath(output_dir), tag=tag, dtype="fp32",
                 max_shard_size=max_shard_size, overwrite=True, exclude_frozen_parameters=exclude_frozen_parameters,
                 safe_serialization=safe_serialization)


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike[str],
                                         tag: str | None = None) -> nn.Module:
    """DeepSpeed's: moves ``model`` to the CPU and loads the checkpoint's fp32 state dict into it (``strict=False``,
    as DeepSpeed loads it); returns the model. Not for a model inside an engine: close the engine first."""
    from ..._gathered import _engine_for

    if any(_engine_for(p) is not None for p in model.parameters()):
        raise ValueError("load_state_dict_from_zero_checkpoint: the model is inside a zerocore engine, whose shards "
                         "this would not change; use engine.load_checkpoint, or engine.close() first")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerocore.deepspeed.utils.zero_to_fp32",
                                     description="The fp32 model of a zerocore checkpoint, as DeepSpeed's "
                                                 "zero_to_fp32.py writes it.")
    parser.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote (holding 'latest' and the tags)")
    parser.add_argument("output_dir", help="where pytorch_model.bin (or model.safetensors) goes")
    parser.add_argument("--max_shard_size", type=_parse_size, default="5GB", help="shard above this (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true", help="safetensors instead of torch.save")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint tag (default: the one in 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    parser.add_argument("-d", "--debug", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        written = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    print("wrote " + ", ".join(os.path.join(args.output_dir, name) for name in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
