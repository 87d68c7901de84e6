"""The tensors in what a stage-3 unit's forward returned, wherever the output keeps them.

The unit's pre-backward hook goes on the output tensors that require grad (Note [Stage 3 gather and
release]); a tensor the walk misses leaves the unit without a hook, and its backward would read freed
storage. torch's pytree sees lists, tuples, namedtuples, dicts and registered classes (transformers registers
its ModelOutput); the walk here also enters what users return without registering it: dataclasses, Mapping
subclasses and other containers that pytree leaves whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch.utils._pytree import tree_flatten

_MAX_DEPTH = 8  # a deeper structure is no model output; the walk stops rather than recurse without end


def output_leaves(output: Any) -> list[Any]:
    """Every leaf of ``output``: pytree's leaves, with unregistered dataclasses and mappings among them
    opened too (each object once)."""
    leaves: list[Any] = []
    seen: set[int] = set()
    _walk(output, leaves, seen, 0)
    return leaves


def _walk(value: Any, leaves: list[Any], seen: set[int], depth: int) -> None:
    for leaf in tree_flatten(value)[0]:
        if id(leaf) in seen:
            continue
        seen.add(id(leaf))
        if depth < _MAX_DEPTH and dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            _walk([getattr(leaf, f.name) for f in dataclasses.fields(leaf)], leaves, seen, depth + 1)
        elif depth < _MAX_DEPTH and isinstance(leaf, Mapping):
            _walk(list(leaf.values()), leaves, seen, depth + 1)
        else:
            leaves.append(leaf)
