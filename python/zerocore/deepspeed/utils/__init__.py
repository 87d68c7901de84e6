"""``deepspeed.utils`` for scripts switched to zerocore: the ``safe_get_*`` / ``safe_set_*`` accessors of full and
local parameter state (zerocore's own, the same names), ``logger`` / ``log_dist``, the ZeRO-3 leaf-module marks,
and ``RepeatingLoader``; ``zero_to_fp32`` (its own file) reads the fp32 model out of a checkpoint.

``set_z3_leaf_modules(model, classes)`` marks every module of those classes (or class names) as DeepSpeed does
(its ``_z3_leaf`` flag), so a model marked for DeepSpeed is read the same way: a leaf is gathered whole (Note
[Stage 3 units]). Mark before ``initialize``, which fixes the units; a model marked after it has its units
already and a mark then raises rather than doing nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from ..._full_param_state import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                 safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state,
                                 safe_update_full_grad_vectorized)
from ..._local_param_state import (safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                                  safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state)

__all__ = [
    "RepeatingLoader", "get_z3_leaf_modules", "log_dist", "logger", "safe_get_full_fp32_param", "safe_get_full_grad",
    "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
    "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
    "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
    "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized", "set_z3_leaf_modules",
    "unset_z3_leaf_modules", "z3_leaf_module",
]

logger = logging.getLogger("zerocore.deepspeed")


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """DeepSpeed's: logs ``"[Rank r] message"`` on the ranks listed (``[-1]``: every rank); with no process group,
    always; with one and no ranks, nowhere."""
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else -1
    ranks = list(ranks or [])
    if not initialized or (ranks and (ranks[0] == -1 or rank in ranks)):
        logger.log(level, "[Rank %d] %s", rank, message)


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether the module ``model`` is marked a leaf (gathered whole); DeepSpeed's parameter name."""
    return getattr(model, "_z3_leaf", False) is True


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The marked modules of ``model``."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Iterable[type | str],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Marks the modules of ``model`` of these classes (types, subclasses included, or class names:
    ``"MixtralSparseMoeBlock"``, or qualified ``"module.Class"``) as leaves, gathered whole at stage 3; returns them.

    Raises:
        TypeError: an entry is neither a class nor a string.
        ValueError: ``raise_if_not_found`` and no module matches; or ``model`` is already in an engine.
    """
    return _mark(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Iterable[type | str],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Clears the marks :func:`set_z3_leaf_modules` set on the modules of these classes; returns them."""
    return _mark(model, leaf_module_classes, False, raise_if_not_found)


def _mark(model: nn.Module, classes: Iterable[type | str], flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    from ..._gathered import _engine_for

    classes = list(classes)
    for entry in classes:
        if not isinstance(entry, (type, str)):
            raise TypeError(f"leaf module classes must be classes or class names, got {entry!r}")
    if any(_engine_for(p) is not None for p in model.parameters()):
        raise ValueError("set_z3_leaf_modules: the model is already given to zerocore.initialize, whose stage 3 units "
                         "are fixed; mark the leaves before initialize")

    def matches(module: nn.Module) -> bool:
        kind = type(module)
        return any(isinstance(module, entry) if isinstance(entry, type)
                   else entry in (kind.__name__, f"{kind.__module__}.{kind.__qualname__}") for entry in classes)

    marked = [module for module in model.modules() if matches(module)]
    if not marked and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules: no module of {classes} in the model")
    for module in marked:
        module._z3_leaf = flag
    return marked


class RepeatingLoader:
    """DeepSpeed's: iterates a data loader (or any iterable) forever, starting it again when it ends."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
