"""Stage 3 when user code touches a unit's parameters outside the gather schedule: a parameter of another
unit read inside a forward, and modules run, state dicts taken or loaded while parameters are sharded
(Note [Sharded placeholders] in _stage3.py).

Note [External parameters]
--------------------------
A module may use a parameter of another unit outside that unit's forward: a parent calling
``F.linear(x, self.child.weight)``, a head reading a tied embedding, a bias a submodule returns and its
parent adds (DeepSpeed calls these external parameters). Every module that owns stage-3 parameters gets an
``ExternalAccess`` dict as its ``_parameters``: during a forward (or a recomputation in backward), reading
a parameter whose unit is not gathered gathers that unit on the spot (every rank runs the same forward, so
every rank gathers it at the same point) and pins it; so does a unit whose forward returns one of its own
parameters. A pinned unit stays gathered through the backward, which needs the same values, and is
released when the backward ends (at the end of the forward when it runs without grad: units pinned by an
earlier grad-enabled forward stay, since its backward is still to come; after a ``retain_graph`` backward
they stay for the next one). Reads outside a forward gather nothing (Note [Sharded placeholders]).

Note [Modules of persistent units run on their own]
---------------------------------------------------
A model's own methods often run its parts without its forward: CLIP's ``get_text_features`` (the text tower,
then a projection), an encoder-decoder's ``get_encoder()`` inside ``generate``, a contrastive loss built
from both. The units inside run their own gather hooks, but the modules that own the root's parameters (the
embeddings, the projections) are no unit's, and the root was gathered only by the model's forward: whether
such a call worked depended on whether a step had just started the root's gather. A module owning parameters
of a persistent unit (the root, or a unit under ``stage3_param_persistence_threshold``: units that stay
gathered until the step anyway) gathers that unit when it runs while it is sharded, as the model's forward
would (every rank runs the same code, so every rank gathers it at the same point); it stays gathered until
the step, as after a forward. A module inside any other unit, run on its own while that unit is sharded,
still raises: nothing would release the unit after it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._module_hooks import EngineHook, outside_compiled_code
from ._stage3_unit import Unit, UnitState

if TYPE_CHECKING:
    from ._stage3 import Stage3Runtime


class ExternalAccess(dict):
    """A module's ``_parameters`` under stage 3: reading a parameter whose unit is not gathered, during a
    forward, gathers and pins that unit (Note [External parameters]). ``nn.Module.__getattr__`` reads
    parameters through ``__getitem__``; iteration (``parameters()``, ``state_dict()``) does not."""

    def __init__(self, params: dict[str, Any], unit_of_param: dict[int, Unit], runtime: Stage3Runtime) -> None:
        super().__init__(params)
        self._unit_of_param = unit_of_param
        self._runtime = runtime

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return copy.deepcopy(dict(self), memo)  # a copied module is a plain module, not this engine's

    def __reduce__(self) -> Any:
        return dict, (dict(self),)

    def __getitem__(self, name: str) -> Any:
        param = dict.__getitem__(self, name)
        if torch.compiler.is_compiling():
            # A compiled unit (torch.compile of each block) runs gathered, its hooks outside the compiled code.
            # Tracing the lookup below would specialize the graph on each parameter's id(): one graph per
            # block, and past torch._dynamo.config.recompile_limit the rest run uncompiled. A parameter of
            # another unit read in compiled code while sharded is refused as dynamo traces its placeholder
            # (Note [Hooks outside compiled code] in _module_hooks.py).
            return param
        if param is not None:
            unit = self._unit_of_param.get(id(param))
            if unit is not None and unit.state is not UnitState.GATHERED:
                self._runtime.access_external(unit)
        return param


def install_access_checks(model: nn.Module, units: list[Unit], unit_of_param: dict[int, Unit],
                          runtime: Stage3Runtime) -> list[Any]:
    """Every module owning stage-3 parameters: its ``_parameters`` become an ``ExternalAccess``, and running it,
    ``state_dict()`` and ``load_state_dict()`` while they are sharded raise, naming the parameter and the way
    out (computing on the NaN placeholders would be a silent wrong result). Returns the hook handles."""
    handles: list[Any] = []
    owner = {id(p): (unit, name) for unit in units for p, name in zip(unit.all_params, unit.all_names)}
    for module in model.modules():
        mine = [owner[id(p)] for p in module.parameters(recurse=False) if id(p) in owner]
        if mine:
            # Registered after the units' gather hooks, so a unit module gathers before it is checked.
            handles.append(module.register_forward_pre_hook(EngineHook(_gathered_check(mine, runtime))))
            # model.state_dict() (torch.save, save_pretrained) would write NaN placeholders: raise.
            handles.append(module.register_state_dict_pre_hook(
                EngineHook(lambda m, prefix, keep_vars, mine=mine: _check_state_dict(mine, runtime))))
            # model.load_state_dict() would fail on the placeholders with torch's aliasing error: name the way.
            handles.append(module.register_load_state_dict_pre_hook(
                EngineHook(lambda m, *args, mine=mine: _check_load(mine))))
    for module in model.modules():
        if any(id(p) in unit_of_param for p in module._parameters.values() if p is not None):
            module._parameters = ExternalAccess(module._parameters, unit_of_param, runtime)
    return handles


def remove_external_access(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module._parameters, ExternalAccess):
            module._parameters = dict(module._parameters)


def _gathered_check(params: list[tuple[Unit, str]], runtime: Stage3Runtime) -> Callable[..., None]:
    """The forward pre-hook of a module owning ``params``. Inside a compiled unit's forward (Note [Hooks outside
    compiled code] in _module_hooks.py) dynamo traces it: with every unit gathered it does nothing, and tracing that
    keeps the unit's graph whole (``fullgraph=True`` holds); anything else runs eagerly, past a graph break."""
    eager = outside_compiled_code(lambda: _check_gathered(params, runtime))

    def hook(module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            if all(unit.state is UnitState.GATHERED for unit, _ in params):
                return
            eager()
        else:
            _check_gathered(params, runtime)
    return hook


def _check_gathered(params: list[tuple[Unit, str]], runtime: Stage3Runtime) -> None:
    for unit, name in params:
        if unit.state is UnitState.GATHERING:  # started ahead (Note [Gathers started in the step]): lands
            unit.wait()
        if unit.state is UnitState.SHARDED and unit.persistent:
            runtime.gather_persistent_for_module(unit)  # Note [Modules of persistent units run on their own]
        if unit.state is UnitState.SHARDED:
            raise RuntimeError(
                f"parameter {name!r} is sharded by ZeRO stage 3 (unit {unit.name!r} is not gathered): run "
                f"the model through the engine, call the unit {unit.name!r} itself, or wrap the access in "
                "`with zerocore.gathered(params):`"
            )


def _check_state_dict(params: list[tuple[Unit, str]], runtime: Stage3Runtime) -> None:
    if runtime.reading_state:
        return  # the engine's own full_state_dict() gathers each unit before reading it
    name = _first_at_rest(params)
    if name is not None:
        raise RuntimeError(
            f"state_dict() of a ZeRO stage 3 model while parameter {name!r} is sharded would hold NaN "
            "placeholders: use engine.full_state_dict() (a collective: every rank calls it; rank 0 gets "
            "whole tensors), or engine.close() to get the plain model back, or wrap the call in "
            "`with zerocore.gathered(model.parameters()):`"
        )


def _check_load(params: list[tuple[Unit, str]]) -> None:
    name = _first_at_rest(params)
    if name is not None:
        raise RuntimeError(
            f"load_state_dict() into a ZeRO stage 3 model while parameter {name!r} is sharded: load inside "
            "`with zerocore.gathered(model.parameters(), modifier_rank=0): model.load_state_dict(sd)` "
            "(every rank enters the block; rank 0's values reach every rank's shard and fp32 master), or "
            "load into the plain model before zerocore.initialize()"
        )


def _first_at_rest(params: list[tuple[Unit, str]]) -> str | None:
    """The first parameter whose unit is not gathered: sharded, or its gather still in flight."""
    return next((name for unit, name in params if unit.state is not UnitState.GATHERED), None)
