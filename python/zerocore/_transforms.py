"""The engine's own bookkeeping under ``torch.func`` transforms (grad, vjp, jacrev, vmap, functional_call).

Note [torch.func transforms]
----------------------------
A model run through the engine inside a ``torch.func`` transform runs the engine's hooks inside the
transform too: stage 3 gathers and releases units and exchanges divergence tags from forward pre-hooks
and backward hooks. Those are plain tensors the engine owns (the flat buffers, the shards, the tags), not
values of the transformed function, so they must not be seen by the transform: under ``grad``/``vjp``
every in-place write to a tensor created outside the transform (``copy_`` into a unit's buffer, resizing
its storage) raises "attempted to call in-place operation that would mutate a captured Tensor", and a tag
created inside the transform would be a functorch wrapper handed to a collective. So every entry point of
that bookkeeping runs with the functorch dispatch keys excluded (``torch._C._DisableFuncTorch``, as FSDP2's
``_disable_functorch_if_active`` does): the engine's tensors are plain and its writes are ordinary writes,
while the model's computation on the gathered parameters stays inside the transform, which sees the
parameters as captured constants (or, with ``functional_call``, the tensors passed in). Outside a transform
the guard costs one thread-local check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_F = TypeVar("_F", bound=Callable[..., Any])


def outside_transforms(fn: _F) -> _F:
    """Runs ``fn`` with functorch's transforms out of the way (Note [torch.func transforms])."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _unwrap_once(tensor: torch.Tensor) -> torch.Tensor | None:
    functorch = torch._C._functorch
    if functorch.is_batchedtensor(tensor) or functorch.is_gradtrackingtensor(tensor):
        return functorch.get_unwrapped(tensor)
    return None


def wrapped_values(outputs: list[Any]) -> list[torch.Tensor]:
    """Inside a transform, the tensors under each functorch wrapper among ``outputs`` that require grad:
    the values an enclosing transform's backward, or the regular autograd's (``engine.backward`` of a loss
    computed under ``vmap`` or from a ``torch.func.grad`` result), goes through. A stage-3 unit registers its
    pre-backward hook on them too, besides the outputs themselves; outside a transform there are none."""
    if not torch._C._are_functorch_transforms_active():
        return []
    found = []
    for output in outputs:
        if not isinstance(output, torch.Tensor):
            continue
        inner = _unwrap_once(output)
        while inner is not None:
            if inner.requires_grad:
                found.append(inner)
            inner = _unwrap_once(inner)
    return found
