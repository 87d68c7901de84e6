"""``python -m zerocore.checkpoint to-deepspeed``: a zerocore checkpoint as a DeepSpeed universal checkpoint, which
DeepSpeed resumes from at any world size and ZeRO stage, so a run can go back to DeepSpeed the way it came
(Note [DeepSpeed checkpoints] in _deepspeed_checkpoint.py reads the other way).

Note [DeepSpeed export]
-----------------------
DeepSpeed's own checkpoints store flat partitions laid out by its optimizer (alignment padding, sub-groups,
the saving run's world size), which a loading run must match exactly; its universal format
(``ds_to_universal``'s output) stores every trainable parameter whole, and DeepSpeed cuts its own partitions
from it at load, whatever the stage and world size. So that is what is written, under ``OUT/global_step<N>``
with ``OUT/latest_universal`` naming it (and ``OUT/latest``: a DeepSpeed config that forgets ``load_universal``
then fails on the missing weights instead of returning None from ``load_checkpoint``, which a script that does
not check it would take for a fresh start):

* ``zero/<name>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``: the fp32 master and Adam's moments, each
  ``{"param": tensor, "cat_dim": 0}``; ``step.pt``: the step count, an int;
* ``zero/optimizer_state.pt``: the param groups' hyperparameters (lr, betas, eps, weight_decay), as stages 1-2
  read them (``param_groups``, group by group), and the step with what stage 3 reads (``optimizer_state_dict``:
  one group, which DeepSpeed's stage-3 universal load copies into every group, so only the hyperparameters all
  groups share are in it; DeepSpeed's own conversions put the first group there, and resumed at stage 3 a
  no-decay group then decays);
* ``mp_rank_00_model_states.pt`` (what stages 1-2 read) and ``zero_pp_rank_0_mp_rank_00_model_states.pt`` (stage
  3): the counters (``global_steps``, ``global_samples``, ``skipped_steps``), the lr scheduler's state, the
  ``client_state`` as top-level keys (DeepSpeed's ``load_checkpoint`` returns them), the parameter shapes per
  group, and in ``module`` the buffers and frozen parameters as saved (the first file only).

DeepSpeed (0.19.8, checked by tests/test_deepspeed_export.py) loads it with ``"checkpoint": {"load_universal":
true}`` in its config and ``engine.load_checkpoint(OUT)``. Its universal load restores the trainable
parameters, their optimizer state, the counters and the scheduler; it reads nothing of ``module``, so buffers and
frozen parameters are the ones of the model the DeepSpeed script builds (a LoRA run's base from the pretrained
weights), as with DeepSpeed's own universal checkpoints; ``module`` keeps them for a script that wants them. At
stage 3 a hyperparameter that differs between groups (a per-group lr) is the DeepSpeed script's own.

DeepSpeed keeps one Adam step per param group and updates every parameter at every step; zerocore, like torch,
does not advance a parameter that got no gradient (Note [Parameters without gradients]). A parameter that never
took a step (zero moments) is written with its group's step: DeepSpeed continues it as it does its own unused
parameters. One that took some steps but not all has no exact DeepSpeed form (its bias correction would
change), so it is refused, naming it, unless ``group_steps=True`` (``--group-steps``) accepts its group's step.
The lr scheduler's state is torch's with DeepSpeed's ``last_batch_iteration`` added (zerocore's schedules are
DeepSpeed's: Note [DeepSpeed schedule timing]), so a DeepSpeed schedule and a torch one both resume. An fp16
run's dynamic loss scale is not written (DeepSpeed keeps it as a pickled object of its own classes): DeepSpeed
starts from its config's initial scale, skipping a step or a few until it is back down.

One tensor in memory at a time (assembled from the ranks' pieces, written, dropped); the directory is written
beside its place and renamed into it, then the pointers are replaced, so an interrupted export leaves
no partial checkpoint under the tag.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from . import _json_state as json_state
from ._checkpoint_format import fsync_dir, read_index, resolve_tag, tag_path, write_durably
from ._checkpoint_match import global_steps, optimizer_steps
from ._saved_tensors import SavedTensors
from ._user_frames import user_stacklevel
from .optimizer import ADAM_HYPERPARAMETERS, own_group_keys

# The DeepSpeed version whose universal loader this output was checked against (stage 1's loader asserts a
# version at least 0.3.17 is named).
_FORMAT_VERSION = "0.19.8"
# the model state file's keys (a client_state key among them would be shadowed by DeepSpeed's own)
_RESERVED = frozenset({"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                       "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
                       "global_samples", "dp_world_size", "mp_world_size", "ds_version", "ds_config"})


def _save(path: str, value: Any) -> None:
    with open(path, "wb") as f:
        torch.save(value, f)
        f.flush()
        os.fsync(f.fileno())


def _group_steps(index: Mapping[str, Any], accept: bool) -> int:
    """The step DeepSpeed gets for every parameter; refuses a parameter whose own step differs and that took
    steps (Note [DeepSpeed export])."""
    steps = int(optimizer_steps(index["counters"]))
    idle = index["counters"].get("idle_steps", {})
    lagging = {name: steps - int(n) for name, n in idle.items() if 0 < int(n) < steps}
    if lagging and not accept:
        listed = ", ".join(f"{name!r} (step {own})" for name, own in sorted(lagging.items())[:5])
        more = f" and {len(lagging) - 5} more" if len(lagging) > 5 else ""
        raise ValueError(
            f"DeepSpeed keeps one Adam step per param group, {steps} here, but {listed}{more} took fewer steps (they "
            "got no gradient in some): their bias correction would change in DeepSpeed. Pass --group-steps "
            "(group_steps=True) to continue them at step " + str(steps) + "; nothing was written")
    if lagging:
        warnings.warn(f"to_deepspeed: {len(lagging)} parameter(s) that took fewer than {steps} steps continue at "
                      f"step {steps} in DeepSpeed: {sorted(lagging)[:5]}", UserWarning, stacklevel=user_stacklevel())
    return steps


def _scheduler_state(index: Mapping[str, Any]) -> Any:
    state = json_state.decode(index["lr_scheduler"])
    if isinstance(state, dict) and isinstance(state.get("last_epoch"), int):
        # DeepSpeed's counter is one behind torch's (Note [DeepSpeed schedule timing])
        return {**state, "last_batch_iteration": state["last_epoch"] - 1}
    return state


def _param_groups(index: Mapping[str, Any]) -> list[dict[str, Any]]:
    groups, first = [], 0
    for group, names in zip(index["param_groups"], index["param_group_names"]):
        entry = own_group_keys(group)  # (DeepSpeed's universal load sets its groups' keys from these)
        entry.update({key: (tuple(group[key]) if key == "betas" else group[key]) for key in ADAM_HYPERPARAMETERS
                      if key in group})
        entry["params"] = list(range(first, first + len(names)))
        first += len(names)
        groups.append(entry)
    return groups


def _shared_hyperparameters(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """What DeepSpeed's stage-3 universal load gives every param group (it copies the first saved group into each):
    the hyperparameters all groups share, so a group's own weight decay (0 for biases and norms, say) stays the
    one the DeepSpeed script gave it instead of becoming the first group's."""
    first = groups[0] if groups else {}
    return {key: value for key, value in first.items()
            if key != "params" and all(group.get(key) == value for group in groups)}


def _model_states(index: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """What both model state files hold but ``module``."""
    counters = index["counters"]
    client = json_state.decode(index["client_state"])
    shadowed = sorted(set(client) & _RESERVED)
    state: dict[str, Any] = {key: value for key, value in client.items() if key not in _RESERVED}
    untracked = index["untracked"]
    state.update({
        "buffer_names": [name for name, entry in untracked.items() if entry.get("buffer")],
        "param_shapes": [{name: torch.Size(index["params"][name]) for name in names}
                         for names in index["param_group_names"]],
        "shared_params": dict(index.get("tied", {})),
        "optimizer": None,
        "lr_scheduler": _scheduler_state(index),
        "data_sampler": None,
        "random_ltd": None,
        "global_steps": int(global_steps(counters)),
        "global_samples": int(counters.get("global_samples", steps)),
        "skipped_steps": int(counters.get("skipped_steps", 0)),
        "dp_world_size": int(index["world_size"]),
        "mp_world_size": 1,
        "ds_version": _FORMAT_VERSION,
    })
    if shadowed:
        warnings.warn(f"to_deepspeed: client_state keys {shadowed} are DeepSpeed's own model-state keys and were left "
                      "out", UserWarning, stacklevel=user_stacklevel())
    return state


def to_deepspeed(checkpoint_dir: str, out_dir: str, tag: str | None = None, overwrite: bool = False,
                 group_steps: bool = False) -> list[str]:
    """Writes the checkpoint as a DeepSpeed universal checkpoint under ``out_dir/global_step<N>`` and points
    ``out_dir/latest_universal`` and ``out_dir/latest`` at it (Note [DeepSpeed export]); returns the paths
    written, relative to ``out_dir``. DeepSpeed loads it with ``"checkpoint": {"load_universal": true}`` at any world size and stage.
    ``out_dir`` may not be, hold or lie inside the checkpoint; an existing ``global_step<N>`` there is replaced
    only with ``overwrite=True``. Parameters that took fewer steps than their group are refused unless
    ``group_steps=True``. Every refusal comes before anything is written."""
    from ._checkpoint_cli import check_out_dir

    path = tag_path(checkpoint_dir, resolve_tag(checkpoint_dir, tag))
    check_out_dir(out_dir, [checkpoint_dir, path])
    index = read_index(path)
    steps = _group_steps(index, group_steps)
    name = f"global_step{int(global_steps(index['counters']))}"
    final = os.path.join(out_dir, name)
    if os.path.lexists(final) and not overwrite:
        raise FileExistsError(f"{final} already exists: pass --overwrite (overwrite=True) to replace it, or choose "
                              "another directory")
    written: list[str] = []
    with SavedTensors(path, index) as saved:  # every file is checked before writing
        os.makedirs(out_dir, exist_ok=True)
        tmp = os.path.join(out_dir, f".{name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # an interrupted export's
        try:
            zero = os.path.join(tmp, "zero")
            os.makedirs(zero)
            for param in index["params"]:
                folder = os.path.join(zero, param)
                os.makedirs(folder)
                for key, state in (("fp32", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                    _save(os.path.join(folder, f"{key}.pt"), {"param": saved.trainable(param, state), "cat_dim": 0})
                    written.append(f"{name}/zero/{param}/{key}.pt")
                _save(os.path.join(folder, "step.pt"), steps)
                written.append(f"{name}/zero/{param}/step.pt")
                fsync_dir(folder)
            groups = _param_groups(index)
            _save(os.path.join(zero, "optimizer_state.pt"), {
                "zero_stage": 2,  # (the layout of the model state files below; DeepSpeed's loaders ignore it)
                "ds_version": _FORMAT_VERSION,
                "param_groups": groups,
                "optimizer_state_dict": {"state": {i: {"step": steps} for i in range(len(groups))},
                                         "param_groups": [_shared_hyperparameters(groups)]},
                "partition_count": int(index["world_size"]),
            })
            written.append(f"{name}/zero/optimizer_state.pt")
            fsync_dir(zero)
            states = _model_states(index, steps)
            # buffers and frozen parameters as saved, in the file stages 1-2 read (Note [DeepSpeed export])
            module = {untracked: saved.untracked(untracked) for untracked in index["untracked"]}
            for file, content in (("mp_rank_00_model_states.pt", module),
                                  ("zero_pp_rank_0_mp_rank_00_model_states.pt", {})):
                _save(os.path.join(tmp, file), {**states, "module": content})
                written.append(f"{name}/{file}")
            fsync_dir(tmp)
            if os.path.lexists(final):  # (overwrite: checked above)
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    # latest too: a DeepSpeed config without load_universal then fails on the missing weights; without it,
    # DeepSpeed's load_checkpoint returns None and the run would start from scratch unless the script checks
    write_durably(os.path.join(out_dir, "latest"), name.encode())
    write_durably(os.path.join(out_dir, "latest_universal"), name.encode())
    return [*written, "latest", "latest_universal"]
