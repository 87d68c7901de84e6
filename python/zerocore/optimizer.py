"""The engine's optimizer as a ``torch.optim.Optimizer``, so lr schedulers and code that reads
``param_groups`` work unchanged. Its state is sharded and lives in the engine's flat groups."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ._user_frames import user_stacklevel

if TYPE_CHECKING:
    from .engine import Engine

# The param-group hyperparameters zerocore's Adam shares with torch's Adam/AdamW and DeepSpeed's: what moves
# between zerocore and their checkpoints and optimizers (DCP and DeepSpeed loads and exports, deepspeed.initialize).
ADAM_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
# torch's Adam/AdamW group flags: how torch runs its step, or, for amsgrad, maximize and decoupled_weight_decay,
# what it computes (_model_checks.check_group_hyperparameters refuses what zerocore's Adam would not do)
TORCH_ADAM_FLAGS = ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable",
                    "decoupled_weight_decay")
# what zerocore's Adam reads from a group; any other key is the script's own (own_group_keys)
ADAM_GROUP_KEYS = ("params", *ADAM_HYPERPARAMETERS, "adamw_mode", "bias_correction")


def own_group_keys(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's keys of the script's own (BEiT's ``lr_scale``, a scheduler's ``initial_lr``): none that
    zerocore's Adam reads and none of torch's flags. An export carries them: torch's load replaces a group with
    the saved one (DeepSpeed's universal load sets its groups' keys from the saved ones)."""
    return {key: value for key, value in group.items() if key not in (*ADAM_GROUP_KEYS, *TORCH_ADAM_FLAGS)}


def as_json_value(value: Any) -> Any:
    """A group value as JSON holds it: a one-element tensor as its number, a tuple as a list."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:  # torch's optimizers take a tensor lr (and betas)
        return value.item()
    if isinstance(value, (tuple, list)):
        return [as_json_value(v) for v in value]
    return value


def group_for_saving(group: Mapping[str, Any], index: int) -> dict[str, Any]:
    """A param group's values (all but ``params``) as a checkpoint's index.json holds them: a one-element tensor
    as its number, tuples as lists. A value JSON cannot hold (a key of the script's own) is left out with a
    warning: the hyperparameters zerocore's Adam reads are numbers, and the loading engine's group keeps its own
    value of that key."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        value = as_json_value(value)
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError):
            warnings.warn(f"save_checkpoint: optimizer.param_groups[{index}][{key!r}] is a {type(value).__name__}, "
                          "which a checkpoint's index.json cannot hold: not saved (a load keeps the loading "
                          "engine's value of it)", UserWarning, stacklevel=user_stacklevel())
            continue
        out[key] = value
    return out


def set_group_value(group: dict[str, Any], key: str, value: Any) -> None:
    """A loaded hyperparameter into a param group: into a tensor lr in place (what a compiled step or a torch
    scheduler holds), betas as a tuple, anything else as it is."""
    current = group.get(key)
    if isinstance(current, torch.Tensor) and current.numel() == 1 and isinstance(value, (int, float)) \
            and not isinstance(value, bool):
        current.fill_(value)
    else:
        group[key] = tuple(value) if key == "betas" and isinstance(value, (list, tuple)) else value


class ZeroOptimizer(torch.optim.Optimizer):
    """Sharded Adam/AdamW. ``param_groups`` hold the model's parameters and the hyper-parameters the next
    step uses (``lr``, ``betas``, ``eps``, ``weight_decay``, ``adamw_mode``, ``bias_correction``)."""

    def __init__(self, engine: Engine, groups: list[dict[str, Any]]) -> None:
        first = groups[0]
        defaults = {key: first[key] for key in (*ADAM_HYPERPARAMETERS, "adamw_mode", "bias_correction")}
        super().__init__([dict(g) for g in groups], defaults)
        self._engine = engine
        # each group's parameters as zerocore.initialize laid them out, in order: the step updates these with
        # the hyper-parameters of the group at the same position, whatever param_groups say by then
        self._laid_out = [tuple(map(id, group["params"])) for group in self.param_groups]
        # DeepSpeed's optimizers' flag: whether the last accumulation boundary's step was skipped for an fp16
        # overflow (what Accelerate's DeepSpeedOptimizerWrapper.step_was_skipped reads); set by the engine
        self.overflow = False

    @property
    def loss_scale(self) -> float:
        """DeepSpeed's fp16 optimizers' current loss scale (1.0 outside fp16)."""
        return self._engine.loss_scaler.scale

    @property
    def cur_scale(self) -> float:
        return self.loss_scale

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused once the engine is built: its parameters' shards, gradient buckets and optimizer state are
        laid out at ``zerocore.initialize``, so a group added later would never be updated.

        Raises:
            RuntimeError: always, after construction, naming ``param_groups=`` of ``zerocore.initialize``.
        """
        if getattr(self, "_engine", None) is None:  # torch.optim.Optimizer.__init__ adds the initial groups
            super().add_param_group(param_group)
            return
        raise RuntimeError(
            "optimizer.add_param_group() is not supported by a zerocore engine: its param groups are fixed at "
            "zerocore.initialize(), where each parameter's shard and optimizer state are laid out. Pass every group "
            "up front with zerocore.initialize(model, config, param_groups=[{'params': [...], 'lr': ...}, ...]) "
            "(a group that should not train yet can start with lr=0.0 and be raised later through "
            "optimizer.param_groups[i]['lr'])"
        )

    def layout_problem(self) -> str | None:
        """What in ``param_groups`` no longer matches the groups laid out at ``zerocore.initialize`` (a group
        appended or removed by hand, a group's ``params`` list edited), or None. The step would go on updating
        the laid-out parameters with whichever group now sits at each position: training otherwise than the
        groups say, so the step is refused instead."""
        fix = ("the engine's shards and optimizer state are laid out at zerocore.initialize: pass the groups you "
               "want to zerocore.initialize(model, config, param_groups=...); to stop training parameters, set "
               "their requires_grad=False or their group's lr to 0")
        if len(self.param_groups) != len(self._laid_out):
            return (f"optimizer.param_groups holds {len(self.param_groups)} groups, but zerocore.initialize laid out "
                    f"{len(self._laid_out)}: {fix}")
        for index, (group, ids) in enumerate(zip(self.param_groups, self._laid_out)):
            params = group.get("params")
            if not isinstance(params, (list, tuple)) or tuple(map(id, params)) != ids:
                return f"optimizer.param_groups[{index}]['params'] changed after zerocore.initialize: {fix}"
        return None

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Refused: torch's format would hold no moments or master weights (they are sharded across ranks),
        a silently partial state. Use ``engine.save_checkpoint(dir)`` / ``engine.load_checkpoint(dir)``."""
        raise RuntimeError(
            "engine.optimizer.state_dict() would hold none of the sharded Adam state (moments and fp32 master "
            "weights live in shards across ranks): use engine.save_checkpoint(save_dir) and "
            "engine.load_checkpoint(load_dir), which save and restore it (at any world size and stage)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        raise RuntimeError(
            "engine.optimizer.load_state_dict() cannot restore the sharded Adam state: use "
            "engine.load_checkpoint(load_dir) on a checkpoint written by engine.save_checkpoint(save_dir)")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Applies the sharded update. Called by ``engine.step()`` at the accumulation boundary."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step() takes no closure; use engine.backward() then engine.step()")
        self._engine.apply_update()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad()
