"""The learning-rate schedule section (DeepSpeed ``scheduler``): :class:`SchedulerConfig` and the params each
of DeepSpeed's schedules accepts. The schedules themselves are in lr_schedules.py."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._config_values import as_bool, as_float, as_int, fail, no_auto

# scheduler.params per DeepSpeed schedule type: name -> (kind, minimum); kinds: "lr" (a number >= 0, or one per
# param group), "float", "int", "int?" (an int or null), "bool", "mom" (in [0, 1)), "warmup_type".
_WARMUP = {"warmup_min_lr": ("lr", 0), "warmup_max_lr": ("lr", 0), "warmup_num_steps": ("int", 1),
           "warmup_type": ("warmup_type", None), "last_batch_iteration": ("start", None)}
_SCHEDULE_PARAMS: dict[str, dict[str, tuple[str, Any]]] = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {**_WARMUP, "total_num_steps": ("int", 1)},
    "WarmupCosineLR": {"total_num_steps": ("int", 1), "warmup_min_ratio": ("float", 0), "warmup_num_steps": ("int", 1),
                       "cos_min_ratio": ("float", 0), "warmup_type": ("warmup_type", None),
                       "last_batch_iteration": ("start", None)},
    "OneCycle": {"cycle_min_lr": ("float", 0), "cycle_max_lr": ("float", 0), "decay_lr_rate": ("float", 0),
                 "cycle_first_step_size": ("int", 1), "cycle_second_step_size": ("int?", 0),
                 "cycle_first_stair_count": ("int", -1), "cycle_second_stair_count": ("int?", -1),
                 "decay_step_size": ("int", 0), "cycle_momentum": ("bool", None), "cycle_min_mom": ("mom", None),
                 "cycle_max_mom": ("mom", None), "decay_mom_rate": ("float", 0),
                 "last_batch_iteration": ("start", None)},
    "LRRangeTest": {"lr_range_test_min_lr": ("lr", 0), "lr_range_test_step_size": ("int", 1),
                    "lr_range_test_step_rate": ("float", 0), "lr_range_test_staircase": ("bool", None),
                    "last_batch_iteration": ("start", None)},
}
_REQUIRED_PARAMS = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",),
                    "OneCycle": ("cycle_min_lr", "cycle_max_lr")}
# Schedulers torch has that a JSON config cannot drive (they take callables, other schedulers, or a metric).
_TORCH_SCHEDULERS_NOT_FROM_JSON = frozenset({"LRScheduler", "_LRScheduler", "LambdaLR", "MultiplicativeLR",
                                             "SequentialLR", "ChainedScheduler", "ReduceLROnPlateau"})


def _scheduler_value(value: Any, path: str, kind: str, minimum: Any) -> Any:
    if kind == "lr":
        if isinstance(value, (list, tuple)):
            if not value:
                fail(path, "expected a number >= 0, or a non-empty list of them (one per param group), got []")
            return tuple(as_float(v, f"{path}[{i}]", 0.0) for i, v in enumerate(value))
        return as_float(value, path, 0.0)
    if kind == "float":
        return as_float(value, path, float(minimum))
    if kind == "mom":
        return as_float(value, path, 0.0, below=1.0)
    if kind == "int":
        return as_int(value, path, minimum)
    if kind == "int?":
        return None if value is None else as_int(value, path, minimum)
    if kind == "bool":
        return as_bool(value, path)
    if kind == "warmup_type":
        no_auto(value, path)
        if value not in ("log", "linear"):  # DeepSpeed would fall back to "log" for anything else
            fail(path, f"expected 'log' or 'linear' (lower case), got {value!r}")
        return value
    # "start": DeepSpeed's last_batch_iteration; only a fresh start (-1) is accepted.
    no_auto(value, path)
    if value != -1 or isinstance(value, bool):
        fail(path, f"only -1 (start from the beginning) is accepted, got {value!r}; to resume a schedule, "
             "call engine.lr_scheduler.load_state_dict(...) with the state_dict() saved from it")
    return None


@dataclass(frozen=True)
class SchedulerConfig:
    """A learning-rate schedule (DeepSpeed ``scheduler``: ``{"type": ..., "params": {...}}``), built by the
    engine as ``engine.lr_scheduler`` and stepped after every applied optimizer step (see
    :mod:`zerocore.lr_schedules`).

    Attributes:
        type: one of DeepSpeed's ``"WarmupLR"``, ``"WarmupDecayLR"``, ``"WarmupCosineLR"``, ``"OneCycle"``,
            ``"LRRangeTest"`` (case-insensitive on input, stored in this spelling), or, as DeepSpeed allows,
            the name of a ``torch.optim.lr_scheduler`` class whose arguments JSON can give (e.g. ``"StepLR"``).
        params: the schedule's keyword arguments; a mapping on input, stored as sorted ``(name, value)`` pairs
            (so the config stays hashable); :attr:`params_dict` gives them as a dict. DeepSpeed schedules'
            params are validated here (unknown or missing keys, ranges); a torch scheduler's when it is built.

    Raises:
        ValueError: naming the key path (``scheduler.params.warmup_num_steps``) of the first invalid value.
    """

    type: str
    params: Any = ()

    def __post_init__(self) -> None:
        no_auto(self.type, "scheduler.type")
        names = {name.lower(): name for name in _SCHEDULE_PARAMS}
        if isinstance(self.type, str) and self.type.lower() in names:
            object.__setattr__(self, "type", names[self.type.lower()])
        elif not (isinstance(self.type, str) and self.type not in _TORCH_SCHEDULERS_NOT_FROM_JSON
                  and isinstance(getattr(torch.optim.lr_scheduler, self.type, None), type)
                  and issubclass(getattr(torch.optim.lr_scheduler, self.type), torch.optim.lr_scheduler.LRScheduler)):
            fail("scheduler.type", f"expected one of {', '.join(repr(n) for n in _SCHEDULE_PARAMS)} (DeepSpeed's "
                 "schedules, case-insensitive) or the name of a torch.optim.lr_scheduler class that takes "
                 f"plain values (such as 'StepLR'), got {self.type!r}")
        params = self.params
        if isinstance(params, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in params):
            params = dict(params)
        if not isinstance(params, Mapping):
            fail("scheduler.params", f"expected a JSON object (a mapping), got {params!r}")
        schema = _SCHEDULE_PARAMS.get(self.type)
        out: dict[str, Any] = {}
        for key, value in params.items():
            path = f"scheduler.params.{key}"
            if not isinstance(key, str):
                fail("scheduler.params", f"keys must be strings, got {key!r}")
            if schema is None:  # a torch scheduler: its constructor checks the values when the engine builds it
                no_auto(value, path)
                out[key] = tuple(value) if isinstance(value, list) else value
                continue
            if key not in schema:
                close = difflib.get_close_matches(key, list(schema), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                fail(path, f"unknown key for {self.type}{hint}; accepted keys: {', '.join(sorted(schema))}")
            kind, minimum = schema[key]
            checked = _scheduler_value(value, path, kind, minimum)
            if kind != "start":
                out[key] = checked
        for key in _REQUIRED_PARAMS.get(self.type, ()):
            if key not in out:
                fail(f"scheduler.params.{key}", f"required by {self.type} (DeepSpeed has no default for it)")
        object.__setattr__(self, "params", tuple(sorted(out.items())))

    @property
    def params_dict(self) -> dict[str, Any]:
        """The params as keyword arguments (per-group lists as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.params}
