"""The model against a checkpoint: which parameters, groups, buffers and frozen tensors a checkpoint must
hold to load into this engine (Note [Checkpoint format] in checkpoint.py). Every check raises naming what
differs, before the engine changes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .engine import Engine


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
    idle = counters.get("idle_steps", {})
    if not isinstance(idle, dict) or any(
            name not in ours or not isinstance(n, int) or not 0 < n <= counters["global_steps"] for name, n in idle.items()):
        raise ValueError(f"the index's counters.idle_steps ({idle!r}) must map trainable parameter names to step "
                         f"counts in [1, {counters['global_steps']}]: the index is damaged")


def group_names(engine: Engine) -> list[list[str]]:
    """The names of each param group's parameters (a tied parameter under its first name)."""
    names = {id(p): name for name, p in engine.module.named_parameters()}
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


def check_untracked(ours: dict[str, torch.Tensor], index: Mapping[str, Any], model_file: Any, path: str) -> None:
    theirs = index["untracked"]
    if set(ours) != set(theirs):
        diff = sorted(set(ours) ^ set(theirs))
        raise ValueError(f"buffers or frozen parameters differ between the checkpoint {path} and this model: {diff}")
    for name, tensor in ours.items():
        if list(tensor.shape) != theirs[name]["shape"] or name not in model_file.header:
            raise ValueError(f"{name!r}: shape {theirs[name]['shape']} in the checkpoint, {list(tensor.shape)} here")


def trainable_shapes(engine: Engine) -> dict[str, tuple[int, ...]]:
    """The trainable parameters' names (as the optimizer state's pieces name them) and global shapes."""
    trainable = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    return dict(sorted((name, tuple(p.shape)) for name, p in engine.module.named_parameters() if id(p) in trainable))


def persistent_names(engine: Engine) -> set[str]:
    """Names a state dict holds: parameters and persistent buffers (not ``persistent=False`` ones)."""
    names = {name for name, _ in engine.module.named_parameters(remove_duplicate=False)}
    for module_name, module in engine.module.named_modules(remove_duplicate=False):
        for name in module._buffers:
            if name not in module._non_persistent_buffers_set:
                names.add(f"{module_name}.{name}" if module_name else name)
    return names


def untracked_state(engine: Engine, frozen: bool = True) -> dict[str, torch.Tensor]:
    """Buffers and (with ``frozen``) frozen parameters by state-dict name (each tensor once). A frozen
    parameter stage 3 shards is the parameter itself (its shape is right, its values are not here:
    ``whole_frozen_values`` and ``load_untracked``)."""
    trainable = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    sharded = {id(p) for storage in engine.frozen_buffers for p in storage.params}
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, param in engine.module.named_parameters(remove_duplicate=True):
        if id(param) not in trainable and id(param) not in seen:
            seen.add(id(param))
            if frozen:
                out[name] = param if id(param) in sharded else param.data
    for name, buffer in engine.module.named_buffers(remove_duplicate=True):
        if id(buffer) not in seen:
            seen.add(id(buffer))
            out[name] = buffer
    return out


def whole_frozen_values(engine: Engine, untracked: Mapping[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor]:
    """The whole values of the sharded frozen parameters among ``untracked`` (Note [Frozen shards]), by name,
    where ``keep`` (the writing rank); a collective: stage 3 gathers their units one at a time."""
    stage3 = engine.stage3
    name_of = {id(t): name for name, t in untracked.items()}
    out: dict[str, torch.Tensor] = {}
    if stage3 is None:
        return out
    holding = [unit for unit in stage3.units if any(id(p) in name_of for s in unit.frozen for p in s.params)]
    for unit in stage3.gathered_in_turn(holding):
        if keep:
            out.update({name_of[id(p)]: p.detach().to("cpu", copy=True)
                        for storage in unit.frozen for p in storage.params if id(p) in name_of})
    return out


def load_untracked(engine: Engine, untracked: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> None:
    """Every tensor of ``untracked`` takes its value in ``values``: a buffer or whole frozen parameter in
    place, a sharded frozen parameter into this rank's shard of it (its unit is released by the load's
    ``reload_params_from_shards``)."""
    name_of = {id(t): name for name, t in untracked.items()}
    sharded: set[int] = set()
    for storage in engine.frozen_buffers:
        if all(id(p) in name_of for p in storage.params):
            storage.set_shard_from_values([values[name_of[id(p)]] for p in storage.params])
        sharded.update(id(p) for p in storage.params)
    for name, tensor in untracked.items():
        if id(tensor) not in sharded:
            tensor.copy_(values[name])
