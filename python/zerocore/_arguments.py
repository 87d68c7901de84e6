"""Checks of the low-level API's plain arguments (``zerocore.ops``, ``zerocore.layout``): a float, a bool or
None where an int or a tensor belongs is refused by name, instead of being truncated (``int(2.5)`` is 2,
``int(True)`` is 1) or failing deep inside with an AttributeError."""

from __future__ import annotations

import operator
from typing import Any

import torch


def as_int(name: str, value: Any) -> int:
    """``value`` as an int: ints and anything with ``__index__`` (numpy and 0-d integer tensors), not bools."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return operator.index(value)


def as_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def as_tensors(name: str, values: Any) -> list[torch.Tensor]:
    """A sequence of tensors as a list, every element checked (``grads[2] must be a torch.Tensor``)."""
    if isinstance(values, torch.Tensor) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of torch.Tensor, got {type(values).__name__}")
    values = list(values)
    for index, value in enumerate(values):
        as_tensor(f"{name}[{index}]", value)
    return values
