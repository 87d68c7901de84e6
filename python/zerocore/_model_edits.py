"""Parameters added to a model after ``initialize`` took it.

Note [Parameters added after initialize]
----------------------------------------
The engine builds its shards, optimizer state and checkpoint layout from the parameters the model has at
``initialize``. One added later (``model.head = nn.Linear(...)``, ``layer.weight = nn.Parameter(...)``,
``resize_token_embeddings``, a PEFT adapter, ``load_state_dict(assign=True)``) would compute in the forward
but never be trained, reduced or saved: a silent wrong result (DeepSpeed and a torch optimizer built earlier
miss it alike). torch calls its global registration hooks before it sets a parameter or a submodule on a
module, so a hook that raises leaves the model as it was: assigning a parameter this engine does not manage
to one of its model's modules raises there, naming it and the way out. A utility that changes a module in
several steps is stopped at the one that adds the parameter, after the others: ``weight_norm`` has deleted
``weight`` by then (at stage 3 it is stopped computing on the sharded weight, also after the deletion), and
``register_parametrization`` has also swapped the module's class and put a property in its place. The
refusal undoes both (the property and class as ``remove_parametrizations`` does; each managed parameter
missing from the slot it had at ``initialize`` goes back there, in its place), so the user catches it with
the model as it was. Parameters the engine manages may be assigned anywhere (tying a head to an embedding,
swapping managed modules), and a module without new parameters (an activation, a wrapper around managed ones)
joins the model. Each registration in the process costs one dictionary lookup; ``close()`` hands the model
back free to change.
"""

from __future__ import annotations

import inspect
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)
from torch.nn.utils import parametrize

from ._gathered import engine_for

if TYPE_CHECKING:
    from .engine import Engine

_engine_of_module: weakref.WeakKeyDictionary[nn.Module, weakref.ReferenceType[Engine]] = weakref.WeakKeyDictionary()
# each engine's managed parameters where initialize found them: (module, {attribute: parameter} in its order),
# held weakly (values that held a module, whose hooks may hold the engine, would keep the key alive)
_Slots = tuple[weakref.ReferenceType[nn.Module], dict[str, weakref.ReferenceType[nn.Parameter]]]
_slots_of_engine: weakref.WeakKeyDictionary[Engine, list[_Slots]] = weakref.WeakKeyDictionary()
_hooks_installed = False


def track_model(engine: Engine, model: nn.Module) -> None:
    """From now on, a parameter ``engine`` does not manage cannot be added to ``model`` (see the Note)."""
    global _hooks_installed
    if not _hooks_installed:  # process-wide torch hooks, installed once: each is a dictionary lookup
        register_module_parameter_registration_hook(_on_parameter)
        register_module_module_registration_hook(_on_module)
        _hooks_installed = True
    engine_ref = weakref.ref(engine)
    for module in model.modules():
        _engine_of_module[module] = engine_ref
    slots = [(weakref.ref(module), {name: weakref.ref(param) for name, param in module._parameters.items()
                                    if engine_for(param) is engine}) for module in model.modules()]
    _slots_of_engine[engine] = [(module, params) for module, params in slots if params]


def untrack_model(engine: Engine, model: nn.Module) -> None:
    for module in model.modules():
        ref = _engine_of_module.get(module)
        if ref is not None and ref() is engine:
            del _engine_of_module[module]
    _slots_of_engine.pop(engine, None)


def _engine_of(module: nn.Module) -> Engine | None:
    ref = _engine_of_module.get(module)
    return None if ref is None else ref()


def _on_parameter(module: nn.Module, name: str, param: Any) -> None:
    engine = _engine_of(module)
    if engine is not None and param is not None and engine_for(param) is not engine:
        _refuse(engine, module, name, name)


def _on_module(module: nn.Module, name: str, submodule: Any) -> None:
    engine = _engine_of(module)
    if engine is None or submodule is None:
        return
    for param_name, param in submodule.named_parameters():
        if engine_for(param) is not engine:
            _refuse(engine, module, name, f"{name}.{param_name}")
    for inner in submodule.modules():
        _engine_of_module[inner] = weakref.ref(engine)


def _undo_part_way(engine: Engine, module: nn.Module, attribute: str) -> None:
    """What a utility changed before its assignment of ``attribute`` on ``module`` was refused (see the Note)."""
    owner = next((candidate for candidate in engine.module.modules()
                  if candidate._modules.get("parametrizations") is module), None)
    if owner is not None and type(owner).__module__ == parametrize.__name__ and attribute not in module:
        # register_parametrization(owner, attribute, ...) stopped at its last step (its class is the one
        # register_parametrization made): undo its property (and, for the owner's first parametrization, its
        # ModuleDict and class) as remove_parametrizations does
        if isinstance(inspect.getattr_static(type(owner), attribute, None), property):
            delattr(type(owner), attribute)
        if len(module) == 0:
            del owner._modules["parametrizations"]
            owner.__class__ = type(owner).__bases__[0]
    restore_emptied_slots(engine)


def restore_emptied_slots(engine: Engine) -> None:
    """Puts back each managed parameter whose slot of initialize is empty now (deleted by a utility that was
    then stopped, as ``weight_norm`` deletes ``weight`` before it computes its norm), in its place among the
    module's parameters; a slot something else fills (an attribute, a buffer, a module, a parametrization's
    property) stays as it is."""
    for home_ref, slot_refs in _slots_of_engine.get(engine, ()):
        home, slots = home_ref(), {attribute: ref() for attribute, ref in slot_refs.items()}
        if home is None:
            continue
        emptied = {attribute: param for attribute, param in slots.items()
                   if param is not None and not _taken(home, attribute)}
        if emptied:
            now = dict(home._parameters)
            home._parameters.clear()
            for attribute in slots:  # initialize's order, then what came later
                if attribute in emptied:
                    home._parameters[attribute] = emptied[attribute]
                elif attribute in now:
                    home._parameters[attribute] = now.pop(attribute)
            home._parameters.update(now)


def _taken(module: nn.Module, attribute: str) -> bool:
    return (attribute in module._parameters or attribute in module._buffers or attribute in module._modules
            or attribute in module.__dict__
            or isinstance(inspect.getattr_static(type(module), attribute, None), property))


def _refuse(engine: Engine, module: nn.Module, attribute: str, name: str) -> None:
    prefix = next((path for path, candidate in engine.module.named_modules(remove_duplicate=False)
                   if candidate is module), None)
    where = f"{prefix}.{name}" if prefix else name
    _undo_part_way(engine, module, attribute)
    raise RuntimeError(
        f"parameter {where!r} would be added to a model zerocore.initialize already took: the engine builds its "
        "shards, optimizer state and checkpoints from the parameters the model has at initialize, so it would "
        "compute in the forward but never be trained or saved. Make the change (a new head, "
        "resize_token_embeddings, an adapter, load_state_dict(assign=True)) before zerocore.initialize, or "
        "call engine.close() first and initialize again")
