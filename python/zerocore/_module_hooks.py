"""The hooks the engine puts on the model's modules: run eagerly under torch.compile, inert in a copy of the model.

Note [Copies of an engine's model]
----------------------------------
A deep copy of a model the engine holds (an EMA model, timm's ``ModelEmaV2``, a frozen reference model for
RLHF, made inside ``zerocore.gathered()`` at stage 3) or a pickled one (``torch.save(model)``) should be a
plain model, as under DDP. torch copies a module's hooks along with it, and the engine's would then run its
gathers and checks for the original's parameters: a copy evaluated on rank 0 alone diverged the ranks, every
forward of the copy gathered the original's units, its ``state_dict()`` raised whenever the original was
sharded, and a local function made the pickle fail. So each hook the engine registers on a module is an
:class:`EngineHook`, whose copies (deep copy or pickle) do nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


# Note [Hooks outside compiled code]
# ----------------------------------
# Stage 3's module hooks gather, release, prefetch and check units: collectives, storage resizes and class
# swaps that dynamo must not trace (a traced gather would be baked into a graph, or fail inside
# ``attach_views``). Each hook is wrapped in ``torch.compiler.disable``, as FSDP2 leaves its hooks out of
# dynamo by default (``skip_fsdp_hooks``): a compiled model breaks its graph at each unit's hooks, runs them
# eagerly, and compiles the code between them, so ``torch.compile(model)`` (or ``model.compile()``) of a
# whole stage-3 model runs each unit's forward compiled with its parameters gathered. Dynamo guards a
# tensor's Python class, so compiled code that meets a parameter still sharded (one read outside its unit's
# forward) recompiles, and the retrace refuses it (Note [Sharded parameters refuse compute]) instead of
# computing on a placeholder. Outside compiled code the wrapper costs one function call per hook.
def outside_compiled_code(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, run eagerly where a compiled model calls it (Note [Hooks outside compiled code])."""
    return torch.compiler.disable(hook, recursive=True)


class EngineHook:
    """A module hook of the engine's: calls ``fn``, eagerly where compiled code calls it when ``eager``
    (Note [Hooks outside compiled code]); its copies are inert (Note [Copies of an engine's
    model])."""

    def __init__(self, fn: Callable[..., Any] | None, eager: bool = False) -> None:
        self._fn = outside_compiled_code(fn) if eager and fn is not None else fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._fn
        return None if fn is None else fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> EngineHook:
        return EngineHook(None)

    def __reduce__(self) -> tuple[type, tuple[None]]:
        return EngineHook, (None,)
