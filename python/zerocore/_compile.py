"""``engine.compile()``: DeepSpeed's way to put a wrapped model under ``torch.compile`` after ``initialize``.

Note [Compiling through the engine]
-----------------------------------
Accelerate calls ``engine.compile(backend=..., compile_kwargs=...)`` when its dynamo plugin is on, and some
DeepSpeed loops call it themselves; DeepSpeed compiles its module in place there. What is compiled depends on
what the stage keeps out of the compiled code:

* stages 1-2: the whole module, in place (``module.compile()``, as DeepSpeed). The parameters are whole, but
  after ``step()`` their all-gathers land on first read (Note [Gathers land on first read]), which compiled
  code cannot do, so from here on every forward lands them before it runs, as for a model compiled before
  ``initialize``.
* stage 3: each unit's ``forward``, the innermost units only. The gather and release hooks run in the unit's
  ``__call__``, outside the compiled ``forward``, as with blocks compiled one by one before ``initialize``
  (``model.layers[i] = torch.compile(layer)``, torchtitan's way with FSDP2); a unit that contains another
  unit, and the root's own code between the units, run uncompiled, so each unit's graph is whole
  (``fullgraph=True`` holds; ``torch.compile(model)`` of the whole model also works, breaking its graph at
  each unit's hooks: Note [Hooks outside compiled code]). A unit compiled before ``initialize`` is left as
  it is.

Compiling changes no result: the compiled code computes what the eager code does (bitwise with the
``aot_eager`` backend, tested). Like DeepSpeed's, it lasts for the module's life: ``close()`` hands back the
model with its compiled forwards.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._module_hooks import EngineHook, outside_compiled_code

if TYPE_CHECKING:
    from .engine import Engine


def land_gathers_before_compiled_forwards(engine: Engine) -> Any:
    """Stages 1-2: a model compiled after ``initialize`` and called directly (``torch.compile(model)(x)``, or
    ``model.compile()``) cannot land a parameter's all-gather on its first read (Note [Gathers land on first
    read]), which dynamo had refused to trace. So the root's pre-hook, when dynamo traces it with gathers in
    flight, lands them all eagerly past a graph break, as the engine's forward does for compiled blocks (dynamo
    guards on the count, so the compiled forward lands them whenever some are in flight); uncompiled it does
    nothing. Returns the hook's handle."""
    land = outside_compiled_code(engine.land_param_gathers)

    def hook(module: nn.Module, args: Any) -> None:
        # (the engine's forward lands them before a compiled module runs: its graph stays whole then)
        if torch.compiler.is_compiling() and any(buffer.gathers_in_flight for buffer in engine.buffers):
            land()
    return engine.module.register_forward_pre_hook(EngineHook(hook), prepend=True)


def is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled code of its own: ``torch.compile(module)``'s wrapper, or compiled in place
    by ``module.compile()``."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # (not imported: nothing was compiled)
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return True
    return module.__dict__.get("_compiled_call_impl") is not None


def compile_engine(engine: Engine, backend: str | Callable[..., Any], compile_kwargs: Mapping[str, Any] | None,
                   schedule: Any, compiled_autograd_enabled: bool) -> list[str]:
    """See Note [Compiling through the engine]. Returns the names of the modules compiled ("" for the root)."""
    if schedule is not None:
        raise ValueError("engine.compile(schedule=...): DeepSpeed's DeepCompile schedules are not supported; call "
                         "engine.compile() without a schedule")
    if compiled_autograd_enabled:
        raise ValueError("engine.compile(compiled_autograd_enabled=True) is not supported: zerocore's gradient "
                         "hooks run in the eager autograd engine; leave it False")
    if engine.is_compiled:  # (an instance forward can be anyone's, e.g. Accelerate's output cast: not a marker)
        return []
    kwargs = dict(compile_kwargs or {})
    if "backend" in kwargs:
        raise ValueError("engine.compile(): give the backend as backend=..., not inside compile_kwargs")
    if engine.stage3 is None:
        if is_compiled_module(engine.module):
            return []
        engine.module.compile(backend=backend, **kwargs)
        return [""]
    runtime = engine.stage3
    enclosing = {unit.spec.parent for unit in runtime.units}
    compiled = []
    for unit in runtime.units:
        module = unit.spec.module
        if unit.spec.parent is None or unit.index in enclosing or is_compiled_module(module):
            continue
        # an instance attribute: nn.Module.__call__ runs the hooks, then this
        module.forward = torch.compile(module.forward, backend=backend, **kwargs)
        compiled.append(unit.name)
    return compiled
