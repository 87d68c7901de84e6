"""DeepSpeed ZeRO checkpoints (stages 0-3, from DeepSpeed's ``engine.save_checkpoint``) loaded by
``engine.load_checkpoint``: a run moves to zerocore mid-training with its weights, Adam moments, step counts,
scheduler and buffers, at any world size and stage.

Note [DeepSpeed checkpoints]
----------------------------
A DeepSpeed checkpoint directory (``global_step<N>``) holds, per data-parallel rank r of its run, an optimizer
file ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` and model state (one ``mp_rank_00_model_states.pt``
at stages 1-2, one ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank at stage 3). The model state names
the trainable parameters per param group with their shapes (``param_shapes``, in the flat order), the frozen
ones, tied names (``shared_params``), buffers (in ``module``), the scheduler's state, the step counters and
the caller's ``client_state`` (its other top-level keys). The fp32 master and Adam's moments are flat:

* stages 1-2: per param group, rank r holds partition r of one flat vector in which the group's parameters lie
  one after another (``param_alignment_paddings`` after each), so a parameter's elements are a range of the
  ranks' partitions laid end to end (``single_partition_of_fp32_groups``; moments in
  ``base_optimizer_state``, one entry per group, as long as the partition before the last rank's trailing
  padding was cut);
* stage 3: every parameter is cut into ``ceil(numel / ranks)`` elements per rank, and rank r's pieces of all
  parameters lie one after another, in ``param_shapes`` order, across its sub-groups (``fp32_flat_groups``;
  moments in ``optimizer_state_dict``, one entry per sub-group);
* a universal checkpoint (``python -m deepspeed.checkpoint.ds_to_universal``'s output, what DeepSpeed loads
  with ``"checkpoint": {"load_universal": true}``): every trainable parameter whole in
  ``zero/<name>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt`` (and ``step.pt``; a ``{"param": tensor}``, or the
  tensor itself from a stage-3 conversion), the optimizer's shared state in ``zero/optimizer_state.pt``, and
  the model state files as the stage wrote them (frozen parameters, buffers, counters, scheduler).

At stages 0-2 the model state file also holds every trainable weight whole (16-bit ones the rounding of their
fp32 masters, fp32 ones the masters), so each master read is checked against it, on the parameter's first and
last 256 elements, before anything changes: a master taken from the wrong place is refused by name, not
loaded. Such a place exists: DeepSpeed 0.19.8 flattens each group in round-robin order with
``round_robin_gradients`` (LLaMA-Factory's ZeRO-2 config sets it; ``param_shapes`` follows that order, which
zerocore reads), but its fragment addresses follow the unordered group when no alignment padding lies between
parameters, so its ``safe_get_full_*`` and ``ds_to_universal`` take other parameters' elements; a universal
conversion of such a run is refused, naming the original checkpoint to load instead.

Note [DeepSpeed stage-0 checkpoints]
------------------------------------
Stage 0 writes no optimizer file: the model state file's ``optimizer`` is the optimizer's whole state_dict,
which names its parameters by position, as torch's does (``param_shapes`` is None). At fp32 it is the plain
optimizer's (moments per parameter; DeepSpeed's FusedAdam counts the step on one parameter per group, so the
group's largest count is its step); at bf16 and fp16 it is FP16_Optimizer's: one flat fp32 master per group
(``fp32_groups_flat``: the group's parameters end to end, no padding), the moments of each flat, and one step
more than the run took (its first step, on zero gradients, creates the state; DeepSpeed's next update's bias
correction counts it, so a zerocore resume does too). A load names the positions by the engine's param groups,
as DeepSpeed's own resume does with its model_parameters (without them, DeepSpeed's fp32 optimizer holds every
parameter, frozen ones too, in one group: a load whose groups do not fit tries that), and checks them before
anything changes: the groups' sizes, each moment's shape against its parameter's, and each weight in ``module``
against the master at its position (as at stages 1-2, above); a mismatch asks for the DeepSpeed run's param
groups. FP16_Optimizer's loss scaler halves at every overflow (it has no hysteresis): the resumed scaler keeps
its scale and counters, with one overflow to go before it halves, then follows the config's hysteresis. A
stage-0 fp16 checkpoint is loaded with a warning: DeepSpeed 0.19.8 (deepspeedai/DeepSpeed#8393) trains it on
gradients divided by the loss scale, so its moments are that much too small for the true gradients zerocore
resumes with.

Every rank reads the files memory-mapped and, one parameter at a time, only the elements its own shards hold
(its master and moments, from the pages that hold them: a rank reading every parameter whole would read the
checkpoint world-size times over), writes them into its pieces, and the parameters are gathered from the
shards afterwards, as after a step; the checkpoint's world size need not be this run's. Everything is read and checked against the model (names, shapes, frozen or
not) on every rank before anything changes, and the ranks agree on it, as for zerocore's own checkpoints. A
checkpoint saved without its frozen parameters (DeepSpeed's ``exclude_frozen_parameters=True``, usual for
LoRA) leaves the model's own frozen values, which the script loaded from the base model before ``initialize``.

The files are pickles of DeepSpeed's objects (an enum, named tuples, its loss scaler): they are read without
DeepSpeed installed, DeepSpeed's classes standing in as plain records. Unpickling runs code the file names, as
DeepSpeed's own ``torch.load(weights_only=False)`` does: load checkpoints you trust. Not read: pipeline- or
tensor-parallel checkpoints (``layer_*`` files, ``mp_rank_01``; their universal conversion, whole tensors, is),
MoE expert files.
"""

from __future__ import annotations

import functools
import glob
import math
import os
import pickle
import re
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ._checkpoint_match import agree_on_reading, is_count, trainable_params
from ._deferred_signals import deferred_interrupts
from ._full_param_state import _locate, write_own
from ._local_param_state import local_range
from ._names import canonical, named_buffers, named_parameters
from .optimizer import ADAM_HYPERPARAMETERS, set_group_value

if TYPE_CHECKING:
    from .engine import Engine

# the model state file's own keys; every other top-level key is the caller's client_state
_DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info", "ds_autoep_layers", "autoep_layers",
})
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_STAGE3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
_UNIVERSAL_OPTIMIZER = "optimizer_state.pt"  # a universal checkpoint's zero/: what every rank's optimizer shared
_MODEL_STATES = "mp_rank_00_model_states.pt"  # stages 0-2's model state file
# what a stage-0 load whose positions do not fit the engine's param groups asks for
_STAGE0_REMEDY = "initialize with the param groups (model_parameters) the DeepSpeed run had, in its order"
_CHECKED = 256  # elements at each end of a parameter whose master a load compares with its saved weight


def is_deepspeed_checkpoint(path: str) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint directory (its ZeRO optimizer files, a universal checkpoint's
    ``zero/``, or stage 0's model state file alone), not a zerocore one."""
    return (os.path.isdir(path) and not os.path.exists(os.path.join(path, "index.json"))
            and (any(_OPTIM.match(name) for name in os.listdir(path)) or _is_universal(path)
                 or os.path.isfile(os.path.join(path, _MODEL_STATES))))


def _is_universal(path: str) -> bool:
    """DeepSpeed's universal checkpoint (``ds_to_universal``'s output, Note [DeepSpeed checkpoints])."""
    return os.path.isfile(os.path.join(path, "zero", _UNIVERSAL_OPTIMIZER))


# ---- reading DeepSpeed's pickles without DeepSpeed --------------------------------------------------------

class _StandIn:
    """A DeepSpeed object in a checkpoint (ZeroStageEnum, fragment_address, a loss scaler): its constructor
    arguments and its state, nothing more."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def __int__(self) -> int:  # ZeroStageEnum(2)
        return int(self.args[0])


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "deepspeed" or module.startswith("deepspeed."):
            return type(name, (_StandIn,), {})
        return super().find_class(module, name)


_LENIENT_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=lambda f, **kw: _Unpickler(f, **kw).load(),
                                        __name__="zerocore_deepspeed_pickle")


def _load(path: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False, pickle_module=_LENIENT_PICKLE)
    except Exception as error:  # noqa: BLE001 - a torn file, not a pickle, ...: named with its path
        raise ValueError(f"load_checkpoint: cannot read the DeepSpeed file {path}: {type(error).__name__}: "
                         f"{error}") from None


# ---- the checkpoint, read ---------------------------------------------------------------------------------

@dataclass
class _Flat:
    """One rank's flat fp32 tensors of one kind (master or a moment), in order, read as one range."""

    parts: list[torch.Tensor]
    starts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.parts = [p.reshape(-1) for p in self.parts]
        self.starts = [0]
        for part in self.parts:
            self.starts.append(self.starts[-1] + part.numel())

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def read(self, start: int, length: int) -> torch.Tensor:
        pieces = []
        for part, begin in zip(self.parts, self.starts):
            lo, hi = max(start, begin), min(start + length, begin + part.numel())
            if lo < hi:
                pieces.append(part[lo - begin : hi - begin])
        if not pieces:  # a parameter of no elements
            return torch.zeros(0, dtype=self.parts[0].dtype if self.parts else torch.float32)
        return torch.cat(pieces) if len(pieces) != 1 else pieces[0]


@dataclass
class _Checkpoint:
    path: str
    stage: int
    model: dict[str, Any]  # rank 0's model state file
    trainable: dict[str, tuple[torch.Size, Any]]  # name -> (shape, where its elements are)
    frozen: dict[str, _Frozen]  # name -> shape and whole value
    flats: dict[str, list[_Flat]]  # "master" / "exp_avg" / "exp_avg_sq" -> per (rank or group) flat
    optimizer_step: int
    param_groups: list[dict[str, Any]]
    loss_scaler: dict[str, float | int] | None  # a dynamic fp16 scaler's state, as LossScaler.state_dict()


def read(path: str, order: list[list[str]] | None = None, every: list[str] | None = None) -> _Checkpoint:
    """Reads and checks a DeepSpeed checkpoint directory (memory-mapped: parameters are assembled later).
    ``order``: the loading engine's trainable parameter names per param group, which name a stage-0
    checkpoint's optimizer state (kept by position), and ``every`` all the module's parameter names in order;
    None names none of them (``describe``)."""
    if _is_universal(path):
        return _read_universal(path)
    optim_files: dict[int, str] = {}
    for name in os.listdir(path):
        match = _OPTIM.match(name)
        if match:
            if int(match.group(2)) != 0:
                raise ValueError(f"load_checkpoint: {path} is a tensor- or pipeline-parallel DeepSpeed checkpoint "
                                 f"({name}): zerocore loads data-parallel ZeRO checkpoints only")
            optim_files[int(match.group(1))] = os.path.join(path, name)
    if glob.glob(os.path.join(path, "layer_*")) or glob.glob(os.path.join(path, "*expp_rank*")):
        raise ValueError(f"load_checkpoint: {path} holds pipeline layer or MoE expert files: zerocore loads "
                         "data-parallel ZeRO checkpoints only")
    world = len(optim_files)
    if not world and os.path.isfile(os.path.join(path, _MODEL_STATES)):
        return _read_stage0(path, order, every)
    if sorted(optim_files) != list(range(world)):
        raise ValueError(f"load_checkpoint: {path} holds the optimizer files of ranks {sorted(optim_files)}: a "
                         "rank's file is missing (a save that did not finish?)")
    optims = [_load(optim_files[r])["optimizer_state_dict"] for r in range(world)]
    stage = _zero_stage(optims[0])
    counts = optims[0]["partition_count"]
    count = max(counts) if isinstance(counts, (list, tuple)) else int(counts)
    if count != world:
        raise ValueError(f"load_checkpoint: {path} was written by {count} ranks but holds {world} optimizer files")
    models = _model_states(path, stage, world, "")
    model = models[0]
    groups = [dict(g) for g in model["param_shapes"]]
    if stage in (1, 2):
        trainable, flats = _stage12_geometry(optims, groups, world, path)
    else:
        trainable, flats = _stage3_geometry(optims, groups, world, path)
    frozen = _frozen_values(stage, model, models, trainable)
    state = optims[0].get("base_optimizer_state") or optims[0].get("optimizer_state_dict") or {}
    steps = {_as_int(s.get("step", 0)) for s in state.get("state", {}).values()}
    checkpoint = _Checkpoint(path, stage, model, trainable, frozen, flats, max(steps, default=0),
                             [{k: v for k, v in g.items() if k != "params"} for g in state.get("param_groups", [])],
                             _dynamic_loss_scaler(optims[0].get("loss_scaler"), model))
    _check_masters_against_weights(
        checkpoint, "either its layout is one zerocore misreads (param_shapes not in the order the parameters were "
        "flattened in), or the weights were changed after the last step and before the save")
    return checkpoint


def _zero_stage(optim: dict[str, Any]) -> int:
    """The ZeRO stage whose layout the optimizer state has. DeepSpeed's BF16_Optimizer (bf16 with
    ``data_types.grad_accum_dtype: "fp32"`` at stage 0 or 1, Megatron-DeepSpeed's runs) records none: its flat
    fp32 partitions of each param group, with no padding between parameters, are stage 1's."""
    if "zero_stage" in optim:
        return int(optim["zero_stage"])
    if "single_partition_of_fp32_groups" in optim:
        return 1
    raise KeyError("zero_stage")


def _read_stage0(path: str, order: list[list[str]] | None, every: list[str] | None) -> _Checkpoint:
    """Stage 0 (Note [DeepSpeed stage-0 checkpoints]): the model state file alone, its ``optimizer`` the
    optimizer's whole state with the parameters by position, named by ``order``, or by ``every`` (all the
    module's parameters, as DeepSpeed's default model_parameters lists them) when that is what fits."""
    model = _load(os.path.join(path, _MODEL_STATES))
    optimizer = model.get("optimizer")
    stage = ((model.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0)
    if not isinstance(optimizer, dict) or stage not in (0, "0", None):
        raise ValueError(f"load_checkpoint: {path} holds a DeepSpeed model state file but no ZeRO optimizer files "
                         f"(zero_pp_rank_*_optim_states.pt) for its stage {stage}: a save that did not finish?")
    mixed = "fp32_groups_flat" in optimizer  # FP16_Optimizer (bf16, fp16): flat fp32 masters, one per group
    state = optimizer["optimizer_state_dict"] if mixed else optimizer
    groups, entries = state["param_groups"], state["state"]
    module = {canonical(name): value for name, value in model["module"].items()}  # (the engine's names)
    trainable: dict[str, tuple[torch.Size, Any]] = {}
    flats: dict[str, list[_Flat]] = {"master": [], "exp_avg": [], "exp_avg_sq": []}
    if order is not None:
        trainable_names = {name for names in order for name in names}
        sizes = _stage0_group_sizes(optimizer)
        ours = [sum(module[name].numel() for name in names if name in module) if mixed else len(names)
                for names in order]
        if sizes != ours and not mixed and every is not None and sizes == [len(every)]:
            order = [every]  # DeepSpeed's default model_parameters: every parameter, frozen ones too (no state)
        elif sizes != ours:
            unit = "elements" if mixed else "parameters"
            raise ValueError(f"load_checkpoint: the DeepSpeed stage-0 checkpoint {path} keeps its optimizer state by "
                             f"position, in param groups of {sizes} {unit}; the engine's groups hold {ours}: "
                             f"{_STAGE0_REMEDY}")
        for g, (group, names) in enumerate(zip(groups, order)):
            # (position in the saved group, name) of the parameters this engine trains
            positions = [(position, name) for position, name in enumerate(names) if name in trainable_names]
            unknown = [name for _, name in positions if name not in module]
            if unknown:
                raise ValueError(f"load_checkpoint: trainable parameters {unknown[:5]} are not in the DeepSpeed "
                                 f"checkpoint {path}")
            shapes = [module[name].shape for _, name in positions]
            if mixed:
                flats["master"].append(_Flat([optimizer["fp32_groups_flat"][g]]))
                moments = entries.get(group["params"][0], {})
                for key in ("exp_avg", "exp_avg_sq"):
                    flats[key].append(_Flat([moments[key] if key in moments else torch.zeros(sum(
                        math.prod(shape) for shape in shapes))]))
            else:
                flats["master"].append(_Flat([module[name] for _, name in positions]))
                for key in ("exp_avg", "exp_avg_sq"):
                    flats[key].append(_Flat([entries[i][key] if key in entries.get(i, {}) else torch.zeros(shape)
                                             for i, shape in zip((group["params"][p] for p, _ in positions), shapes)]))
            offset = 0
            for (position, name), shape in zip(positions, shapes):
                moment = None if mixed else entries.get(group["params"][position], {}).get("exp_avg")
                if moment is not None and tuple(moment.shape) != tuple(shape):
                    raise ValueError(f"load_checkpoint: the DeepSpeed stage-0 checkpoint {path} holds an Adam moment "
                                     f"of shape {list(moment.shape)} at the position of {name!r} "
                                     f"({list(shape)}): {_STAGE0_REMEDY}")
                trainable[name] = (torch.Size(shape), ("flat", g, offset))
                offset += math.prod(shape)
            if offset != flats["master"][g].numel:
                raise ValueError(f"load_checkpoint: the DeepSpeed stage-0 checkpoint {path}'s param group {g} holds "
                                 f"{flats['master'][g].numel} elements, the engine's {offset}: {_STAGE0_REMEDY}")
    steps = {_as_int(entry.get("step", 0)) for entry in entries.values()}
    if mixed and "cur_scale" in optimizer:  # (fp16: FP16_Optimizer saves its scale only then)
        warnings.warn(
            f"load_checkpoint: {path} is a DeepSpeed {model.get('ds_version', '')} stage-0 fp16 checkpoint. "
            "DeepSpeed 0.19's engine.backward leaves a stage-0 fp16 loss unscaled while its FP16_Optimizer divides "
            "the gradients by the loss scale (deepspeedai/DeepSpeed#8393): if this run had that bug, its Adam moments "
            f"come from gradients / {float(optimizer['cur_scale']):g} or so, and zerocore's updates from the true "
            "gradients will be several times larger than the learning rate asks until the second moment catches up "
            "(about 1/(1 - beta2) steps); load_optimizer_states=False starts the moments afresh instead",
            UserWarning, stacklevel=2)
    scaler = None
    if mixed and optimizer.get("dynamic_loss_scale"):
        # FP16_Optimizer's scaler halves at every overflow (no hysteresis): one left, then the config's own
        scaler = {"scale": float(optimizer["cur_scale"]), "hysteresis_left": 1, "iteration": int(optimizer["cur_iter"]),
                  "last_overflow": int(optimizer.get("last_overflow_iter", -1)),
                  "overflows": _as_int(model.get("skipped_steps", 0))}
    checkpoint = _Checkpoint(path, 0, model, trainable, _frozen_values(0, model, [model], trainable), flats,
                             max(steps, default=0), [{k: v for k, v in g.items() if k not in ("params", "step")}
                                                     for g in groups], scaler)
    _check_masters_against_weights(checkpoint, _STAGE0_REMEDY)
    return checkpoint


def _stage0_group_sizes(optimizer: dict[str, Any]) -> list[int]:
    """A stage-0 optimizer's param group sizes: elements of each flat fp32 group (FP16_Optimizer's), or
    parameters per group (a plain optimizer's)."""
    if "fp32_groups_flat" in optimizer:
        return [flat.numel() for flat in optimizer["fp32_groups_flat"]]
    return [len(group["params"]) for group in optimizer["param_groups"]]


def _check_masters_against_weights(checkpoint: _Checkpoint, remedy: str) -> None:
    """The check that each trainable parameter's fp32 master is the one its weight in the model state file
    was last copied from (stages 0-2 save the weights whole: 16-bit ones are the masters' rounding, fp32 ones
    the masters), on each parameter's first and last ``_CHECKED`` elements (every rank reads these: whole
    parameters would be the whole checkpoint on every rank). A master read from the wrong place (a stage-0
    group in another order, a universal conversion that misplaced a slice, a layout misread) is caught unless
    it holds the same values; ``remedy`` says what to do about it."""
    module = {canonical(name): value for name, value in (checkpoint.model.get("module") or {}).items()}
    for name, (shape, _) in checkpoint.trainable.items():
        weight, numel = module.get(canonical(name)), math.prod(shape)
        if not isinstance(weight, torch.Tensor) or weight.numel() != numel or weight.dtype not in (
                torch.float16, torch.bfloat16, torch.float32):  # (stage 3 keeps placeholders there)
            continue
        weight = weight.reshape(-1)
        for start in sorted({0, max(0, numel - _CHECKED)}):
            stop = min(numel, start + _CHECKED)
            master = assemble(checkpoint, name, "master", start, stop)
            if not torch.equal(master.to(weight.dtype), weight[start:stop]):
                raise ValueError(f"load_checkpoint: the DeepSpeed checkpoint {checkpoint.path}'s fp32 master of "
                                 f"{name!r} is not the one its {weight.dtype} weight in the model state was copied "
                                 f"from (elements {start}-{stop - 1} differ): {remedy}; nothing was changed")


def _model_states(path: str, stage: int, world: int, kind: str) -> list[dict[str, Any]]:
    """The model state files as a stage writes them (one at stages 1-2, one per rank at stage 3), read."""
    if stage in (1, 2):
        files = [os.path.join(path, "mp_rank_00_model_states.pt")]
    elif stage == 3:
        files = [os.path.join(path, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(world)]
    else:
        raise ValueError(f"load_checkpoint: {path} is a ZeRO stage {stage} {kind}DeepSpeed checkpoint; stages 1-3 "
                         "load")
    for file in files:
        if not os.path.isfile(file):
            raise ValueError(f"load_checkpoint: {file} is missing (the {kind}DeepSpeed checkpoint is incomplete)")
    return [_load(file) for file in files]


def _read_universal(path: str) -> _Checkpoint:
    """A universal checkpoint: every parameter's whole fp32 value and moments in ``zero/<name>/`` (Note
    [DeepSpeed checkpoints]), the model state files as the stage wrote them."""
    zero = os.path.join(path, "zero")
    optim = _load(os.path.join(zero, _UNIVERSAL_OPTIMIZER))
    stage = _zero_stage(optim)
    world = 1
    if stage == 3:  # (the conversion keeps no optimizer file per rank: the model state files say how many ranks)
        ranks = sorted(int(m.group(1)) for name in os.listdir(path) if (m := _STAGE3_MODEL.match(name)))
        if ranks != list(range(len(ranks))) or not ranks:
            raise ValueError(f"load_checkpoint: the universal DeepSpeed checkpoint {path} holds the stage-3 model "
                             f"state files of ranks {ranks}: a rank's file is missing")
        world = len(ranks)
    models = _model_states(path, stage, world, "universal ")
    model = models[0]
    trainable: dict[str, tuple[torch.Size, Any]] = {}
    for shapes in model["param_shapes"]:
        for name, shape in dict(shapes).items():
            folder = os.path.join(zero, name)
            if not os.path.isfile(os.path.join(folder, "fp32.pt")):
                raise ValueError(f"load_checkpoint: {folder}/fp32.pt is missing (the universal DeepSpeed checkpoint "
                                 "is incomplete)")
            trainable[name] = (torch.Size(shape), ("universal", folder))
    steps = {_as_int(_load(os.path.join(folder, "step.pt"))) for _, (_, folder) in trainable.values()
             if os.path.isfile(os.path.join(folder, "step.pt"))}
    if not steps:  # (stage 3's conversion writes no step files: the optimizer's own state has them)
        state = optim.get("base_optimizer_state") or optim.get("optimizer_state_dict") or {}
        steps = {_as_int(s.get("step", 0)) for s in state.get("state", {}).values()}
    checkpoint = _Checkpoint(path, stage, model, trainable, _frozen_values(stage, model, models, trainable), {},
                             max(steps, default=0), [{k: v for k, v in g.items() if k not in ("params", "step")}
                                                     for g in optim.get("param_groups", [])],
                             _dynamic_loss_scaler(optim.get("loss_scaler"), model))
    _check_masters_against_weights(
        checkpoint, "DeepSpeed's ds_to_universal takes each parameter's slice by the run's fragment addresses, "
        "which point at other parameters' elements in a stage 1-2 run with round_robin_gradients (DeepSpeed 0.19.8): "
        "load the checkpoint it was converted from instead")
    return checkpoint


def describe(path: str) -> list[str]:
    """``python -m zerocore.checkpoint info`` for a DeepSpeed checkpoint (read and checked as a load reads it)."""
    checkpoint = read(path)
    model = checkpoint.model
    kind = "universal " if _is_universal(path) else ""
    lines = [f"{path}: a DeepSpeed {model.get('ds_version', '')} ZeRO stage {checkpoint.stage} {kind}checkpoint of "
             f"{model.get('dp_world_size', '?')} ranks; engine.load_checkpoint reads it (Note [DeepSpeed checkpoints])",
             f"steps: global {model.get('global_steps')}, optimizer {checkpoint.optimizer_step}, skipped "
             f"{model.get('skipped_steps', 0)}; loss scaler: {checkpoint.loss_scaler or 'static'}; lr per group: "
             f"{[g.get('lr') for g in checkpoint.param_groups]}",
             f"{len(checkpoint.trainable)} trainable parameters, {len(checkpoint.frozen)} frozen or tied; client_state keys: "
             f"{sorted(k for k in model if k not in _DEEPSPEED_KEYS)}"]
    if checkpoint.stage == 0:  # (read without an engine, the optimizer's parameters have no names yet)
        unit = "elements" if "fp32_groups_flat" in model["optimizer"] else "parameters"
        lines[-1] = (f"param groups of {_stage0_group_sizes(model['optimizer'])} trainable {unit}, kept by position "
                     "(a load names them by the engine's param groups); client_state keys: "
                     f"{sorted(k for k in model if k not in _DEEPSPEED_KEYS)}")
        lines += [f"  {name} {list(value.shape)}" for name, value in model["module"].items()
                  if name not in set(model.get("buffer_names") or [])]
    lines += [f"  {name} {list(shape)}" for name, (shape, _) in checkpoint.trainable.items()]
    return lines


def _dynamic_loss_scaler(scaler: Any, model: dict[str, Any]) -> dict[str, float | int] | None:
    """DeepSpeed's ``DynamicLossScaler`` as zerocore's LossScaler state (the same rule, the same counters), or
    None for a static scaler: bf16 and fp32 runs save one of scale 1, which must not become an fp16 run's
    dynamic scale (every small gradient would underflow until the scale had grown back)."""
    if scaler is None or not getattr(scaler, "dynamic", False) or getattr(scaler, "cur_scale", None) is None:
        return None
    delayed_shift = int(getattr(scaler, "delayed_shift", 1))
    return {"scale": float(scaler.cur_scale), "hysteresis_left": int(getattr(scaler, "cur_hysteresis", delayed_shift)),
            "iteration": int(getattr(scaler, "cur_iter", 0)),
            "last_overflow": int(getattr(scaler, "last_overflow_iter", -1)),
            "overflows": _as_int(model.get("skipped_steps", 0))}


def _as_int(value: Any) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def _moments(optim: dict[str, Any], key: str) -> list[torch.Tensor]:
    state = optim.get("base_optimizer_state") or optim["optimizer_state_dict"]
    entries = state["state"]
    return [entries[i][key].float() if key in entries.get(i, {}) else torch.zeros(0) for i in sorted(entries)]


def _stage12_geometry(optims: list[dict[str, Any]], groups: list[dict[str, torch.Size]], world: int,
                      path: str) -> tuple[dict[str, tuple[torch.Size, Any]], dict[str, list[_Flat]]]:
    """Stages 1-2: per param group, the ranks' partitions end to end (Note [DeepSpeed checkpoints])."""
    masters = [o["single_partition_of_fp32_groups"] for o in optims]
    if any(len(m) != len(groups) for m in masters):
        raise ValueError(f"load_checkpoint: {path}: {len(groups)} param groups in the model state, "
                         f"{[len(m) for m in masters]} in the optimizer files")
    paddings = optims[0].get("param_alignment_paddings")
    moments = {key: [_moments(o, key) for o in optims] for key in ("exp_avg", "exp_avg_sq")}  # per rank, per group
    flats: dict[str, list[_Flat]] = {"master": [], "exp_avg": [], "exp_avg_sq": []}
    trainable: dict[str, tuple[torch.Size, Any]] = {}
    for g, shapes in enumerate(groups):
        flats["master"].append(_Flat([masters[r][g] for r in range(world)]))
        for key, parts in moments.items():
            flats[key].append(_Flat([p[g] if g < len(p) else torch.zeros(0) for p in parts]))
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            trainable[name] = (torch.Size(shape), ("flat", g, offset))
            offset += math.prod(shape) + (paddings[g][i] if paddings is not None else 0)
        if offset > flats["master"][g].numel:
            raise ValueError(f"load_checkpoint: {path}: param group {g}'s parameters need {offset} elements, its "
                             f"partitions hold {flats['master'][g].numel}")
    return trainable, flats


def _stage3_geometry(optims: list[dict[str, Any]], groups: list[dict[str, torch.Size]], world: int,
                     path: str) -> tuple[dict[str, tuple[torch.Size, Any]], dict[str, list[_Flat]]]:
    """Stage 3: each parameter cut in ``ceil(numel / world)`` per rank, a rank's pieces end to end."""
    flats = {"master": [_Flat(list(o["fp32_flat_groups"])) for o in optims],
             "exp_avg": [_Flat(_moments(o, "exp_avg")) for o in optims],
             "exp_avg_sq": [_Flat(_moments(o, "exp_avg_sq")) for o in optims]}
    trainable: dict[str, tuple[torch.Size, Any]] = {}
    offset = 0
    for shapes in groups:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            per_rank = -(-numel // world)
            trainable[name] = (torch.Size(shape), ("cut", offset, per_rank))
            offset += per_rank
    if any(f.numel < offset for f in flats["master"]):
        raise ValueError(f"load_checkpoint: {path}: the parameters need {offset} elements per rank, the optimizer "
                         f"files hold {[f.numel for f in flats['master']]}")
    return trainable, flats


@dataclass
class _Frozen:
    """A parameter that is not trainable: its shape, and its whole value when asked (assembled then, one at a
    time: a LoRA run's frozen base model is most of the checkpoint)."""
    shape: torch.Size
    value: Callable[[], torch.Tensor]


def _frozen_values(stage: int, model: dict[str, Any], models: list[dict[str, Any]],
                   trainable: dict[str, Any]) -> dict[str, _Frozen]:
    """The parameters that are not trainable: whole in ``module`` at stages 1-2 (with the trainable ones' 16-bit
    copies and the buffers, left out here; memory-mapped), one fragment per rank at stage 3."""
    if stage < 3:
        buffers = set(model.get("buffer_names") or [])
        return {name: _Frozen(value.shape, lambda value=value: value) for name, value in model["module"].items()
                if name not in trainable and name not in buffers}

    def whole(name: str, shape: torch.Size) -> torch.Tensor:
        pieces = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
        return torch.cat(pieces)[: math.prod(shape)].view(shape)

    return {name: _Frozen(torch.Size(shape), functools.partial(whole, name, torch.Size(shape)))
            for name, shape in (model.get("frozen_param_shapes") or {}).items()}


def assemble(checkpoint: _Checkpoint, name: str, key: str, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of one trainable parameter's flattened ``key`` (master, exp_avg or exp_avg_sq)
    in fp32, reading only the pages that hold them (the files are memory-mapped)."""
    shape, where = checkpoint.trainable[name]
    numel = math.prod(shape)
    if where[0] == "universal":
        file = os.path.join(where[1], ("fp32" if key == "master" else key) + ".pt")
        if key != "master" and not os.path.isfile(file):
            return torch.zeros(stop - start)  # (no moments: the parameter never took an optimizer step)
        value = _load(file)
        value = value["param"] if isinstance(value, dict) else value  # (stage 3's conversion saves the tensor)
        if not isinstance(value, torch.Tensor) or value.numel() != numel:
            raise ValueError(f"load_checkpoint: {file} holds {getattr(value, 'shape', type(value).__name__)}, not the "
                             f"{list(shape)} of {name!r} (a tensor-parallel slice, or padding)")
        return value.reshape(-1)[start:stop].float()
    flats = checkpoint.flats[key]
    if where[0] == "flat":
        _, group, offset = where
        return flats[group].read(offset + start, stop - start).float()
    _, offset, per_rank = where  # rank r's piece is elements [r * per_rank, (r + 1) * per_rank), padded
    pieces = []
    for rank in range(start // per_rank, -(-stop // per_rank)) if per_rank else ():
        lo, hi = max(start, rank * per_rank), min(stop, (rank + 1) * per_rank)
        pieces.append(flats[rank].read(offset + lo - rank * per_rank, hi - lo))
    return torch.cat(pieces).float() if pieces else torch.zeros(0)


# ---- applying it -----------------------------------------------------------------------------------------

def load(engine: Engine, path: str, load_optimizer_states: bool, load_lr_scheduler_states: bool,
         load_module_only: bool) -> dict[str, Any]:
    """Reads, checks (every rank agreeing) and applies a DeepSpeed checkpoint; returns its client_state."""
    checkpoint, problem = None, None
    try:
        checkpoint = read(path, _param_order(engine), [name for name, _ in named_parameters(engine.module)])
        _check_against(engine, checkpoint)
    except (OSError, ValueError) as error:
        problem = error
    except (KeyError, TypeError, IndexError, AttributeError) as error:  # a layout this reader does not know
        problem = ValueError(f"load_checkpoint: {path} is not a DeepSpeed ZeRO (stage 0-3) checkpoint this version "
                             f"reads ({type(error).__name__}: {error}); nothing was changed")
    agree_on_reading(engine, problem, "the DeepSpeed checkpoint")
    assert checkpoint is not None
    with deferred_interrupts("the checkpoint load"):  # (Note [Interrupts deferred in an update])
        _apply(engine, checkpoint, load_optimizer_states and not load_module_only, load_lr_scheduler_states,
               load_module_only)
    return {k: v for k, v in checkpoint.model.items() if k not in _DEEPSPEED_KEYS}


def _param_order(engine: Engine) -> list[list[str]]:
    """The engine's trainable parameter names per param group, in the groups' order."""
    names = {id(param): name for name, param in named_parameters(engine.module)}
    return [[names[id(param)] for param in group["params"]] for group in engine.optimizer.param_groups]


def _check_against(engine: Engine, checkpoint: _Checkpoint) -> None:
    ours = trainable_params(engine)
    theirs = {canonical(name): name for name in checkpoint.trainable}
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if missing or extra:
        raise ValueError(f"load_checkpoint: the DeepSpeed checkpoint {checkpoint.path} does not match the model's "
                         f"trainable parameters (missing from it: {missing[:5]}; not in the model: {extra[:5]}); "
                         "nothing was changed")
    for name, param in ours.items():
        shape = checkpoint.trainable[theirs[name]][0]
        if tuple(shape) != tuple(param.shape):
            raise ValueError(f"load_checkpoint: parameter {name!r} is {list(param.shape)} in the model but "
                             f"{list(shape)} in the DeepSpeed checkpoint {checkpoint.path}; nothing was changed")
    frozen = {canonical(n): v for n, v in checkpoint.frozen.items()}
    ours_frozen = [(name, param) for name, param in named_parameters(engine.module) if name not in ours]
    # none saved (exclude_frozen_parameters=True): the model's own stay. (Not "the checkpoint holds no frozen
    # tensor": a tied parameter's second name, head.weight beside embed.weight, is one of those.)
    saved = any(name in frozen for name, _ in ours_frozen)
    for name, param in ours_frozen if saved else ():
        if name not in frozen:
            raise ValueError(f"load_checkpoint: frozen parameter {name!r} is not in the DeepSpeed checkpoint "
                             f"{checkpoint.path}; nothing was changed")
        if tuple(frozen[name].shape) != tuple(param.shape):
            raise ValueError(f"load_checkpoint: frozen parameter {name!r} is {list(param.shape)} in the model but "
                             f"{list(frozen[name].shape)} in the DeepSpeed checkpoint {checkpoint.path}; nothing "
                             "was changed")
    if len(checkpoint.param_groups) not in (0, len(engine.optimizer.param_groups)) and checkpoint.stage < 3:
        raise ValueError(f"load_checkpoint: the DeepSpeed checkpoint has {len(checkpoint.param_groups)} param "
                         f"groups, the engine {len(engine.optimizer.param_groups)}; nothing was changed")


def _apply(engine: Engine, checkpoint: _Checkpoint, optimizer_states: bool, scheduler_states: bool,
           module_only: bool) -> None:
    from ._gathered import write_whole_in_groups

    theirs = {canonical(name): name for name in checkpoint.trainable}
    with torch.no_grad():
        # this rank's elements only: every rank reading every parameter whole would read world-size times the
        # checkpoint (the pages of a memory-mapped file are read when touched)
        for name, param in trainable_params(engine).items():
            start, stop = local_range(param)
            if start == stop:
                continue
            located = _locate(param, "load_checkpoint")
            keys = ["master"] if module_only else ["master", "exp_avg", "exp_avg_sq"]
            for key in keys:
                value = (assemble(checkpoint, theirs[name], key, start, stop) if key == "master" or optimizer_states
                         else torch.zeros(stop - start))
                write_own(located, key, value.to(engine.device), start)
        engine.reload_params_from_shards()  # every rank: stages 1-2 gather the rest, stage 3 releases its units
        frozen = {canonical(n): v for n, v in checkpoint.frozen.items()}
        ours = trainable_params(engine)
        write_whole_in_groups(engine, [(p, frozen[n].value) for n, p in named_parameters(engine.module)
                                       if n not in ours and n in frozen])
        module = checkpoint.model["module"]
        names = set(checkpoint.model.get("buffer_names") or [])
        for name, buffer in named_buffers(engine.module):
            if name in names and name in module:
                buffer.copy_(module[name])
    if module_only:
        return
    global_steps = int(checkpoint.model.get("global_steps", 0))
    samples = checkpoint.model.get("global_samples")  # (not a count: derived from the steps instead)
    engine.restore_counters(global_steps, checkpoint.optimizer_step if optimizer_states else 0,
                            int(checkpoint.model.get("skipped_steps", 0)),
                            global_steps * engine.config.gradient_accumulation_steps, {},
                            samples if is_count(samples) else None)
    if optimizer_states:
        for group, saved in zip(engine.optimizer.param_groups, checkpoint.param_groups):
            for key in ADAM_HYPERPARAMETERS:
                if key in saved:
                    set_group_value(group, key, saved[key])
        # the scale and the counters that decide when it next grows, shrinks or spends its hysteresis, so the
        # resumed run's scale follows DeepSpeed's step by step
        if engine.config.fp16.enabled and engine.loss_scaler.dynamic and checkpoint.loss_scaler is not None:
            engine.loss_scaler.load_state_dict(checkpoint.loss_scaler)
    saved_schedule = checkpoint.model.get("lr_scheduler")
    if scheduler_states and engine.lr_scheduler is not None and saved_schedule:
        iteration = saved_schedule.get("last_batch_iteration") if isinstance(saved_schedule, dict) else None
        if iteration is not None and hasattr(engine.lr_scheduler, "last_batch_iteration"):
            # one step from the position before, as DeepSpeed's engine stepped it (Note [DeepSpeed schedule
            # timing]): the schedule's position, its last values and the groups' lr follow
            engine.lr_scheduler.last_epoch = int(iteration)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # (torch: a scheduler step before an optimizer step)
                engine.lr_scheduler.step()
