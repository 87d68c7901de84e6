"""Materialize a model built on the meta device, unit by unit, without ever holding it whole.

Note [Meta-device materialization]
----------------------------------
A model built under ``torch.device("meta")`` has shapes but no values: its constructors ran without memory
(and without drawing from the RNG). Two ways give it values:

* ``init_fn`` given: exactly ``model.apply(init_fn)`` on the materialized model, as Hugging Face's
  ``init_weights``/``initialize_weights`` does with ``model._init_weights``: ``init_fn`` runs on *every*
  module (those owning no tensors too: GPT-2's attention rescales its child ``c_proj``, T5's root
  initializes ``shared``), children before parents, in ``apply``'s order, under ``torch.no_grad()``, and each
  parameter it touches holds its full value at that moment (writes by any module to a tied parameter count,
  the last one wins, as in ``apply``). Building on meta draws nothing from the RNG, so with the same
  ``torch.manual_seed`` before the build the values equal those of the unsharded model materialized and
  initialized by ``model.apply(init_fn)`` (for Hugging Face models: the eager build re-initialized with
  ``model.apply(model._init_weights)`` after the same seed).
* no ``init_fn``, a Hugging Face model (a ``transformers.PreTrainedModel``): ``init_fn`` is its own
  ``_init_weights``, what its constructor's ``post_init()`` would have applied. ``reset_parameters()`` would
  silently give it torch's defaults instead (Kaiming-uniform linears, N(0, 1) embeddings, where Hugging Face
  draws N(0, initializer_range), 0.02 as a rule), a model that trains otherwise than the one the user built.
* no ``init_fn``, any other model: each module owning meta tensors runs its own ``reset_parameters()`` (what
  its constructor ran), children first; a tied parameter keeps the value of its first initializer (the tie
  came after both).

To hold only a few units at a time, ``init_fn`` first runs once on the meta tensors themselves (no memory,
the RNG state saved and restored, the modules' attributes restored), recording which tensors each call
reads. Then, in order, the tensors a call needs are allocated (filled with a sentinel: NaN, or the integer
minimum), the call runs, and a unit no later call needs is finished: rank 0's values are broadcast (an
``init_fn`` with its own per-rank RNG stream still leaves every rank with rank 0's model, as the eager
build's broadcast does), checked, and sharded. Units finish in the same order on every rank, so the
collectives match. A tensor still holding its sentinel (nothing computed it: a buffer such as BERT's
``position_ids``, filled by ``torch.arange`` in its constructor) raises, naming it and the way out.
Frozen floating-point parameters are sharded with their units (Note [Frozen shards]); buffers stay whole on
every rank and are broadcast from rank 0 at the end.
Nothing in torch or ``nn.Module`` is patched.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ._stage3_unit import Unit
from ._user_frames import user_stacklevel


class _AccessLog:
    """Ids of the tensors read through modules' ``_parameters``/``_buffers`` while ``active`` is a set."""

    def __init__(self) -> None:
        self.active: set[int] | None = None
        self.sharded: dict[int, str] = {}  # a parameter of a finished unit -> its name (no call may touch it)


class _Tracked(dict):
    """A module's ``_parameters`` or ``_buffers`` during materialization: notes every tensor read through it
    (``nn.Module.__getattr__`` reads through ``__getitem__``, ``parameters()``/``state_dict()`` iterate
    ``items()``)."""

    def __init__(self, data: dict[str, Any], log: _AccessLog) -> None:
        super().__init__(data)
        self._log = log

    def _note(self, value: Any) -> Any:
        log = self._log
        if value is not None and log.active is not None:
            name = log.sharded.get(id(value))
            if name is not None:
                raise RuntimeError(
                    f"zerocore meta-device init: init_fn read parameter {name!r} after its unit was already "
                    "sharded, which its dry run on the meta device did not do (does init_fn branch on values?); "
                    "make init_fn touch the same tensors whatever their values"
                )
            log.active.add(id(value))
        return value

    def __getitem__(self, key: str) -> Any:
        return self._note(dict.__getitem__(self, key))

    def get(self, key: str, default: Any = None) -> Any:
        return self._note(dict.get(self, key, default))

    def values(self) -> Any:
        return [self._note(v) for v in dict.values(self)]

    def items(self) -> Any:
        return [(k, self._note(v)) for k, v in dict.items(self)]


@contextlib.contextmanager
def _tracking(modules: list[nn.Module], log: _AccessLog) -> Iterator[None]:
    """Installs ``_Tracked`` dicts; on exit the modules get their own dicts back, with whatever was
    assigned meanwhile (a buffer replaced by ``init_fn``, one allocated here)."""
    originals = [(m, m._parameters, m._buffers) for m in modules]
    for m in modules:
        m._parameters = _Tracked(m._parameters, log)
        m._buffers = _Tracked(m._buffers, log)
    try:
        yield
    finally:
        for m, params, buffers in originals:
            params.clear()
            params.update(dict.items(m._parameters))
            buffers.clear()
            buffers.update(dict.items(m._buffers))
            m._parameters, m._buffers = params, buffers


def _apply_order(model: nn.Module) -> list[nn.Module]:
    """The modules ``model.apply(fn)`` calls ``fn`` on, in its order: children (each parent's distinct
    children, in registration order) before their parent."""
    order: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        order.append(module)

    visit(model)
    return order


def _post_order(model: nn.Module) -> list[nn.Module]:
    """Children before parents, each module once: torch modules run reset_parameters() at the end of
    __init__, after their children were built (MultiheadAttention initializes out_proj, then its own
    in_proj_weight)."""
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        order.append(module)

    visit(model)
    return order


def _sentinel_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Memory for a meta tensor, holding a value no initializer writes by accident (see _unset)."""
    out = torch.empty_like(tensor, device=device)
    if out.is_floating_point() or out.is_complex():
        out.fill_(float("nan"))
    elif out.dtype != torch.bool:
        out.fill_(torch.iinfo(out.dtype).min)
    else:
        out.fill_(False)
    return out


def _unset(tensor: torch.Tensor) -> bool:
    """Still (partly) the sentinel: nothing computed it. (A bool tensor has no sentinel: never reported.)"""
    if tensor.is_meta:
        return True
    if tensor.numel() == 0:
        return False
    with torch.no_grad():
        if tensor.is_floating_point() or tensor.is_complex():
            return bool(torch.isnan(tensor).any())
        if tensor.dtype == torch.bool:
            return False
        return bool((tensor == torch.iinfo(tensor.dtype).min).all())


class _Materializer:
    def __init__(self, model: nn.Module, device: torch.device, comm: Any) -> None:
        self.device = device
        self.comm = comm
        self.modules = list(model.modules())
        self.names: dict[int, str] = {}
        self.kind: dict[int, str] = {}
        self.tensors: dict[int, torch.Tensor] = {}
        self.buffer_owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(param), name)
            self.kind[id(param)] = "parameter"
            self.tensors[id(param)] = param
        for module_name, module in model.named_modules(remove_duplicate=False):
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    self.names.setdefault(id(buffer), f"{module_name}.{name}" if module_name else name)
                    self.kind[id(buffer)] = "buffer"
                    self.tensors[id(buffer)] = buffer
                    owners = self.buffer_owners.setdefault(id(buffer), [])
                    if (module, name) not in owners:
                        owners.append((module, name))
        self.materialized: set[int] = set()  # ids of tensors allocated here (checked for the sentinel)
        self._replaced: list[torch.Tensor] = []  # meta buffers replaced here, kept so that their ids stay unique

    def materialize(self, key: int) -> None:
        tensor = self.tensors[key]
        if not tensor.is_meta:
            return
        if self.kind[key] == "parameter":
            # swap_tensors keeps the Parameter object (the units, the optimizer and the user hold it);
            # `.data =` cannot move a tensor off the meta device.
            real = nn.Parameter(_sentinel_like(tensor, self.device), requires_grad=tensor.requires_grad)
            torch.utils.swap_tensors(tensor, real)
            self.materialized.add(key)
        else:
            real = _sentinel_like(tensor, self.device)
            for module, name in self.buffer_owners[key]:
                if dict.get(module._buffers, name) is tensor:
                    module._buffers[name] = real
            self._replaced.append(tensor)
            self.tensors[key] = real
            self.kind[id(real)] = "buffer"
            self.names[id(real)] = self.names[key]
            self.materialized.add(id(real))

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values on every rank: one broadcast per dtype, in the same order on every rank."""
        tensors = [t for t in tensors if t.numel()]
        if self.comm is None or not tensors:
            return
        with torch.no_grad():
            for dtype in sorted({t.dtype for t in tensors}, key=str):
                same = [t for t in tensors if t.dtype == dtype]
                flat = torch.cat([t.detach().reshape(-1) for t in same])
                wire = flat.view(torch.uint8) if dtype == torch.bool else flat
                self.comm.broadcast(wire, 0).wait()
                offset = 0
                for t in same:
                    t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def check(self, tensors: list[torch.Tensor], init_fn: Callable[[nn.Module], None] | None) -> None:
        for tensor in tensors:
            key = id(tensor)
            if key not in self.materialized and not tensor.is_meta:
                continue
            if not _unset(tensor):
                continue
            name, kind = self.names.get(key, "?"), self.kind.get(key, "tensor")
            by = "init_fn" if init_fn is not None else "reset_parameters()"
            if kind == "buffer":
                raise ValueError(
                    f"buffer {name!r} was built on the meta device and nothing computed it: its value came from "
                    "its module's constructor (e.g. torch.arange), which a meta-device build does not run, and "
                    f"{by} did not write it. Compute it in init_fn (Hugging Face models: "
                    "init_fn=model._init_weights recomputes such buffers in transformers >= 5), or build the "
                    "model with only its parameters on the meta device (buffers on the CPU, e.g. "
                    "accelerate.init_empty_weights(include_buffers=False))"
                )
            raise ValueError(
                f"parameter {name!r} was built on the meta device and {by} did not initialize "
                f"{'all of it' if not tensor.is_meta else 'it'} (it would hold uninitialized memory): "
                "initialize it in init_fn (called as model.apply(init_fn) would, on every module, children "
                "first), or give its module a reset_parameters()"
            )


def _dry_run(order: list[nn.Module], init_fn: Callable[[nn.Module], None], device: torch.device,
             mat: _Materializer) -> list[set[int]] | None:
    """Runs ``init_fn`` over the meta model in ``order`` and returns the tensors each call read, leaving the
    modules, their tensors and the RNG as they were. None when ``init_fn`` cannot run on meta tensors."""
    modules = mat.modules
    saved_modules = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers)) for m in modules]
    saved_tensors = [(t, dict(t.__dict__), None if t.is_meta else t.detach().clone()) for t in mat.tensors.values()]
    log = _AccessLog()
    accessed: list[set[int]] = []
    devices = [device] if device.type == "cuda" else []
    failure: BaseException | None = None
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), _tracking(modules, log):
            for module in order:
                log.active = {id(t) for t in list(module._parameters.values()) + list(module._buffers.values())
                              if t is not None}
                init_fn(module)
                accessed.append(log.active)
                log.active = None
    except Exception as error:  # noqa: BLE001 - e.g. an op without a meta kernel, .item() on a meta tensor
        failure = error
    finally:
        log.active = None
        replaced = []
        for m, attrs, params, buffers in saved_modules:
            for key, value in params.items():
                if dict.get(m._parameters, key) is not value:
                    replaced.append(f"{type(m).__name__}.{key}")
            m.__dict__.clear()
            m.__dict__.update(attrs)
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
        with torch.no_grad():
            for tensor, attrs, value in saved_tensors:
                tensor.__dict__.clear()
                tensor.__dict__.update(attrs)
                if value is not None:
                    tensor.detach().copy_(value)
    if replaced:
        raise ValueError(f"init_fn replaced parameter(s) {replaced[:5]} with new objects; initialize parameters "
                         "in place (torch.nn.init.*, copy_, fill_) so that the engine keeps managing them")
    if failure is not None:
        warnings.warn(f"zerocore meta-device init: init_fn could not run on meta tensors ({failure!r}); the "
                      "whole model is materialized before it is sharded (more memory, same values)",
                      stacklevel=user_stacklevel())
        return None
    return accessed


def hugging_face_init(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """A Hugging Face model's ``_init_weights`` (Note [Meta-device materialization]); None for other models.
    Recognized by its class, without importing transformers."""
    hugging_face = any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
                       for cls in type(model).__mro__)
    init = getattr(model, "_init_weights", None)
    return init if hugging_face and callable(init) else None


def materialize_units(model: nn.Module, units: list[Unit], device: torch.device,
                      init_fn: Callable[[nn.Module], None] | None, comm: Any = None) -> None:
    """See Note [Meta-device materialization]. ``comm`` (the engine's) broadcasts rank 0's values; None
    keeps each rank's own."""
    mat = _Materializer(model, device, comm)
    owner = {id(p): unit for unit in units for p in unit.all_params}
    if init_fn is None:
        init_fn = hugging_face_init(model)
    if init_fn is not None:
        order = _apply_order(model)
        accessed = _dry_run(order, init_fn, device, mat)
        if accessed is None:  # everything from the start, every unit finished at the end
            everything = set(mat.tensors)
            accessed = [everything] + [set() for _ in order[1:]]
            last_use = {unit.index: len(order) - 1 for unit in units}
        else:
            last_use = {}
            for position, touched in enumerate(accessed):
                for key in touched:
                    if key in owner:
                        last_use[owner[key].index] = position
    else:
        order = _post_order(model)
        accessed = []
        last_use = {}
        for position, module in enumerate(order):
            direct = [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]
            touched = {id(t) for t in direct} if any(t.is_meta for t in direct) else set()
            accessed.append(touched)
            for key in touched:
                if key in owner:
                    last_use[owner[key].index] = position
    for unit in units:  # never touched: finished (and reported unset) at the end
        last_use.setdefault(unit.index, len(order) - 1)
    finish_at: dict[int, list[Unit]] = {}
    for unit in units:
        finish_at.setdefault(last_use[unit.index], []).append(unit)

    log = _AccessLog()
    initialized: set[int] = set()  # reset path: parameters a module already initialized (tied weights)
    with _tracking(mat.modules, log):
        for position, module in enumerate(order):
            touched = accessed[position]
            for key in sorted(touched, key=lambda k: mat.names.get(k, "")):
                if key in mat.tensors:
                    mat.materialize(key)
            if init_fn is not None:
                log.active = set()
                try:
                    with torch.no_grad():
                        init_fn(module)
                finally:
                    log.active = None
            elif touched:
                _reset(module, initialized)
            for unit in finish_at.get(position, []):
                for param in unit.all_params:
                    mat.materialize(id(param))
                mat.broadcast(list(unit.all_params))
                mat.check(list(unit.all_params), init_fn)
                for param, name in zip(unit.all_params, unit.all_names):
                    log.sharded[id(param)] = name
                unit.build_from({id(p): p.detach() for p in unit.all_params})  # takes the shards, frees the values
    # Buffers (and frozen parameters no unit shards: integer ones): whole on every rank, rank 0's values.
    rest = [key for key in mat.tensors if key not in owner]
    for key in rest:
        mat.materialize(key)
    whole = [mat.tensors[key] for key in rest]
    mat.broadcast(whole)
    mat.check(whole, init_fn)


def _reset(module: nn.Module, initialized: set[int]) -> None:
    """Runs the module's reset_parameters(), keeping the values of parameters an earlier module initialized
    (tied weights): it still runs over them, so the RNG advances exactly as it did when the unsharded model
    was built and the tie came after both initializations."""
    params = [p for p in module.parameters(recurse=False)]
    # torch's MultiheadAttention names its initializer _reset_parameters.
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if reset is None:
        if any(p.requires_grad for p in params):
            raise ValueError(
                f"module {type(module).__name__} has parameters built on the meta device but no "
                "reset_parameters(); pass init_fn=... to initialize() to initialize it (Hugging Face models: "
                "init_fn=model._init_weights)"
            )
        return  # buffers or frozen parameters only: checked once every module ran
    saved = [(p, p.detach().clone()) for p in params if id(p) in initialized]
    with torch.no_grad():
        reset()
        for param, value in saved:
            param.copy_(value)
    initialized.update(id(p) for p in params)
