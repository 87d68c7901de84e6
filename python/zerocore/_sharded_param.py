"""Parameters whose values are not (all) on this rank guard every read: a stage-3 parameter at rest refuses
to be computed with (Note [Sharded parameters refuse compute]); a stages 1-2 parameter whose all-gather is
still in flight after ``step()`` waits for it on its first read (Note [Gathers land on first read]).

Note [Sharded parameters refuse compute]
----------------------------------------
While its unit is sharded, a parameter's ``.data`` is a NaN placeholder of its global shape (Note [Sharded
placeholders]). ``model.fc.weight.sum()``, ``copy.deepcopy(model)``, ``model.to(...)`` or pickling would
then silently compute on, or save, NaN. So a released parameter's class is swapped for a subclass of its
own class whose ``__torch_function__`` raises for every operation that reads values, naming the parameter
and the ways to get its values; operations on metadata (shape, dtype, device, ``numel``, hashing, hooks,
``requires_grad``, ``.grad``) and the engine's ``.data =`` go through, and so does a conversion that would
return the parameter itself (``model.to(its device)``, ``model.float()`` on float32 parameters: scripts and
trainers move an already placed model, and torch's own ``.to`` returns the tensor unchanged then, reading no
values; one to another device or dtype still raises). Gathering swaps the class back, so
the forward and backward, which only run on gathered units, never pay for the Python override. The class
stays a subclass of the original, so ``isinstance(p, nn.Parameter)`` holds throughout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ._ds_param_attributes import ZeroParamStatus
from ._gathered import engine_for
from ._model_edits import restore_emptied_slots

# Operations that read no values: they may run on a placeholder. Properties are named by their descriptor.
_METADATA = frozenset({
    "shape", "dtype", "device", "layout", "ndim", "names", "requires_grad", "is_leaf", "grad", "grad_fn",
    "_version", "_base", "_is_view", "_backward_hooks", "_post_accumulate_grad_hooks", "itemsize", "nbytes",
    "is_cuda", "is_cpu", "is_meta", "is_xpu", "is_mps", "is_sparse", "is_quantized", "is_mkldnn", "is_nested",
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
    "is_signed", "get_device", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
    "__hash__", "__len__", "_has_compatible_shallow_copy_type",
})
_NAME = "_zerocore_sharded_name"
# Conversions that return the tensor itself when it already has the target device, dtype and memory format.
_CONVERSIONS = frozenset({"to", "cpu", "cuda", "float", "double", "half", "bfloat16"})


def _operation(func: Any) -> tuple[str, str]:
    """(name, kind): a property's getter/setter is named by its descriptor."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", name), name
    return name, "call"


def _converts_to_itself(param: torch.Tensor, name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    """Would ``param.<name>(*args, **kwargs)`` return ``param`` itself? Asked of an empty tensor with the same
    dtype and device, so no placeholder value is read and nothing of the parameter's size is allocated."""
    with torch._C.DisableTorchFunctionSubclass():
        probe = torch.empty(0, dtype=param.dtype, device=param.device)
        try:
            return getattr(probe, name)(*args, **kwargs) is probe
        except Exception:  # noqa: BLE001 - arguments torch refuses: the refusal below names the parameter
            return False


class CompileRefused(RuntimeError):
    """Compiled code read a sharded parameter; every rank traces alike, so every rank raises it."""


class _RefusesCompute:
    @property
    def ds_status(self) -> ZeroParamStatus:  # Note [DeepSpeed's parameter attributes]
        if "ds_id" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute 'ds_status'")
        return ZeroParamStatus.NOT_AVAILABLE

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name, kind = _operation(func)
        if name in _METADATA or (name == "data" and kind == "__set__"):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if (name in _CONVERSIONS and kind == "call" and args and isinstance(args[0], _RefusesCompute)
                and _converts_to_itself(args[0], name, args[1:], kwargs or {})):
            return args[0]
        sharded = list({id(a): a for a in args if isinstance(a, _RefusesCompute)}.values())
        if name in ("__repr__", "__format__") and sharded and not (kind == "call" and name == "__format__" and args[1]):
            param = sharded[0]
            return (f"<parameter {param.__dict__.get(_NAME, '?')!r} of shape {tuple(param.shape)} and {param.dtype}, "
                    "sharded by ZeRO stage 3: its values are not on this rank; read them inside "
                    "`with zerocore.gathered(params):`>")
        names = ", ".join(repr(p.__dict__.get(_NAME, "?")) for p in sharded) or "a stage-3 parameter"
        if torch._guards.TracingContext.try_get() is not None:  # torch.compile is tracing the model
            raise CompileRefused(
                f"compiled code read parameter {names} while ZeRO stage 3 holds it sharded, outside its unit's "
                "forward (a module reading a weight of another unit, as a head tied to an embedding in another "
                "unit does); only uncompiled code gathers such a read on the spot: keep the module that reads it "
                "out of the compiled code (torch.compiler.disable on its forward), make both modules one unit "
                "(initialize(..., units=[...])), or compile each unit instead "
                "(model.layers[i] = torch.compile(model.layers[i]))")
        _restore_emptied_slots(sharded)
        raise RuntimeError(
            f"{name}() on parameter {names}, which is sharded by ZeRO stage 3 (outside its unit's forward this rank "
            "holds only a placeholder, not its values): wrap the access in `with zerocore.gathered(params):` "
            "(a collective: every rank enters it; pass modifier_rank=0 to write), take engine.full_state_dict(), "
            "or engine.close() to get the plain model back"
        )


def _restore_emptied_slots(params: list[Any]) -> None:
    """A utility refused here may have taken the parameter out of its module first (``weight_norm`` deletes
    ``weight``, then computes its norm): it goes back, so the refusal leaves the model as it was (Note
    [Parameters added after initialize])."""
    for engine in {id(e): e for e in map(engine_for, params) if e is not None}.values():
        restore_emptied_slots(engine)


_subclasses: dict[tuple[type, type], type] = {}  # (guard, parameter class) -> the guarded subclass
_originals: dict[type, type] = {}  # guarded subclass -> the parameter class it guards


def _guarded(guard: type, prefix: str, cls: type) -> type:
    """``cls`` with ``guard``'s ``__torch_function__`` in front (one class per guard and parameter class)."""
    key = (guard, cls)
    if key not in _subclasses:
        sub = type(f"{prefix}{cls.__name__}", (guard, cls), {"__module__": __name__})
        _subclasses[key], _originals[sub] = sub, cls
    return _subclasses[key]


def mark_sharded(param: nn.Parameter, name: str) -> None:
    """``param`` holds a placeholder now: computing with it raises, naming ``name``."""
    if not isinstance(param, _RefusesCompute):
        param.__dict__[_NAME] = name
        param.__class__ = _guarded(_RefusesCompute, "ZeroSharded", type(param))


def mark_whole(param: nn.Parameter) -> None:
    """``param`` holds its values again: an ordinary parameter of its own class."""
    if isinstance(param, _RefusesCompute):
        param.__class__ = _originals[type(param)]
        param.__dict__.pop(_NAME, None)


# Note [Gathers land on first read]
# ---------------------------------
# In stages 1-2, ``step()`` returns while the all-gathers of the updated parameters are still in flight
# (each started as soon as its bucket's Adam update was done), so the next forward computes while they
# travel. A read must never see a peer's region before its gather landed (``model.state_dict()``, a module
# of the forward, ``p.data``, a tied weight read by another module: every read, not only forwards). So each
# parameter of a bucket in flight gets, like a sharded one above, a subclass of its own class whose
# ``__torch_function__`` first lands the gathers of every in-flight parameter among the operation's
# arguments (and those issued before them: they land in issue order), swapping their classes back, and then
# runs the operation; metadata reads go through without waiting. Each parameter pays one Python call per
# step, on its first read. The engine lands whatever is still in flight before anything else it does
# (backward, step, state dicts, checkpoints, gathered(), close()).
_LAND = "_zerocore_land_gather"


class _AwaitsGather:
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _operation(func)[0] not in _METADATA:
            if torch.compiler.is_compiling():  # a model compiled after initialize: its code would not wait
                raise CompileRefused(
                    "torch.compile traced a parameter whose all-gather after step() is still in flight; compile "
                    "the model (or each block) before zerocore.initialize, so the engine lands the gathers before "
                    "each forward")
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, _AwaitsGather):
                    leaf._land_now()  # swaps the class of leaf (and of every parameter landed with it) back
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    # copy.deepcopy and pickling (torch.save(model)) build the copy from the class and __dict__: land first,
    # so the copy is an ordinary parameter of the original class with whole values
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        self._land_now()
        return self.__deepcopy__(memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        self._land_now()
        return self.__reduce_ex__(protocol)

    def _land_now(self) -> None:
        land = self.__dict__.get(_LAND)
        if land is not None:
            land()
        mark_landed(self)


def mark_in_flight(param: nn.Parameter, land: Callable[[], None]) -> None:
    """``param``'s gather is in flight: its first read calls ``land()`` (which must call :func:`mark_landed`)."""
    if not isinstance(param, _AwaitsGather):
        param.__class__ = _guarded(_AwaitsGather, "ZeroGathering", type(param))
    param.__dict__[_LAND] = land


def mark_landed(param: nn.Parameter) -> None:
    """``param``'s gather landed: an ordinary parameter of its own class again."""
    if isinstance(param, _AwaitsGather):
        param.__class__ = _originals[type(param)]
    param.__dict__.pop(_LAND, None)
