"""DeepSpeed's learning-rate schedules (the config's ``scheduler`` section) as torch LR schedulers.

Note [DeepSpeed schedule timing]
--------------------------------
DeepSpeed's schedulers (deepspeed/runtime/lr_schedules.py) are not torch schedulers: each keeps a
``last_batch_iteration`` that starts at -1, sets the optimizer's lr at construction to its value at -1, and
``step()`` moves it one on and sets the value there. DeepSpeed's engine calls ``step()`` after every applied
optimizer step and not after one skipped for an fp16 overflow; it never steps the scheduler at construction.
So optimizer step ``k`` (counting applied steps from 0) uses DeepSpeed's lr at ``last_batch_iteration = k - 1``.

A torch ``LRScheduler`` steps once at construction (``last_epoch`` 0) and once after every optimizer step, so
optimizer step ``k`` uses ``get_lr()`` at ``last_epoch = k``. The classes here compute DeepSpeed's formula at
``last_epoch - 1`` (exposed as ``last_batch_iteration``), which gives DeepSpeed's lr at every applied step,
including the values DeepSpeed sets before the first step (WarmupLR: ``warmup_min_lr``; WarmupCosineLR: 0;
OneCycle: ``cycle_min_lr`` and ``cycle_min_mom``). The engine steps ``engine.lr_scheduler`` exactly where
DeepSpeed does: after an optimizer step that was applied.

The formulas are DeepSpeed's, rewritten here; the tests check them value by value at many steps.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ._user_frames import user_stacklevel

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_lr_scheduler"]

_P = "scheduler.params."


def _per_group(value: Any, name: str, groups: int) -> list[float]:
    """A scalar for every group, or one value per group (DeepSpeed accepts both for its lr bounds)."""
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{_P}{name}: one value per optimizer param group expected ({groups} groups), "
                             f"got {len(value)}: {list(value)!r}")
        return [float(v) for v in value]
    return [float(value)] * groups


class _DeepSpeedSchedule(LRScheduler):
    """Base of the DeepSpeed schedules (Note [DeepSpeed schedule timing]): subclasses give
    ``_lrs_at(iteration)``, DeepSpeed's ``get_lr()`` at ``last_batch_iteration = iteration``."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int = -1) -> None:
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int) \
                or last_batch_iteration < -1:
            raise ValueError(f"{_P}last_batch_iteration: expected an int >= -1, got {last_batch_iteration!r}")
        kept = [(group["lr"], group.get("betas")) for group in optimizer.param_groups]
        super().__init__(optimizer, last_epoch=-1)
        if last_batch_iteration != -1:
            # DeepSpeed's: a schedule resumed at that iteration leaves the optimizer's lr (and OneCycle's
            # momentum) as they are until its next step, which sets them at last_batch_iteration + 1
            self.last_epoch = last_batch_iteration + 1
            for group, (lr, betas) in zip(optimizer.param_groups, kept):
                group["lr"] = lr
                if betas is not None:
                    group["betas"] = betas
            self._last_lr = [group["lr"] for group in optimizer.param_groups]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's state dict, or DeepSpeed's schedules' own (``{"last_batch_iteration": k}``, what a script
        switched from DeepSpeed saved in its client state): the position only, as DeepSpeed's load sets it."""
        if "last_epoch" not in state_dict and "last_batch_iteration" in state_dict:
            iteration = state_dict["last_batch_iteration"]
            if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < -1:
                raise ValueError(f"load_state_dict: last_batch_iteration must be an int >= -1, got {iteration!r}")
            self.last_epoch = iteration + 1
            return
        super().load_state_dict(state_dict)

    def step(self, last_batch_iteration: int | None = None, *, batch_iteration: int | None = None) -> None:
        """The next step; or, as DeepSpeed's ``step(last_batch_iteration)`` (``batch_iteration`` in OneCycle and
        LRRangeTest), the values at that iteration."""
        iteration = last_batch_iteration if last_batch_iteration is not None else batch_iteration
        if iteration is None:
            super().step()
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # (torch's: stepping to an epoch is deprecated there)
            super().step(iteration + 1)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's counter: -1 before the first applied optimizer step, then one more after each."""
        return self.last_epoch - 1

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return self._lrs_at(self.last_epoch - 1)

    def _get_closed_form_lr(self) -> list[float]:
        return self._lrs_at(self.last_epoch - 1)

    def _lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError


def _warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """The warmup fraction at ``iteration`` (< warmup_num_steps): log(i + 1) / log(n), or i / n (each
    computed in DeepSpeed's order of operations, so the values are DeepSpeed's to the last bit)."""
    if warmup_type == "log":
        return (1.0 / math.log(warmup_num_steps)) * math.log(iteration + 1)
    return iteration / warmup_num_steps


class WarmupLR(_DeepSpeedSchedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` (at least 2) optimizer steps,
    logarithmically (``warmup_type="log"``, DeepSpeed's default) or linearly, then constant.

    ``warmup_max_lr`` defaults to the first param group's lr, as in DeepSpeed. Either bound may be a list
    with one value per param group.
    """

    def __init__(self, optimizer: Optimizer, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        groups = len(optimizer.param_groups)
        if warmup_max_lr is None:
            warmup_max_lr = float(optimizer.param_groups[0]["lr"])
        self.min_lrs = _per_group(warmup_min_lr, "warmup_min_lr", groups)
        self.max_lrs = _per_group(warmup_max_lr, "warmup_max_lr", groups)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"{_P}warmup_type: expected 'log' or 'linear', got {warmup_type!r}")
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def _lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`'s warmup, then linear decay to 0 at ``total_num_steps``:
    ``max(0, (total - i) / max(1, total - warmup))`` of the way from ``warmup_min_lr`` to ``warmup_max_lr``.
    ``warmup_max_lr`` defaults to 0.001, as in DeepSpeed."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int,
                 warmup_min_lr: float | Sequence[float] = 0.0, warmup_max_lr: float | Sequence[float] = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = int(total_num_steps)
        if self.total_num_steps < max(2, int(warmup_num_steps)):
            warnings.warn(f"{_P}total_num_steps ({total_num_steps}) is less than warmup_num_steps "
                          f"({warmup_num_steps}); the lr decays from the first step after the warmup",
                          UserWarning, stacklevel=user_stacklevel())
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        remaining = float(self.total_num_steps - iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_DeepSpeedSchedule):
    """A ratio of each param group's lr (its lr when the scheduler is built): from ``warmup_min_ratio`` to 1
    over ``warmup_num_steps`` (at least 2) steps (log or linear), then a cosine from 1 down to
    ``cos_min_ratio`` at ``total_num_steps``, staying there after. 0 before the first step, as in DeepSpeed."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"{_P}warmup_type: expected 'log' or 'linear', got {warmup_type!r}")
        self.warmup_type = warmup_type
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"{_P}total_num_steps ({total_num_steps}) is less than warmup_num_steps "
                          f"({warmup_num_steps}); the lr drops to cos_min_ratio right after the warmup",
                          UserWarning, stacklevel=user_stacklevel())
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def lr_ratio(self, iteration: int) -> float:
        """The fraction of each group's lr at DeepSpeed's ``last_batch_iteration = iteration``."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            ratio = _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        done = iteration - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lrs_at(self, iteration: int) -> list[float]:
        ratio = self.lr_ratio(iteration)
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_DeepSpeedSchedule):
    """DeepSpeed's 1Cycle: one cycle of ``cycle_first_step_size`` steps up from ``cycle_min_lr`` to
    ``cycle_max_lr`` and ``cycle_second_step_size`` (default: the first) steps back down (optionally in
    stairs), then decay: ``cycle_min_lr / (1 + decay_lr_rate * steps_after_cycle / decay_step_size)``
    (none when ``decay_step_size`` or ``decay_lr_rate`` is 0).

    With ``cycle_momentum`` (the default) Adam's beta1 moves inversely, from ``cycle_max_mom`` down to
    ``cycle_min_mom`` and back, then ``cycle_max_mom * (1 + decay_mom_rate * steps_after_cycle /
    decay_step_size)``. As in DeepSpeed, every group's betas become ``(momentum, 0.99)``: beta2 is set to
    0.99 whatever the optimizer had (a warning says so when that changes it); set ``cycle_momentum`` to false
    to keep the optimizer's betas.
    """

    def __init__(self, optimizer: Optimizer, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        groups = len(optimizer.param_groups)
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (float(cycle_second_step_size) if cycle_second_step_size is not None
                                 else self.first_step_size)
        if self.first_step_size <= 0 or self.second_step_size < 0:
            raise ValueError(f"{_P}cycle_first_step_size must be >= 1 and cycle_second_step_size >= 0, got "
                             f"{cycle_first_step_size} and {cycle_second_step_size}")
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = int(cycle_first_stair_count)
        self.second_stair_count = (self.first_stair_count if cycle_second_stair_count is None
                                   else int(cycle_second_stair_count))
        self.decay_step_size = decay_step_size
        self.min_lrs = [float(cycle_min_lr)] * groups
        self.max_lrs = [float(cycle_max_lr)] * groups
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        self.cycle_min_mom, self.cycle_max_mom = float(cycle_min_mom), float(cycle_max_mom)
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        if self.cycle_momentum:
            changed = sorted({float(g["betas"][1]) for g in optimizer.param_groups} - {0.99})
            if changed:
                warnings.warn(f"{_P}cycle_momentum: OneCycle sets every param group's betas to (momentum, 0.99), "
                              f"as DeepSpeed does, replacing beta2 = {changed}; set scheduler.params."
                              "cycle_momentum to false to keep the optimizer's betas", UserWarning,
                              stacklevel=user_stacklevel())
        super().__init__(optimizer, last_batch_iteration)

    def _scale_factor(self, batch_iteration: int) -> float:
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # flat stairs, quantized from the integer position in the cycle (as DeepSpeed does)
            position = batch_iteration % self.total_size
            if position <= self.first_step_size:
                stair = position * stairs / self.first_step_size
            else:
                stair = (self.total_size - position) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def _lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        if iteration < self.total_size:
            scale = self._scale_factor(iteration + 1)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [low / factor for low in self.min_lrs]

    def momentum_at(self, iteration: int) -> float:
        """Adam's beta1 at DeepSpeed's ``last_batch_iteration = iteration``."""
        if iteration < 0:
            return self.cycle_min_mom
        if iteration < self.total_size:
            return self.cycle_max_mom - (self.cycle_max_mom - self.cycle_min_mom) * self._scale_factor(iteration + 1)
        if self.skip_mom_decay:
            return self.cycle_max_mom
        interval = (iteration - self.total_size + 1) / self.decay_step_size
        return self.cycle_max_mom * (1 + self.decay_mom_rate * interval)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        lrs = self._lrs_at(self.last_epoch - 1)
        self.apply_momentum()
        return lrs

    def apply_momentum(self) -> None:
        """With ``cycle_momentum``: every group's betas become (the momentum at this step, 0.99)."""
        if not self.cycle_momentum:
            return
        momentum = self.momentum_at(self.last_epoch - 1)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"{_P}decay_mom_rate: at step {self.last_epoch} OneCycle's momentum (Adam's beta1) "
                             f"would be {momentum}, outside [0, 1); lower decay_mom_rate or "
                             "cycle_max_mom, or set decay_mom_rate to 0")
        for group in self.optimizer.param_groups:
            group["betas"] = (momentum, 0.99)

    _get_closed_form_lr = get_lr


class LRRangeTest(_DeepSpeedSchedule):
    """The lr range test: ``lr_range_test_min_lr * (1 + lr_range_test_step_rate * interval)`` with
    ``interval = steps / lr_range_test_step_size`` (floored with ``lr_range_test_staircase``)."""

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        self.min_lrs = _per_group(lr_range_test_min_lr, "lr_range_test_min_lr", len(optimizer.param_groups))
        self.step_size = int(lr_range_test_step_size)
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def _lrs_at(self, iteration: int) -> list[float]:
        interval = float(iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1 + self.step_rate * interval) for low in self.min_lrs]


SCHEDULES: dict[str, type[_DeepSpeedSchedule]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}


def apply_current_values(scheduler: LRScheduler) -> None:
    """Gives the optimizer's param groups the values ``scheduler`` set at its last step: a
    ``load_state_dict`` restores the schedule's position but changes no group, so a fresh optimizer (a
    checkpoint loaded without its optimizer states) would run its next update with the schedule's first
    lr (WarmupLR's minimum, 0 by default) instead of the one it had reached."""
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    if isinstance(scheduler, OneCycle):
        scheduler.apply_momentum()
    elif getattr(scheduler, "cycle_momentum", False):
        # torch's OneCycleLR and CyclicLR set the momentum (beta1) as a side effect of get_lr(), at the position
        # load_state_dict restored; torch warns that get_lr() is meant for step(), which is what this replays
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            scheduler.get_lr()


def check_step_kwargs(scheduler: Any, lr_kwargs: Mapping[str, Any] | None) -> None:
    """The engine's lr scheduler's step must take ``lr_kwargs`` (``engine.step(lr_kwargs=...)``, as DeepSpeed's;
    a ReduceLROnPlateau needs its metrics): checked before the update, so a mismatch changes nothing instead of
    raising after the parameters moved."""
    if lr_kwargs is not None and not isinstance(lr_kwargs, Mapping):
        raise TypeError(f"step(lr_kwargs=...) takes a mapping of keyword arguments, got {type(lr_kwargs).__name__}")
    if scheduler is None:
        if lr_kwargs:
            raise ValueError(f"step(lr_kwargs={dict(lr_kwargs)!r}): the engine has no lr scheduler to pass them to; "
                             "nothing was changed")
        return
    try:
        inspect.signature(scheduler.step).bind(**(lr_kwargs or {}))
    except TypeError as error:
        raise TypeError(f"step(): the lr scheduler's step() ({type(scheduler).__name__}) cannot take "
                        f"lr_kwargs={dict(lr_kwargs or {})!r} ({error}): pass what it needs, as in "
                        "engine.step(lr_kwargs={'metrics': val_loss}) for ReduceLROnPlateau; nothing was changed") \
            from None
    except ValueError:  # a step() whose signature cannot be read: its own call decides
        pass


def build_lr_scheduler(config: Any, optimizer: Optimizer) -> LRScheduler | None:
    """The scheduler a :class:`~zerocore.config.SchedulerConfig` describes, over ``optimizer``; None for None.

    DeepSpeed's schedules are built from this module; any other type names a ``torch.optim.lr_scheduler``
    class, built with the params as keyword arguments, as DeepSpeed does.

    Raises:
        ValueError: naming the ``scheduler.params`` key a value does not fit (e.g. a per-group list of the
            wrong length), or, for a torch scheduler, what its constructor rejected.
    """
    if config is None:
        return None
    params: Mapping[str, Any] = config.params_dict
    cls = SCHEDULES.get(config.type)
    if cls is not None:
        return cls(optimizer, **params)
    torch_cls = getattr(torch.optim.lr_scheduler, config.type)
    try:
        return torch_cls(optimizer, **params)
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"scheduler.params: torch.optim.lr_scheduler.{config.type} rejected {dict(params)!r}: "
                         f"{e}") from e
