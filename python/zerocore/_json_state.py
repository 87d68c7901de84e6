"""Python state (an lr scheduler's ``state_dict()``, a user's ``client_state``) as JSON that reads back equal.

A checkpoint pickles nothing, but plain ``json.dumps`` changes what it cannot express: MultiStepLR's
milestones are a ``Counter`` of int keys that would come back with str keys (so no milestone would ever match
again and the lr would silently stop decaying after a resume), tuples would come back as lists. Those values
are written as tagged objects (``{"__zerocore__": "counter", "items": [[key, value], ...]}``) and rebuilt on
load; anything else that is not JSON (an object, a function) is refused at save, naming where it is.
Files written before this encoding hold plain JSON, which decodes to itself.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from typing import Any

import torch

_TAG = "__zerocore__"


def encode(value: Any, where: str) -> Any:
    """``value`` as JSON-serializable data that :func:`decode` turns back into an equal value.

    Raises:
        TypeError: naming ``where`` and the path inside ``value`` of the first value JSON cannot hold.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {_TAG: "float", "value": repr(value)}
    if isinstance(value, (list, tuple)):
        items = [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if type(value) is list else {_TAG: "tuple", "items": items}
    if isinstance(value, Mapping):
        kind = "counter" if isinstance(value, collections.Counter) else "dict"
        if kind == "dict" and type(value) is dict and all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {_TAG: kind, "items": [[encode(k, f"{where} key {k!r}"), encode(v, f"{where}[{k!r}]")]
                                      for k, v in value.items()]}
    if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_complex():
        return {_TAG: "tensor", "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                "values": encode(value.detach().cpu().reshape(-1).tolist(), where)}
    raise TypeError(f"{where} holds {type(value).__name__} {_short(value)}, which a checkpoint cannot store "
                    "(nothing is pickled; accepted: None, bool, int, float, str, list, tuple, dict, Counter and "
                    "real tensors)")


def decode(data: Any) -> Any:
    """The value :func:`encode` was given."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    kind = data.get(_TAG)
    if kind is None:
        return {k: decode(v) for k, v in data.items()}
    if kind == "float":
        return float(data["value"])
    if kind == "tuple":
        return tuple(decode(v) for v in data["items"])
    if kind in ("dict", "counter"):
        pairs = [(decode(k), decode(v)) for k, v in data["items"]]
        return collections.Counter(dict(pairs)) if kind == "counter" else dict(pairs)
    if kind == "tensor":
        values = decode(data["values"])
        return torch.tensor(values, dtype=getattr(torch, data["dtype"])).reshape(data["shape"])
    raise ValueError(f"unknown tagged value {kind!r} in a checkpoint's JSON (written by a newer zerocore?)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
