"""DeepSpeed's ``torch_autocast`` section: fp32 parameters, the forward under ``torch.autocast``.

Note [torch_autocast]
---------------------
DeepSpeed's alternative to its bf16/fp16 sections (and its replacement for the removed ``amp`` one): with
``{"torch_autocast": {"enabled": true, "dtype": "bfloat16"}}`` the parameters, their gradients and the optimizer
state stay fp32 (``bf16.enabled`` and ``fp16.enabled`` false), and the engine runs the module's forward under
``torch.autocast(device, dtype)``, so matmuls and convolutions compute in bf16 and their gradients arrive in
fp32. zerocore does the same (``Engine.forward``). A forward the script already runs under its own autocast
switches to the section's; without the section the script's autocast applies as under DDP (DeepSpeed turns it
off inside its forward, where the bf16/fp16 sections are its way).

What differs is only the wire: DeepSpeed reduces the gradients of ``lower_precision_safe_modules`` (default
``torch.nn.Linear`` and ``Conv1d/2d/3d``) in the autocast dtype and the others in fp32; zerocore reduces every
gradient in ``communication_data_type`` (fp32 unless set), so its sums are at least as exact, at up to twice
the bytes. The list is still checked (each entry a module class that imports, as DeepSpeed checks it) and kept,
so ``to_deepspeed`` writes it back. float16 is not supported yet: DeepSpeed pairs it with torch's GradScaler,
whose loss scaling zerocore's fp16 scaler does not reproduce; a missing ``dtype`` (DeepSpeed then takes
torch.autocast's default for the device: float16 on CUDA, bfloat16 on the CPU) is asked for by name. As in
DeepSpeed, it does not combine with ZeRO++'s quantized weights.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from ._config_values import as_bool, fail

# DeepSpeed's DtypeEnum spellings, by the dtype they name
_BF16 = ("torch.bfloat16", "bf16", "bfloat16", "bfloat")
_NOT_YET = ("torch.float16", "fp16", "float16", "half")
_NOT_LOWER = ("torch.float32", "fp32", "float32", "float")
DEFAULT_SAFE_MODULES = tuple(f"{cls.__module__}.{cls.__name__}"
                             for cls in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))


def autocast_from_deepspeed(section: Mapping[str, Any]) -> tuple[str | None, tuple[str, ...] | None]:
    """The section's dtype ("bf16", or None when it is disabled) and lower-precision module names; a dtype
    DeepSpeed would not read raises even when disabled, as in DeepSpeed."""
    enabled = as_bool(section.get("enabled", False), "torch_autocast.enabled")
    modules = section.get("lower_precision_safe_modules")
    modules = None if modules is None else check_safe_modules(modules)
    if "dtype" in section:
        _check_spelling(section["dtype"])
    if not enabled:
        return None, modules
    if "dtype" not in section:
        fail("torch_autocast.dtype", "missing; DeepSpeed then takes torch.autocast's default for the device "
             "(float16 on CUDA, bfloat16 on the CPU): name it (\"bfloat16\")")
    return autocast_dtype_name(section["dtype"]), modules


def autocast_dtype_name(value: Any) -> str:
    """``"bf16"`` for any of DeepSpeed's bfloat16 spellings; other dtypes raise naming why."""
    if value in _NOT_YET:
        fail("torch_autocast.dtype", f"{value!r} is not supported yet by zerocore: DeepSpeed pairs float16 autocast "
             "with torch's GradScaler, which zerocore's fp16 loss scaler does not reproduce; use \"bfloat16\", or "
             "the fp16 section (fp16 parameters and DeepSpeed's loss scaler)")
    if value in _NOT_LOWER:
        fail("torch_autocast.dtype", f"{value!r} computes in the parameters' own dtype: leave torch_autocast "
             "disabled instead")
    _check_spelling(value)
    return "bf16"


def _check_spelling(value: Any) -> None:
    """A dtype DeepSpeed reads at all (its DtypeEnum's spellings), whether enabled or not."""
    if value not in _BF16 + _NOT_YET + _NOT_LOWER:
        fail("torch_autocast.dtype", f"expected one of {', '.join(map(repr, _BF16))}, got {value!r}")


def check_safe_modules(names: Any) -> tuple[str, ...]:
    """DeepSpeed's ``lower_precision_safe_modules``: importable ``package.Class`` names of module classes."""
    path = "torch_autocast.lower_precision_safe_modules"
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence) or not all(
            isinstance(name, str) for name in names):
        fail(path, f"expected a list of module class names (\"torch.nn.Linear\"), got {names!r}")
    for name in names:
        package, _, class_name = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(package), class_name) if package else None
        except (ImportError, AttributeError, ValueError):
            cls = None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            fail(path, f"{name!r} is not an importable module class (give its package and class, as "
                 "\"torch.nn.Linear\")")
    return tuple(names)
