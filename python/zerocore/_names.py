"""Parameter and buffer names as the engine writes and matches them.

Note [Names without wrappers]
-----------------------------
``torch.compile(block)`` puts a block's parameters under ``_orig_mod`` (``layers.0._orig_mod.attn.weight``)
and torch's ``checkpoint_wrapper`` under ``_checkpoint_wrapped_module``. Checkpoints, state dicts and 16-bit
exports name every tensor without those segments, as torch.distributed.checkpoint's state dicts do: a model
saved compiled loads uncompiled and the other way round, and an export loads into the Hugging Face class
(with the segments its keys matched nothing there, and ``from_pretrained`` initialized those weights anew).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})


def canonical(name: str) -> str:
    """``name`` without the wrappers' segments (Note [Names without wrappers])."""
    if not any(segment in name for segment in _WRAPPER_SEGMENTS):
        return name
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def named_parameters(module: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
    for name, param in module.named_parameters(remove_duplicate=remove_duplicate):
        yield canonical(name), param


def named_buffers(module: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    for name, buffer in module.named_buffers(remove_duplicate=remove_duplicate):
        yield canonical(name), buffer


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """Each name under which a parameter is reached again (a head tied to the embedding), to its first name:
    the name checkpoints and state dicts hold it under."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in named_parameters(module, remove_duplicate=False):
        if id(param) in first:
            if name != first[id(param)]:
                aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases
