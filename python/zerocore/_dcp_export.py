"""``python -m zerocore.checkpoint to-dcp``: a zerocore checkpoint as a torch.distributed.checkpoint (DCP)
directory that FSDP2 (or plain torch) resumes from, so a run can leave zerocore as it came (Note [DCP
checkpoints] in _dcp_checkpoint.py reads the other way).

Note [DCP export]
-----------------
The output is what torch's DCP recipe saves and loads: ``{"model": ..., "optim": ...}`` in the layout of
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)``, so

    model_sd, optim_sd = get_state_dict(model, optimizer)          # FSDP2-sharded or plain, any world size
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=out_dir)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

resumes training: the model holds the fp32 masters (a tied parameter under each of its names, as
``get_state_dict`` asks for them; checkpoints saved before the index recorded ties name it once), the frozen
parameters and persistent buffers as saved; every trainable parameter has torch AdamW's state (``exp_avg``,
``exp_avg_sq``, and ``step``: the engine's optimizer steps less the ones it got no gradient for, so a parameter
that never got one has step 0 and zero moments, which continues as torch's "no state yet" does), since
``get_state_dict`` asks for state of every parameter; the param groups carry lr, betas, eps, weight_decay and
``decoupled_weight_decay`` (zerocore's ``adam_w_mode``) with the parameters' names. Written one tensor at a
time (DCP's writer asks for each as it writes it: a planner assembles it then from the ranks' pieces; and a
file per tensor, as DCP's writer keeps every tensor of a file until the file is written), so the peak memory is
a small multiple of the largest tensor. Counters, the loss scale, the scheduler's state and the
client state are zerocore's and are not written (a script's own scheduler resumes from its own state). A
checkpoint saved with ``exclude_frozen_parameters`` (a LoRA run) holds no frozen parameters, so neither does
the output: load it over the base model with ``dcp.load(..., planner=DefaultLoadPlanner(allow_partial_load=
True))``, which leaves the model's own frozen values.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ._checkpoint_format import read_index, resolve_tag, tag_path
from ._saved_tensors import SavedTensors
from .optimizer import ADAM_HYPERPARAMETERS, own_group_keys


def _previous_output(out_dir: str) -> list[str]:
    if not os.path.isdir(out_dir):
        return []
    return sorted(n for n in os.listdir(out_dir) if n == ".metadata" or n.endswith(".distcp"))


def to_dcp(checkpoint_dir: str, out_dir: str, tag: str | None = None, overwrite: bool = False) -> list[str]:
    """Writes the checkpoint as a DCP directory (Note [DCP export]); returns its files. ``out_dir`` may not be,
    hold or lie inside the checkpoint, and a previous DCP output in it (``.metadata``, ``*.distcp``) is
    replaced only with ``overwrite=True``; both are refused before anything is written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ._checkpoint_cli import check_out_dir

    path = tag_path(checkpoint_dir, resolve_tag(checkpoint_dir, tag))
    check_out_dir(out_dir, [checkpoint_dir, path])
    index = read_index(path)
    previous = _previous_output(out_dir)
    if previous and not overwrite:
        raise FileExistsError(f"{out_dir} already holds a DCP checkpoint ({', '.join(previous)}): pass --overwrite "
                              "(overwrite=True) to replace it, or choose another directory")
    counters = index["counters"]
    steps, idle = int(counters["optimizer_steps"]), counters.get("idle_steps", {})
    with SavedTensors(path, index) as saved:  # every file is checked before writing
        loaders: dict[str, Callable[[], torch.Tensor]] = {}  # their values, by DCP's flattened key

        def lazy(key: str, shape: list[int], dtype: torch.dtype, value: Callable[[], torch.Tensor]) -> torch.Tensor:
            loaders[key] = value
            return torch.empty(shape, dtype=dtype, device="meta")

        model: dict[str, Any] = {}
        for name, shape in index["params"].items():
            model[name] = lazy(f"model.{name}", shape, torch.float32, lambda n=name: saved.trainable(n))
        for name, entry in index["untracked"].items():
            if entry.get("persistent", True):
                model[name] = lazy(f"model.{name}", entry["shape"], getattr(torch, entry["dtype"]),
                                   lambda n=name: saved.untracked(n))
        for alias, name in index.get("tied", {}).items():
            if name in model:
                model[alias] = lazy(f"model.{alias}", index["params"].get(name) or index["untracked"][name]["shape"],
                                    model[name].dtype, loaders[f"model.{name}"])
        state: dict[str, Any] = {}
        for name, shape in index["params"].items():
            state[name] = {"step": torch.tensor(float(steps - int(idle.get(name, 0))))}
            for key in ("exp_avg", "exp_avg_sq"):
                state[name][key] = lazy(f"optim.state.{name}.{key}", shape, torch.float32,
                                        lambda n=name, k=key: saved.trainable(n, k))
        # every key of torch's AdamW group (the recipe's load asks for each: amsgrad, foreach, ...), its defaults
        # but for zerocore's values
        defaults = torch.optim.AdamW([torch.zeros(1)]).defaults
        groups = []
        for group, names in zip(index["param_groups"], index["param_group_names"]):
            torch_group = {**defaults, **own_group_keys(group),  # (torch's load replaces its groups with these)
                           **{key: (tuple(group[key]) if key == "betas" else group[key])
                              for key in ADAM_HYPERPARAMETERS if key in group}}
            torch_group["decoupled_weight_decay"] = bool(group.get("adamw_mode", True))
            # what a torch scheduler built on the resuming optimizer before the load (torchtitan's order) asks for:
            # its base lr, as a scheduler built on this run's optimizer would have recorded it
            torch_group.setdefault("initial_lr", torch_group["lr"])
            torch_group["params"] = list(names)
            groups.append(torch_group)
        # the state dict DCP's planner sees (its tensors on the meta device: shapes and dtypes only)
        placeholders = {"model": model, "optim": {"state": state, "param_groups": groups}}

        class _Planner(DefaultSavePlanner):
            """Hands DCP's writer each tensor when it writes it (Note [DCP export])."""

            def resolve_data(self, write_item: Any) -> Any:
                load = loaders.get(write_item.index.fqn)
                return super().resolve_data(write_item) if load is None else load().contiguous()

        os.makedirs(out_dir, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # (DCP: "saving in a single process")
            # a file per tensor: DCP's writer holds every tensor of a file until the file is done
            dcp.save(placeholders, storage_writer=FileSystemWriter(out_dir, single_file_per_rank=False),
                     planner=_Planner(), no_dist=True)
    written = [".metadata", *sorted({info.relative_path for info in FileSystemReader(out_dir).read_metadata()
                                     .storage_data.values()})]
    for stale in set(previous) - set(written):  # only after the new output is complete (an old run's other ranks)
        os.remove(os.path.join(out_dir, stale))
    return written
