"""Materialize a model built on the meta device, unit by unit, without ever holding it whole.

Modules are initialized children first (the order in which torch modules' constructors initialize, so a
seeded RNG draws the same numbers as for an unsharded model): each module's tensors are allocated for real, initialized by
``init_fn(module)`` or the module's own ``reset_parameters()``, and as soon as the last module touching a
unit is done, the unit is sharded and its full buffer freed. Peak memory: the units still open (the
root's and the current block's) plus the shards. Nothing in torch or ``nn.Module`` is patched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ._stage3 import Unit


def _materialize_direct(module: nn.Module, device: torch.device) -> None:
    """Allocates the module's own meta parameters and buffers on `device` (values unset)."""
    for name, param in module._parameters.items():
        if param is not None and param.is_meta:
            # swap_tensors keeps the Parameter object (the units, the optimizer and the user hold it);
            # `.data =` cannot move a tensor off the meta device.
            real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, real)
    for name, buffer in module._buffers.items():
        if buffer is not None and buffer.is_meta:
            module._buffers[name] = torch.empty_like(buffer, device=device)


def _initialize(module: nn.Module, init_fn: Callable[[nn.Module], None] | None, initialized: set[int]) -> None:
    """Runs the module's initializer, keeping the values of parameters an earlier module initialized (tied
    weights): the initializer still runs over them, so the RNG advances exactly as it did when the
    unsharded model was built and the tie came after both initializations."""
    params = [p for p in module.parameters(recurse=False)]
    # torch's MultiheadAttention names its initializer _reset_parameters.
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if init_fn is None and reset is None:
        if any(p.requires_grad for p in params):
            raise ValueError(
                f"module {type(module).__name__} has parameters built on the meta device but no "
                "reset_parameters(); pass init_fn=... to initialize() to initialize it"
            )
        return
    saved = [(p, p.detach().clone()) for p in params if id(p) in initialized]
    if init_fn is not None:
        init_fn(module)
    else:
        reset()
    with torch.no_grad():
        for param, value in saved:
            param.copy_(value)
    initialized.update(id(p) for p in params)


def _post_order(model: nn.Module) -> list[nn.Module]:
    """Children before parents: torch modules run reset_parameters() at the end of __init__, after their
    children were built (MultiheadAttention initializes out_proj, then its own in_proj_weight)."""
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        order.append(module)

    visit(model)
    return order


def materialize_units(model: nn.Module, units: list[Unit], device: torch.device,
                      init_fn: Callable[[nn.Module], None] | None) -> None:
    owner = {id(p): unit for unit in units for p in unit.params}
    modules = _post_order(model)
    last_use: dict[int, int] = {}
    for position, module in enumerate(modules):
        for tensor in module.parameters(recurse=False):
            if id(tensor) in owner:
                last_use[owner[id(tensor)].index] = position
    initialized: set[int] = set()
    for position, module in enumerate(modules):
        direct = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if any(t.is_meta for t in direct):
            _materialize_direct(module, device)
            _initialize(module, init_fn, initialized)
        for unit in units:
            if last_use.get(unit.index) == position:
                unit.build_from([p.detach() for p in unit.params])  # takes the shard, frees the values
