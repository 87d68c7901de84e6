"""The value checks every config section uses: each returns the value as stored, or raises ``ValueError``
naming its DeepSpeed key path (``"zero_optimization.stage"``) and what is accepted."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

INT64_MAX = 2**63 - 1  # the largest element count the C++ core (int64_t) takes
INT32_MAX = 2**31 - 1  # the largest queue depth / thread count the C++ I/O engine (int) takes

def fail(path: str, message: str) -> None:
    raise ValueError(f"{path}: {message}")


def no_auto(value: Any, path: str) -> None:
    if isinstance(value, str) and value == "auto":
        fail(path, '"auto" is a Hugging Face Trainer placeholder that the Trainer fills in before DeepSpeed '
             "sees the config; zerocore needs the actual value")


def as_bool(value: Any, path: str) -> bool:
    no_auto(value, path)
    if not isinstance(value, bool):
        fail(path, f"expected true or false, got {value!r}")
    return value


def as_int(value: Any, path: str, minimum: int, maximum: int | None = None) -> int:
    no_auto(value, path)
    wanted = f"an integer >= {minimum}" + ("" if maximum is None else f" and <= {maximum}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(path, f"expected {wanted}, got {value!r}")
    if not isinstance(value, numbers.Integral):
        if not (math.isfinite(value) and float(value).is_integer()):
            fail(path, f"expected {wanted} (a float only when integral, like 5e8), got {value!r}")
    result = int(value)
    if result < minimum or (maximum is not None and result > maximum):
        fail(path, f"expected {wanted}, got {value!r}")
    return result


def as_float(value: Any, path: str, minimum: float, *, above: bool = False, below: float | None = None) -> float:
    no_auto(value, path)
    wanted = f"a finite number {'>' if above else '>='} {minimum:g}" + ("" if below is None else f" and < {below:g}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(path, f"expected {wanted}, got {value!r}")
    result = float(value)
    if (not math.isfinite(result) or result < minimum or (above and result == minimum)
            or (below is not None and result >= below)):
        fail(path, f"expected {wanted}, got {value!r}")
    return result


def as_choice(value: Any, path: str, choices: Mapping[str, str]) -> str:
    no_auto(value, path)
    if not isinstance(value, str) or value.lower() not in choices:
        accepted = ", ".join(repr(c) for c in choices.values())
        fail(path, f"expected one of {accepted} (case-insensitive), got {value!r}")
    return choices[value.lower()]
