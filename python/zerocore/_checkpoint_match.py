"""The model against a checkpoint: which parameters, groups, buffers and frozen tensors a checkpoint must
hold to load into this engine (Note [Checkpoint format] in checkpoint.py). Every check raises naming what
differs, before the engine changes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ._model_checks import raise_together
from ._names import canonical, named_parameters

if TYPE_CHECKING:
    from .engine import Engine


def is_count(value: Any) -> bool:
    """A step or sample count as a checkpoint stores it: an int >= 0 (JSON's true is no count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def agree_on_reading(engine: Engine, problem: BaseException | None, what: str) -> None:
    """Every rank learns whether every rank read and checked the checkpoint, so all go on or all raise (none is
    left in a collective): raises this rank's ``problem``, or another rank's refusal of ``what``. A collective."""
    raise_together(engine.comm, problem, engine.device, lambda rank, message: ValueError(
        f"load_checkpoint: rank {rank} refused {what} ({message}); nothing was changed"))


def check_model(engine: Engine, index: Mapping[str, Any]) -> None:
    ours = trainable_shapes(engine)
    theirs = {name: tuple(shape) for name, shape in index["params"].items()}
    for name in sorted(set(ours) | set(theirs)):
        if name not in theirs:
            raise ValueError(f"checkpoint has no trainable parameter {name!r}: it was saved from another model")
        if name not in ours:
            raise ValueError(f"checkpoint holds parameter {name!r}, which this model does not train: it was saved "
                             "from another model")
        if ours[name] != theirs[name]:
            raise ValueError(f"parameter {name!r} has shape {list(theirs[name])} in the checkpoint but "
                             f"{list(ours[name])} in this model")
    counters = index["counters"]
    steps = optimizer_steps(counters)
    if not is_count(steps) or steps > counters["global_steps"]:
        raise ValueError(f"the index's counters.optimizer_steps ({steps!r}) must be a step count in "
                         f"[0, {counters['global_steps']}] (its global_steps): the index is damaged")
    samples = counters.get("global_samples", 0)
    if not is_count(samples):
        raise ValueError(f"the index's counters.global_samples ({samples!r}) must be a sample count >= 0: the index "
                         "is damaged")
    idle = counters.get("idle_steps", {})
    if not isinstance(idle, dict) or any(
            name not in ours or not isinstance(n, int) or not 0 < n <= steps for name, n in idle.items()):
        raise ValueError(f"the index's counters.idle_steps ({idle!r}) must map trainable parameter names to step "
                         f"counts in [1, {steps}]: the index is damaged")


def optimizer_steps(counters: dict[str, Any]) -> Any:
    """The optimizer's own update count; checkpoints written before it was recorded had it equal to
    ``global_steps``."""
    return counters.get("optimizer_steps", counters["global_steps"])


def global_steps(counters: dict[str, Any]) -> Any:
    """``engine.global_steps`` at the save, skipped fp16 steps included (DeepSpeed's count): checkpoints written
    before zerocore counted them so left them out."""
    if counters.get("global_steps_count_skipped"):
        return counters["global_steps"]
    return counters["global_steps"] + counters.get("skipped_steps", 0)


def group_names(engine: Engine) -> list[list[str]]:
    """The names of each param group's parameters (a tied parameter under its first name)."""
    names = {id(p): name for name, p in named_parameters(engine.module)}
    return [sorted(names[id(p)] for p in group["params"]) for group in engine.optimizer.param_groups]


def check_param_groups(engine: Engine, index: Mapping[str, Any]) -> None:
    """The saved groups' hyperparameters go to the groups holding the same parameters: refused when the
    groups differ (as torch's and DeepSpeed's optimizers refuse a state dict of other groups)."""
    saved = index["param_groups"]
    ours = group_names(engine)
    if not isinstance(saved, list) or len(saved) != len(ours):
        raise ValueError(f"the checkpoint has {len(saved) if isinstance(saved, list) else saved!r} param groups, this "
                         f"engine {len(ours)}: build the engine with the same param_groups, or load with "
                         "load_optimizer_states=False")
    theirs = index.get("param_group_names")  # absent from checkpoints written before it was saved
    if theirs is None:
        return
    for i, (mine, saved_names) in enumerate(zip(ours, theirs)):
        if sorted(saved_names) != mine:
            moved = sorted(set(mine) ^ set(saved_names))
            raise ValueError(f"param group {i} holds other parameters than in the checkpoint (e.g. {moved[:3]}): "
                             "build the engine with the same param_groups, or load with load_optimizer_states=False")


def check_untracked(ours: dict[str, torch.Tensor], index: Mapping[str, Any], model_file: Any, path: str,
                    persistent: set[str]) -> dict[str, torch.Tensor]:
    """``ours`` (this model's buffers and frozen parameters) checked against the checkpoint's, less the
    ``persistent=False`` buffers it does not hold: such a buffer is no state (a cache a module may create
    in its first forward, after the checkpoint's model had made it), so one on either side only is left as it
    is, as ``load_state_dict`` leaves it; those both hold are loaded."""
    theirs = {name: entry for name, entry in index["untracked"].items()
              if name in ours or entry.get("persistent", True)}
    ours = {name: tensor for name, tensor in ours.items() if name in theirs or name in persistent}
    if set(ours) != set(theirs):
        sides = [f"{where} only: {names[:8]}" for where, names in (
            ("in the checkpoint", sorted(set(theirs) - set(ours))), ("in this model", sorted(set(ours) - set(theirs))))
            if names]
        raise ValueError(f"buffers or frozen parameters differ between the checkpoint {path} and this model "
                         f"({'; '.join(sides)}): build the model as the saved one was (a buffer a module registers "
                         "in its first forward exists only after one)")
    for name, tensor in ours.items():
        if list(tensor.shape) != theirs[name]["shape"] or name not in model_file.header:
            raise ValueError(f"{name!r}: shape {theirs[name]['shape']} in the checkpoint, {list(tensor.shape)} here")
    return ours


def trainable_params(engine: Engine) -> dict[str, Any]:
    """The trainable parameters by the names the engine's buffers (and their optimizer shards) hold them under,
    in the buffers' order: the order every rank writes them in at a load."""
    return {name: param for buffer in engine.buffers for name, param in zip(buffer.names, buffer.params)}


def trainable_shapes(engine: Engine) -> dict[str, tuple[int, ...]]:
    """The trainable parameters' names (as the optimizer state's pieces name them) and global shapes."""
    trainable = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    return dict(sorted((name, tuple(p.shape)) for name, p in named_parameters(engine.module) if id(p) in trainable))


def persistent_names(engine: Engine) -> set[str]:
    """Names a state dict holds: parameters and persistent buffers (not ``persistent=False`` ones)."""
    names = {name for name, _ in named_parameters(engine.module, remove_duplicate=False)}
    for module_name, module in engine.module.named_modules(remove_duplicate=False):
        for name in module._buffers:
            if name not in module._non_persistent_buffers_set:
                names.add(canonical(f"{module_name}.{name}" if module_name else name))
    return names
