"""Parameters added to a model after ``initialize`` took it.

Note [Parameters added after initialize]
----------------------------------------
The engine builds its shards, optimizer state and checkpoint layout from the parameters the model has at
``initialize``. One added later (``model.head = nn.Linear(...)``, ``layer.weight = nn.Parameter(...)``,
``resize_token_embeddings``, a PEFT adapter, ``load_state_dict(assign=True)``) would compute in the forward
but never be trained, reduced or saved: a silent wrong result (DeepSpeed and a torch optimizer built earlier
miss it alike). torch calls its global registration hooks before it sets a parameter or a submodule on a
module, so a hook that raises leaves the model as it was: assigning a parameter this engine does not manage
to one of its model's modules raises there, naming it and the way out (a utility that changes a module in
several assignments, such as a parametrization, is stopped at the one that adds the parameter, part-way).
Parameters the engine manages may be assigned anywhere (tying a head to an embedding, swapping managed
modules), and a module without new parameters (an activation, a wrapper around managed ones) joins the model.
Each registration in the process costs one dictionary lookup; ``close()`` hands the model back free to change.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from ._gathered import engine_for

if TYPE_CHECKING:
    from .engine import Engine

_engine_of_module: weakref.WeakKeyDictionary[nn.Module, weakref.ReferenceType[Engine]] = weakref.WeakKeyDictionary()
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


def untrack_model(engine: Engine, model: nn.Module) -> None:
    for module in model.modules():
        ref = _engine_of_module.get(module)
        if ref is not None and ref() is engine:
            del _engine_of_module[module]


def _engine_of(module: nn.Module) -> Engine | None:
    ref = _engine_of_module.get(module)
    return None if ref is None else ref()


def _on_parameter(module: nn.Module, name: str, param: Any) -> None:
    engine = _engine_of(module)
    if engine is not None and param is not None and engine_for(param) is not engine:
        _refuse(engine, module, name)


def _on_module(module: nn.Module, name: str, submodule: Any) -> None:
    engine = _engine_of(module)
    if engine is None or submodule is None:
        return
    for param_name, param in submodule.named_parameters():
        if engine_for(param) is not engine:
            _refuse(engine, module, f"{name}.{param_name}")
    for inner in submodule.modules():
        _engine_of_module[inner] = weakref.ref(engine)


def _refuse(engine: Engine, module: nn.Module, name: str) -> None:
    prefix = next((path for path, candidate in engine.module.named_modules(remove_duplicate=False)
                   if candidate is module), None)
    where = f"{prefix}.{name}" if prefix else name
    raise RuntimeError(
        f"parameter {where!r} would be added to a model zerocore.initialize already took: the engine builds its "
        "shards, optimizer state and checkpoints from the parameters the model has at initialize, so it would "
        "compute in the forward but never be trained or saved. Make the change (a new head, "
        "resize_token_embeddings, an adapter, load_state_dict(assign=True)) before zerocore.initialize, or "
        "call engine.close() first and initialize again")
