"""``deepspeed.runtime.zero.partition_parameters`` (``deepspeed.zero``) for scripts switched to zerocore (``import
zerocore.deepspeed as deepspeed``): ``GatheredParameters``, ``register_external_parameter`` /
``unregister_external_parameter`` (zerocore gathers such parameters itself), ``Init`` where it asks for nothing
zerocore would do otherwise, and ``ZeroParamStatus``, the type of a stage-3 parameter's ``ds_status`` (Note
[DeepSpeed's parameter attributes])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from torch import nn

from ...._ds_param_attributes import ZeroParamStatus
from ...._gathered import _engine_for, gathered

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]


def GatheredParameters(params: Iterable[nn.Parameter] | nn.Parameter, modifier_rank: int | None = None,  # noqa: N802
                       fwd_module: nn.Module | None = None, enabled: bool = True) -> contextlib.AbstractContextManager:
    """DeepSpeed's: the parameters whole inside the block, ``modifier_rank``'s changes kept
    (:func:`zerocore.gathered`). As in DeepSpeed, parameters no engine manages are passed over (nothing to gather),
    so a block over a model not yet given to ``initialize`` does nothing. ``fwd_module`` (DeepSpeed's registration
    of parameters read outside their module) is not needed: zerocore gathers those itself (Note [External
    parameters])."""
    del fwd_module
    params = [params] if isinstance(params, nn.Parameter) else list(params)
    managed = [param for param in params if _engine_for(param) is not None]
    if not enabled or not managed:
        return contextlib.nullcontext()
    return gathered(managed, modifier_rank=modifier_rank)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's: declares that ``module``'s forward uses ``parameter`` of another module, so DeepSpeed gathers it
    with ``module``. zerocore finds such uses itself and gathers the parameter for as long as it is used (Note
    [External parameters]), so this only checks its arguments, as DeepSpeed does."""
    _check_external(module, parameter, "register_external_parameter")


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's undoing of :func:`register_external_parameter`: nothing to undo here either."""
    _check_external(module, parameter, "unregister_external_parameter")


def _check_external(module: Any, parameter: Any, call: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"deepspeed.zero.{call}: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"deepspeed.zero.{call}: parameter must be an nn.Parameter, got {type(parameter).__name__}")


class Init:
    """DeepSpeed's ``zero.Init`` builds modules with their parameters already partitioned, and code that then
    writes into them (a custom init after construction) silently writes nothing (deepspeedai/DeepSpeed#2650;
    USER_PAINS #6). zerocore's way has no such trap: build the model as it is, or on the meta device (``with
    torch.device("meta"):``) with ``init_fn=`` for ``zerocore.initialize`` (the model's own init otherwise), which
    shards it at stage 3. So ``Init(enabled=False)``, and ``Init(module=...)`` (which partitions a built model, as
    ``initialize`` does anyway), do nothing; an enabled ``Init`` around construction is refused, saying so."""

    def __init__(self, module: nn.Module | None = None, *args: Any, enabled: bool = True, **kwargs: Any) -> None:
        if enabled and module is None:
            raise RuntimeError(
                "deepspeed.zero.Init: zerocore does not partition modules as they are built (code that writes into "
                "them afterwards would silently write nothing, DeepSpeed's trap). Build the model as it is (stage 3 "
                "shards it at initialize), or for a model too large to build whole, under torch.device('meta') and "
                "pass zerocore.initialize(..., init_fn=...) (default: the model's own init); remove zero.Init or "
                "pass enabled=False")

    def __enter__(self) -> Init:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
