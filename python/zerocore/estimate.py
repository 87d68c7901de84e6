"""``zerocore.estimate_memory`` and ``python -m zerocore.estimate``: the bytes a ZeRO run holds per rank, planned
by the engine's own code without a process group and without allocating the model.

Note [Memory estimate]
----------------------
The estimate is a dry run of ``zerocore.initialize``'s allocation decisions, not a formula with multipliers.
It reads the config the way ``initialize`` does (``ZeroConfig.from_deepspeed``, ``for_world_size``), picks the
trainable parameters and their order the way the engine does (``collect_trainable``; stage 3:
``resolve_units``), lays every flat buffer out with the C++ ``FlatLayout`` at the engine's alignment and bucket
cap (``BucketSizes.resolve``; stage 3: one bucket per unit), and asks the engine's ``OptimizerState`` where the
fp32 state lives and which shards keep a separate master or go through host staging; on NVMe it counts the
state file's sub-groups as the store's ``plan_sub_groups`` cuts them (``sub_group_totals``, without an object
per sub-group). From those plans it counts the bytes of the tensors the engine would allocate, category by
category, under the keys of ``memory_report()["bytes"]``.
``tests/test_estimate.py`` checks it against ``memory_report()`` right after ``initialize``, byte for byte.

Those are the bytes held between steps. A step also allocates, and frees again, gradient bucket buffers (the
reducer's pool, Note [Reducer memory]) and, in stage 3, gathered units; ``"step"`` plans them, itemized with
what it assumes: the pool holds buffers of at most the largest bucket in the dtype gradients travel in (the
reduce dtype, or the 16-bit gradients' own where the default algorithm of the device's backend -- Gloo's on the
CPU, NCCL's on a GPU -- widens at the receiver, Note [Widening reduce-scatter]), two of them (one
filling while the previous one reduces; gradients arriving out of layout order open more: in the first backward
of a Llama layer, whose norms are registered after the projections they run before, up to its buckets, Note
[Reducer memory]), and stage 3's
gathered units follow the runtime's gather and release rules and its C++ prefetch planner
(``_C.PrefetchPlanner``, the runtime's) over the units run once each in registration order,
as in a step after the first (which records the order); a model that calls a unit twice, reads another unit's
parameters (Note [External parameters]) or nests units whose own parameters are used around their children's
can gather more or less than planned.

Every rank's shard of a flat buffer has the same size (the layout pads every bucket to a multiple of
``world_size * alignment``), so every rank holds the same bytes; ``per_rank`` lists them, planned once.
"""

from __future__ import annotations

import numbers
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._buckets import BucketSizes, stage3_prefetch_budget
from ._config_values import INT64_MAX
from ._construction import optimizer_state_for, reduction_wire_dtype
from ._gather_spares import spare_capacity
from ._model_checks import check_plain_model, check_trainable_dtypes, collect_trainable, model_device
from ._native import _C
from ._host_params import offloads_to_host
from ._nvme_params import plan_param_file
from ._nvme_state import pipeline_depth, sub_group_totals
from ._policy import StagePolicy
from ._sharded_buffer import ALIGNMENT
from ._stage3 import NO_BUCKET_CAP
from ._topology import check_zeropp_partitions
from ._units import UnitSpec, frozen_storage_dtype, resolve_units
from .config import ZeroConfig, hidden_size_of
from .layout import FlatLayout

__all__ = ["estimate_memory", "main"]

_DEVICE_KEYS = ("params", "grads", "gathered_params_live", "gathered_params_peak_last_step", "hpz_secondary",
                "gather_spares", "reduce_buckets",
                "allgather_buckets", "temporaries", "frozen_params")
_STATE_KEYS = ("master_params", "optimizer_moments")  # where the optimizer state lives
_HOST_KEYS = ("offload_staging", "nvme_buffers", "nvme_param_buffers", "param_offload")
_STEP_BUFFERS = 2  # reducer pool buffers planned for a step: one filling, one reducing (Note [Reducer memory])


@dataclass(frozen=True)
class _Unit:
    """The flat buffers the engine would build for a unit (stages 1-2: the whole model): its trainable
    parameters' layout, and (stage 3) its frozen parameters' (Note [Frozen shards]) and its place in the
    unit tree."""

    layout: FlatLayout | None  # None: a stage-3 unit of frozen parameters only
    trainable: int  # elements of its parameters, padding excluded
    parent: int | None = None  # stage 3: the nearest enclosing unit that owns parameters (index in the plan)
    root: bool = True  # stage 3: the model's own unit (always persistent)
    frozen: tuple[tuple[FlatLayout, int], ...] = ()  # stage 3: each frozen buffer's layout and element bytes

    def storages(self, width: int) -> list[tuple[FlatLayout, int]]:
        """Every buffer's layout and element bytes (``width``: the trainable buffer's, the compute dtype's)."""
        return ([] if self.layout is None else [(self.layout, width)]) + list(self.frozen)

    def numel(self) -> int:
        trainable = 0 if self.layout is None else self.layout.total_size
        return trainable + sum(layout.total_size for layout, _ in self.frozen)

    def nbytes(self, width: int) -> int:
        return sum(layout.total_size * size for layout, size in self.storages(width))


@dataclass(frozen=True)
class _Plan:
    config: ZeroConfig
    policy: StagePolicy
    device: torch.device
    state: Any  # the engine's OptimizerState for this config, with nothing registered or allocated
    buffers: list[_Unit]
    frozen_bytes: int  # frozen parameters held whole (stage 3's frozen shards are in ``buffers``)
    approximate: bool
    world: int

    @property
    def width(self) -> int:
        return _width(self.config.compute_dtype)


def estimate_memory(
    model_or_param_count: nn.Module | int,
    config: ZeroConfig | Mapping[str, Any] | str | os.PathLike[str],
    world_size: int,
    rank: int | None = None,
    *,
    device: torch.device | str | None = None,
    param_groups: Iterable[Mapping[str, Any]] | None = None,
    units: Sequence[nn.Module | type] | None = None,
    strict: bool = True,
    hidden_size: int | None = None,
) -> dict[str, Any]:
    """The bytes a rank holds under ``zerocore.initialize(model, config)`` at ``world_size`` ranks, by category,
    planned by the engine's own layout code without running it (Note [Memory estimate]).

    Args:
        model_or_param_count: the model (its tensors are never read or allocated: build a large one under
            ``with torch.device("meta"):``), or a number of trainable parameters, taken as ONE flat tensor of
            that many elements: padding is then a lower bound of a real model's (which pads every bucket or
            unit), the result says ``"approximate": True`` and has no ``"step"`` plan (one tensor would be one
            giant bucket or stage-3 unit). A meta-device model may be estimated at any stage (only the engine
            needs stage 3 to materialize one).
        config: as for ``initialize``: a :class:`ZeroConfig`, or a DeepSpeed config as a dict or JSON path.
        world_size: data-parallel ranks (>= 1).
        rank: the rank to report; None: the largest bytes of any rank per category, with every rank's in
            ``per_rank``.
        device: where the engine would run (default: the model's device; for a meta-device model or a count,
            the current CUDA device if there is one, else the CPU). Pass ``"cuda"`` to plan GPU training from a
            machine without one.
        param_groups, units, strict: as for ``initialize`` (they change the order of parameters, stage 3's
            units, and whether unsupported DeepSpeed keys raise).
        hidden_size: for a DeepSpeed config's ``"auto"`` bucket sizes (default: the model's
            ``config.hidden_size``, as ``initialize`` does).

    Returns:
        ``stage``, ``world_size``, ``rank``, ``device``, ``compute_dtype``, ``psi`` / ``psi_padded`` (trainable
        elements without / with padding), ``bytes`` (the keys of ``memory_report()["bytes"]``: what
        ``memory_report()`` reports right after ``initialize``), ``nvme_file_bytes`` and
        ``nvme_param_file_bytes`` (its ``["nvme"]["file_bytes"]`` and ``["param_file_bytes"]``), ``total_bytes``
        (all of ``bytes``: device and host memory, as its ``total_bytes``), ``device_bytes`` and ``host_bytes``
        (that total split by where each category lives, ``where``), ``optimizer_placement`` (``"cuda"``,
        ``"cpu"`` or ``"nvme"``, as ``memory_report``), ``pinned_host`` (offloaded state or parameter shards in
        page-locked memory), ``approximate``, ``step`` (the transient bytes of a training step, planned; None
        for a count) and, with ``rank=None``, ``per_rank``.

    Raises:
        ValueError: what ``initialize`` would raise for this config and model (an invalid or unsupported key,
            a float64 trainable parameter, ...), a world size below 1, a rank outside
            ``[0, world_size)``, or a parameter count below 1.
    """
    world = _positive_int(world_size, "world_size")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, numbers.Integral)
                             or not 0 <= rank < world):
        raise ValueError(f"rank must be None or an int in [0, {world}), got {rank!r}")
    if hidden_size is not None:  # checked even where no "auto" value uses it: a typo must not pass unseen
        hidden_size = _positive_int(hidden_size, "hidden_size")
    plan = _plan(model_or_param_count, config, world, device, param_groups, units, strict, hidden_size)
    # Every rank holds the same bytes (equal shards, Note [Memory estimate]), so one rank is planned: a loop over
    # the ranks made --world 1000000000 run for hours to repeat one answer.
    one = _rank_bytes(plan, 0 if rank is None else rank)
    result: dict[str, Any] = {
        "stage": plan.policy.stage,
        "world_size": world,
        "rank": rank,
        "device": str(plan.device),
        "compute_dtype": str(plan.config.compute_dtype).replace("torch.", ""),
        "psi": sum(b.trainable for b in plan.buffers),
        "psi_padded": sum(b.layout.total_size for b in plan.buffers if b.layout is not None),
        "bytes": dict(one["bytes"]),
        **{k: one[k] for k in ("nvme_file_bytes", "nvme_param_file_bytes", "total_bytes", "device_bytes",
                               "host_bytes")},
        "where": {k: v for k, v in _where(plan).items() if k in one["bytes"]},
        "optimizer_placement": "nvme" if plan.state.nvme is not None else plan.state.placement.type,
        # OptimizerState and HostParamShards pin host memory when this machine has CUDA; the estimate asks about
        # the target device
        "pinned_host": plan.device.type == "cuda" and (
            (plan.state.nvme is None and plan.state.placement.type == "cpu"
             and plan.config.zero_optimization.offload_optimizer.pin_memory)
            or (offloads_to_host(plan.config.zero_optimization.offload_param, plan.device)
                and plan.config.zero_optimization.offload_param.pin_memory)),
        "approximate": plan.approximate,
    }
    result["step"] = None if plan.approximate else _step_plan(plan, result["total_bytes"])
    if rank is None:
        result["per_rank"] = _EveryRank(one, world)
    return result


class _EveryRank(Sequence[dict[str, Any]]):
    """``per_rank``: every rank's bytes, ``world_size`` entries, each rank 0's with its own ``"rank"``; made on
    access, so a world of any size costs one rank's planning."""

    def __init__(self, one: dict[str, Any], world: int) -> None:
        self._one, self._world = one, world

    def __len__(self) -> int:
        return self._world

    def __getitem__(self, index: Any) -> Any:
        ranks = range(self._world)[index]  # raises IndexError / TypeError as a list would
        if isinstance(ranks, range):
            return [self._entry(r) for r in ranks]
        return self._entry(ranks)

    def _entry(self, rank: int) -> dict[str, Any]:
        return {**self._one, "rank": rank, "bytes": dict(self._one["bytes"])}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"_EveryRank(world_size={self._world}, bytes={self._one['bytes']})"


# ---- the plan: the engine's decisions, without tensors -------------------------------------------------------
def _plan(model: nn.Module | int, config: Any, world: int, device: Any, param_groups: Any, units: Any,
          strict: bool, hidden_size: int | None) -> _Plan:
    count = None if isinstance(model, nn.Module) else _param_count(model)
    if not isinstance(config, ZeroConfig):  # as initialize()
        hidden = hidden_size if hidden_size is not None or count is not None else hidden_size_of(model)
        config = ZeroConfig.from_deepspeed(config, strict=strict, hidden_size=hidden)
    config = config.for_world_size(world)  # as Engine.__init__
    # as build_comms (LOCAL_WORLD_SIZE describes this machine, not the one planned for: the config's node size)
    check_zeropp_partitions(config.zero_optimization, world, config.zero_optimization.zero_node_size or None)
    policy = StagePolicy.for_stage(config.zero_optimization.stage)
    if count is None:
        check_plain_model(model)
        check_trainable_dtypes(model)
        where = _engine_device(model_device(model), device)
    else:
        where = _engine_device(None, device)
    state = optimizer_state_for(config, where, 0)  # the engine's own rule (raises for unsupported offload)
    if count is not None:
        layout = FlatLayout([count], world, ALIGNMENT, NO_BUCKET_CAP if policy.params_sharded else
                            BucketSizes.resolve(config.zero_optimization, config.reduce_dtype).reduce)
        return _Plan(config, policy, where, state, [_Unit(layout, count)], 0, True, world)
    groups = collect_trainable(model, param_groups, config.optimizer)  # also checks param_groups, as initialize
    if policy.params_sharded:
        buffers = _stage3_buffers(model, units, world, config.compute_dtype)
    else:  # _construction.whole_model_buffer: every trainable parameter, in param-group order, in reduce buckets
        sizes = [p.numel() for g in groups for p in g["params"]]
        cap = BucketSizes.resolve(config.zero_optimization, config.reduce_dtype).reduce
        buffers = [_Unit(FlatLayout(sizes, world, ALIGNMENT, cap), sum(sizes))]
    sharded = {id(p) for spec in resolve_units(model, units) for p in spec.frozen} if policy.params_sharded else set()
    return _Plan(config, policy, where, state, buffers, _frozen_bytes(model, config.compute_dtype, sharded), False,
                 world)


def _stage3_buffers(model: nn.Module, units: Any, world: int, compute: torch.dtype) -> list[_Unit]:
    """Stage3Runtime's units: per unit that owns parameters, in module order, a single-bucket buffer of its
    trainable parameters and one per dtype of its frozen ones (Stage3Runtime._new_unit), each unit with the
    nearest enclosing unit that is one too."""
    specs: list[UnitSpec] = resolve_units(model, units)
    slot_of: dict[int, int] = {}
    buffers: list[_Unit] = []
    for spec in specs:
        parent = spec.parent
        while parent is not None and parent not in slot_of:
            parent = specs[parent].parent
        if spec.params or spec.frozen:
            sizes = [p.numel() for p in spec.params]
            by_dtype: dict[torch.dtype, list[int]] = {}
            for param in spec.frozen:
                by_dtype.setdefault(frozen_storage_dtype(param, compute), []).append(param.numel())
            frozen = tuple((FlatLayout(numels, world, ALIGNMENT, NO_BUCKET_CAP), _width(dtype))
                           for dtype, numels in by_dtype.items())
            slot_of[spec.index] = len(buffers)
            buffers.append(_Unit(FlatLayout(sizes, world, ALIGNMENT, NO_BUCKET_CAP) if sizes else None, sum(sizes),
                                 None if parent is None else slot_of[parent], spec.parent is None, frozen))
    return buffers


def _frozen_bytes(model: nn.Module, compute: torch.dtype, sharded: set[int]) -> int:
    """memory_report's frozen_params after initialize, of the frozen parameters held whole (not the
    ``sharded`` ids): floating ones follow the compute dtype (``module.bfloat16()`` or ``.half()`` in stages 1-2,
    ``cast_untracked_tensors`` in stage 3); tied ones count once."""
    total = 0
    for param in model.parameters():
        if not param.requires_grad and id(param) not in sharded:
            size = _width(compute) if param.is_floating_point() and compute != torch.float32 else param.element_size()
            total += param.numel() * size
    return total


def _engine_device(model_device: torch.device | None, device: Any) -> torch.device:
    """The engine's device: the model's, or for a meta-device model (or a count) the current CUDA device if
    any, else the CPU; ``device`` overrides."""
    if device is not None:
        try:
            where = torch.device(device)
        except (RuntimeError, TypeError) as error:  # torch names every device type it knows: one line is enough
            raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}") from error
    elif model_device is not None and model_device.type != "meta":
        where = model_device
    else:
        where = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if where.type == "meta":
        raise ValueError("device='meta' is not where an engine runs; pass 'cuda' or 'cpu'")
    if where.type == "cuda" and where.index is None:  # tensors on "cuda" report "cuda:<current>"
        where = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return where


# ---- bytes held between steps (memory_report()["bytes"] after initialize) ----------------------------------
def _rank_bytes(plan: _Plan, rank: int) -> dict[str, Any]:
    """One rank's bytes: ShardedBuffer.memory(), OptimizerState.memory(), the stage-3 runtime's and the
    report's own entries, in memory_report()'s order."""
    width, policy = plan.width, plan.policy
    trainable = [b.layout for b in plan.buffers if b.layout is not None]
    shards = [bucket.shard_size for layout in trainable for bucket in layout.buckets]  # one per bucket per buffer
    full = sum(layout.total_size for layout in trainable)
    # every buffer's shard in the order the engine builds them (a unit's trainable one, then its frozen ones),
    # with its element bytes and whether it is a frozen one
    placed = [(layout.shard_size, size, layout is not b.layout)
              for b in plan.buffers for layout, size in b.storages(width)]
    offload = plan.config.zero_optimization.offload_param
    offloaded, param_file, bounce, on_host = [False] * len(placed), 0, 0, 0
    if policy.params_sharded and offload.device == "nvme":  # Note [NVMe parameter shards]
        offloaded, param_file, bounce = plan_param_file([(n, size) for n, size, _ in placed],
                                                        int(offload.max_in_cpu))
    elif policy.params_sharded and offloads_to_host(offload, plan.device):  # Note [Host parameter shards]
        offloaded, on_host = [True] * len(placed), sum(n * size for n, size, _ in placed)
    in_memory = sum(n * size for (n, size, frozen), away in zip(placed, offloaded) if not away and not frozen)
    frozen_shards = sum(n * size for (n, size, frozen), away in zip(placed, offloaded) if not away and frozen)
    items = {"params": in_memory if policy.params_sharded else width * full,
             "grads": _width(plan.config.accumulation_dtype) * (sum(shards) if policy.grads_sharded else full)}
    state, nvme_file = _state_bytes(plan, shards)
    items.update(state)
    items["nvme_param_buffers"] = bounce
    items["param_offload"] = on_host
    if policy.params_sharded:
        items.update({"gathered_params_live": 0, "gathered_params_peak_last_step": 0,  # all units at rest
                      "hpz_secondary": 0, "gather_spares": 0})  # spares are kept from the first step on
    items.update({"reduce_buckets": 0,  # the reducer's pool is allocated by the first backward
                  "allgather_buckets": 0, "temporaries": 0, "frozen_params": frozen_shards + plan.frozen_bytes})
    device_bytes = sum(v for k, v in items.items() if _where(plan)[k] == "device")
    return {"rank": rank, "bytes": items, "nvme_file_bytes": nvme_file, "nvme_param_file_bytes": param_file,
            "total_bytes": sum(items.values()),
            "device_bytes": device_bytes, "host_bytes": sum(items.values()) - device_bytes}


def _state_bytes(plan: _Plan, shards: list[int]) -> tuple[dict[str, int], int]:
    """OptimizerState.memory() after build(): fp32 master (separate shards only) and moments in memory, host
    staging, or the NVMe file's sub-groups and the pipeline's buffers; and the file's size."""
    state, compute, width = plan.state, plan.config.compute_dtype, plan.width
    separate = state.keeps_separate_master(compute, plan.device)  # every shard: compute dtype, engine's device
    out = {"master_params": 0, "optimizer_moments": 0, "offload_staging": 0, "nvme_buffers": 0}
    if state.nvme is not None:
        groups, largest, size = sub_group_totals(shards, [separate] * len(shards), state.nvme.sub_group_size)
        out["nvme_buffers"] = pipeline_depth(groups) * largest
        return out, size
    total = sum(shards)
    out["master_params"] = 4 * total if separate else 0
    out["optimizer_moments"] = 2 * 4 * total
    if state.stages_through_host(plan.device):  # gradients in; 16-bit parameters out when there is a master
        grad_width = _width(plan.config.accumulation_dtype)
        out["offload_staging"] = total * (grad_width + (width if separate and compute != torch.float32 else 0))
    return out, 0


def _where(plan: _Plan) -> dict[str, str]:
    """"device" or "host" for each category: the optimizer state follows its placement, staging and NVMe
    buffers are host memory, everything else lives with the parameters."""
    on_device = plan.device.type != "cpu"
    state_on_device = plan.state.nvme is None and plan.state.placement.type != "cpu"
    where = {k: "device" if on_device else "host" for k in _DEVICE_KEYS}
    where.update({k: "device" if state_on_device else "host" for k in _STATE_KEYS})
    where.update({k: "host" for k in _HOST_KEYS})
    return where


# ---- what a step allocates and frees again -----------------------------------------------------------------
def _step_plan(plan: _Plan, total: int) -> dict[str, Any]:
    """The transient bytes of a training step, with what they assume (Note [Memory estimate])."""
    buckets = [bucket.padded_size for b in plan.buffers if b.layout is not None for bucket in b.layout.buckets]
    # Stage 1 reduces its full gradient buffer in place when it is in the dtype gradients travel in (build_reducer).
    wire = reduction_wire_dtype(plan.config, plan.device, plan.world)
    in_place = not plan.policy.grads_sharded and wire == plan.config.accumulation_dtype
    buffer = 0 if in_place or not buckets else max(buckets) * _width(wire)  # (none: a frozen model)
    count = 0 if in_place else min(_STEP_BUFFERS, len(buckets))
    gathered = _stage3_gathered_peak(plan) if plan.policy.params_sharded else 0
    # hpZ: between forward and backward every unit's 1/K slice of each of its buffers is held
    hpz = plan.config.zero_optimization.zero_hpz_partition_size
    secondary = (sum(layout.total_size // hpz * size for b in plan.buffers for layout, size in b.storages(plan.width))
                 if plan.policy.params_sharded and hpz > 1 else 0)
    # stage 3 on the CPU: released units' memory kept for the next gathers, at most the two largest units
    # (Note [Spare gather storage])
    spares = (spare_capacity([b.nbytes(plan.width) for b in plan.buffers], 1)
              if plan.policy.params_sharded and plan.device.type == "cpu" else 0)
    return {"reduce_bucket_buffer": buffer, "reduce_bucket_buffers": count, "reduce_buckets": count * buffer,
            "reduce_wire_dtype": str(wire),
            "gathered_params_peak": gathered, "hpz_secondary_peak": secondary, "gather_spares_peak": spares,
            "peak_bytes": total + count * buffer + gathered + secondary + spares,
            "assumes": f"{count} reduce bucket buffer(s) of the largest bucket in flight"
                       + ("; stage 3: units run once each, in registration order, none reading another "
                          "unit's parameters" if plan.policy.params_sharded else "")}


def _stage3_gathered_peak(plan: _Plan) -> int:
    """Gathered bytes at the peak of a step after the first (which records the order prefetch follows):
    Stage3Runtime's gather / release rules and the C++ prefetch planner, over the units run once each in
    registration order (a unit's forward encloses its nested units'; backward runs it in reverse)."""
    zo = plan.config.zero_optimization
    prefetch_budget = stage3_prefetch_budget(zo)[0]
    numel = [b.numel() for b in plan.buffers]  # what the prefetch cap counts
    nbytes = [b.nbytes(plan.width) for b in plan.buffers]
    persistent = [b.root or n < zo.stage3_param_persistence_threshold for b, n in zip(plan.buffers, numel)]
    order = list(range(len(numel)))  # the recorded forward order
    children: dict[int | None, list[int]] = {}
    for slot, b in enumerate(plan.buffers):
        children.setdefault(b.parent, []).append(slot)
    sharded = bytearray(b"\x01" * len(numel))  # read in place by the planner, as the runtime's
    planner = _C.PrefetchPlanner(order, numel, persistent)
    live = live_bytes = peak = 0

    def gather(slot: int) -> None:
        nonlocal live, live_bytes, peak
        sharded[slot] = False
        live += numel[slot]
        live_bytes += nbytes[slot]
        peak = max(peak, live_bytes)

    def release(slot: int) -> None:
        nonlocal live, live_bytes
        if not sharded[slot] and not persistent[slot]:
            sharded[slot] = True
            live -= numel[slot]
            live_bytes -= nbytes[slot]

    post_order: list[int] = []

    def forward(slot: int) -> None:  # pre_forward, the nested units, post_forward
        if sharded[slot]:
            gather(slot)
        for ahead in planner.forward(position=slot + 1, unit_sharded=sharded, live_elements=live,
                                     max_live=zo.stage3_max_live_parameters, prefetch_budget=prefetch_budget):
            gather(ahead)
        for child in children.get(slot, []):
            forward(child)
        post_order.append(slot)
        release(slot)

    for root in children.get(None, []):
        forward(root)
    open_units: list[int] = []  # gathered for their backward, their subtree's gradients still due
    for slot in reversed(post_order):
        while open_units and not _encloses(plan.buffers, open_units[-1], slot):
            release(open_units.pop())
        if sharded[slot]:
            gather(slot)
        ahead = planner.backward(unit=slot, visit=0, unit_sharded=sharded, live_elements=live,
                                 max_live=zo.stage3_max_live_parameters)
        if ahead is not None:
            gather(ahead)
        open_units.append(slot)
    return peak


def _encloses(buffers: list[_Unit], outer: int, inner: int) -> bool:
    parent: int | None = inner
    while parent is not None and parent != outer:
        parent = buffers[parent].parent
    return parent == outer


# ---- small helpers -----------------------------------------------------------------------------------------
def _width(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _positive_int(value: Any, name: str) -> int:
    # the layout counts in 64-bit elements: a larger value would reach it as a TypeError from pybind11
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= INT64_MAX:
        raise ValueError(f"{name} must be an int in [1, 2**63 - 1], got {value!r}")
    return int(value)


def _param_count(value: Any) -> int:
    """A parameter count: an int, or an integral float (``7e9``)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= INT64_MAX:
        raise ValueError("model_or_param_count must be an nn.Module or a number of parameters in [1, 2**63 - 1], "
                         f"got {value!r}")
    return int(value)


# ---- python -m zerocore.estimate (the command line lives in _estimate_cli.py) ---------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m zerocore.estimate``: prints the estimate as a table (or JSON); 2 on bad arguments."""
    from ._estimate_cli import main as cli

    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
