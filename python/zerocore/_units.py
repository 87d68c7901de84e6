"""Stage 3 units of gathering: which modules gather their parameters together, and which unit owns each
parameter.

Note [Stage 3 units]
--------------------
A unit is a module whose parameters (those not owned by a unit nested inside it) are flattened into one
buffer and gathered by one all-gather. Units come from ``units=`` (module instances and/or classes, every
instance of a class is a unit) or, by default, from the repeated blocks of the model: the children of each
``nn.ModuleList``/``nn.Sequential`` whose children all share one class (a transformer's layers), outermost
only. A repeated container inside such a block is gathered with the block: in a mixture of experts the
list of experts is one, and each rank runs the experts its tokens are routed to, so experts as units of
their own would have the ranks gather different modules (a collective every rank must issue alike;
DeepSpeed's per-module gathers hang there unless the MoE block is marked a leaf with
``set_z3_leaf_modules``). FSDP users wrap the layers for the same reason. ``units=`` nests units where
every rank runs them alike (``units=[Layer, Attention]``). A module marked by DeepSpeed's
``set_z3_leaf_modules`` (its ``_z3_leaf`` flag; also ``zerocore.deepspeed.utils``) is gathered whole, as
DeepSpeed gathers a leaf: one inside a unit already is, and one holding units becomes the unit in their
place. The root
module is always a unit and owns every parameter no other unit owns. Units nest like FSDP2's bottom-up
``fully_shard``: a parameter belongs to the innermost unit that contains it. A parameter reachable from
several units (tied embedding and LM head) belongs to their innermost common ancestor unit, so it is
gathered whenever any of its users runs. Frozen floating-point parameters (``requires_grad=False`` at
``initialize``: a LoRA model's base) are assigned the same way, into each unit's second list: they are
sharded and gathered with the unit, but have no gradient and no optimizer state (Note [Frozen shards]).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ._names import canonical


@dataclass
class UnitSpec:
    index: int
    name: str  # the module's qualified name ("" for the root)
    module: nn.Module
    parent: int | None  # index of the enclosing unit
    params: list[nn.Parameter] = field(default_factory=list)
    param_names: list[str] = field(default_factory=list)
    frozen: list[nn.Parameter] = field(default_factory=list)  # Note [Frozen shards]
    frozen_names: list[str] = field(default_factory=list)


def default_unit_modules(model: nn.Module) -> list[nn.Module]:
    """The outermost repeated blocks: children of ModuleList/Sequential containers whose children share one
    class, not searched inside a block already found (Note [Stage 3 units])."""
    found: list[nn.Module] = []
    seen: set[int] = set()

    def search(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1 and any(
                shardable(p) for c in children for p in c.parameters()
            ):
                found.extend(children)
                return
        for child in module.children():
            search(child)

    search(model)
    return found


def resolve_units(model: nn.Module, units: Sequence[nn.Module | type] | None) -> list[UnitSpec]:
    """Unit specs in module (pre-)order, the root first; every trainable parameter, and every frozen
    floating-point one, assigned to one unit."""
    if units is None:
        chosen = set(map(id, default_unit_modules(model)))
    else:
        chosen = set()
        classes = tuple(u for u in units if isinstance(u, type))
        instances = [u for u in units if not isinstance(u, type)]
        known = {id(m) for m in model.modules()}
        for unit in instances:
            if not isinstance(unit, nn.Module) or id(unit) not in known:
                raise ValueError(f"units must be modules of the model or module classes, got {unit!r}")
            chosen.add(id(unit))
        for module in model.modules():
            if classes and isinstance(module, classes):
                chosen.add(id(module))
    _gather_leaves_whole(model, chosen, explicit=units is not None)
    chosen.discard(id(model))
    specs = [UnitSpec(0, "", model, None)]
    _walk(model, "", 0, chosen, specs)
    _assign_params(model, specs)
    return specs


def leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules DeepSpeed's ``set_z3_leaf_modules`` marked (its ``_z3_leaf`` flag), outermost only, by name."""
    found: list[tuple[str, nn.Module]] = []

    def search(module: nn.Module, name: str) -> None:
        if getattr(module, "_z3_leaf", False) is True:
            found.append((name, module))
            return
        for child_name, child in module.named_children():
            search(child, f"{name}.{child_name}" if name else child_name)

    search(model, "")
    return found


def _gather_leaves_whole(model: nn.Module, chosen: set[int], explicit: bool) -> None:
    """A leaf module (Note [Stage 3 units]) is gathered whole: inside a unit it already is; with units inside
    it, it becomes the unit in their place. Units the caller named inside one are refused (the two say
    opposite things)."""
    chosen_names = {id(m): n for n, m in model.named_modules() if id(m) in chosen}
    for name, leaf in leaf_modules(model):
        inner = [m for m in leaf.modules() if m is not leaf and id(m) in chosen]
        if not inner:
            continue
        if explicit:
            raise ValueError(f"units names {chosen_names[id(inner[0])]!r}, inside {name or 'the model'!r}, which "
                             "set_z3_leaf_modules marked as a leaf (gathered whole); name the leaf as the unit, or "
                             "unset the mark")
        chosen.difference_update(id(m) for m in inner)
        chosen.add(id(leaf))


def _walk(module: nn.Module, prefix: str, current: int, chosen: set[int], specs: list[UnitSpec]) -> None:
    for name, child in module.named_children():
        qualified = f"{prefix}.{name}" if prefix else name
        unit = current
        if id(child) in chosen:
            unit = len(specs)
            specs.append(UnitSpec(unit, qualified, child, current))
        _walk(child, qualified, unit, chosen, specs)


def _ancestors(specs: list[UnitSpec], unit: int) -> list[int]:
    chain = [unit]
    while specs[chain[-1]].parent is not None:
        chain.append(specs[chain[-1]].parent)
    return chain


def _common_ancestor(specs: list[UnitSpec], units: Iterable[int]) -> int:
    units = list(units)
    common = _ancestors(specs, units[0])
    for unit in units[1:]:
        mine = set(_ancestors(specs, unit))
        common = [u for u in common if u in mine]
    return common[0]


def _assign_params(model: nn.Module, specs: list[UnitSpec]) -> None:
    owner_of_module = {id(spec.module): spec.index for spec in specs}
    users: dict[int, set[int]] = {}
    first_name: dict[int, str] = {}
    params: dict[int, nn.Parameter] = {}
    order: list[int] = []

    def visit(module: nn.Module, prefix: str, unit: int) -> None:
        unit = owner_of_module.get(id(module), unit)
        for name, param in module.named_parameters(recurse=False):
            if not shardable(param):
                continue
            key = id(param)
            if key not in users:
                qualified = canonical(f"{prefix}.{name}" if prefix else name)  # Note [Names without wrappers]
                users[key], first_name[key], params[key] = set(), qualified, param
                order.append(key)
            users[key].add(unit)
        for name, child in module.named_children():
            visit(child, f"{prefix}.{name}" if prefix else name, unit)

    visit(model, "", 0)
    for key in order:
        spec = specs[_common_ancestor(specs, users[key])]
        if params[key].requires_grad:
            spec.params.append(params[key])
            spec.param_names.append(first_name[key])
        else:
            spec.frozen.append(params[key])
            spec.frozen_names.append(first_name[key])


def shardable(param: nn.Parameter) -> bool:
    """Stage 3 shards it: trainable, or frozen and floating-point (an integer frozen tensor, a quantized
    base's packed weights, stays whole: it has no compute dtype to travel in)."""
    return param.requires_grad or param.is_floating_point()


def frozen_storage_dtype(param: nn.Parameter, compute: torch.dtype) -> torch.dtype:
    """A sharded frozen parameter's dtype: the compute dtype in mixed precision (as the trainable ones'),
    its own at fp32 (a bf16 base under fp32 adapters stays bf16, a float64 one float64)."""
    return param.dtype if compute == torch.float32 else compute
