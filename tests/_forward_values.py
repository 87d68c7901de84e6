"""What each module's forward ran with: the ZeRO++ tests compare it with what qwZ's gather must produce."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def recorded_forward_values(model: nn.Module, include: Callable[[nn.Module], bool] = lambda module: True
                            ) -> Iterator[dict[str, torch.Tensor]]:
    """Yields a dict that every forward inside the block fills with a copy of each parameter a module holds
    itself, under its full name, as the module's forward sees it. Register after ``initialize``: the hooks then
    run after the engine's own (its gather). ``include`` picks the modules; the hooks go at the block's end."""
    seen: dict[str, torch.Tensor] = {}

    def record(prefix: str) -> Callable[..., None]:
        return lambda module, args: seen.update(
            {prefix + name: p.detach().clone() for name, p in module.named_parameters(recurse=False)})

    hooks = [module.register_forward_pre_hook(record(f"{name}." if name else ""))
             for name, module in model.named_modules()
             if next(module.parameters(recurse=False), None) is not None and include(module)]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()
