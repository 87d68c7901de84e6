"""``zerocore.gathered(params, modifier_rank=...)``: full parameters outside forward, for reading or for
modifying them on one rank and writing the change back into every rank's shard."""

from __future__ import annotations

import contextlib
import numbers
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .engine import Engine

# Which engine manages a parameter, keyed by id() and holding weak references to both, checked on lookup
# (so a reused id() cannot match). Not a WeakKeyDictionary: its lookups compare tensors with `==`, which
# touches their data, and a sharded stage-3 parameter has no data to touch.
_engine_of: dict[int, tuple[weakref.ReferenceType[nn.Parameter], weakref.ReferenceType[Engine]]] = {}


def register(engine: Engine, params: Iterable[nn.Parameter]) -> None:
    engine_ref = weakref.ref(engine)
    for param in params:
        _engine_of[id(param)] = (weakref.ref(param, lambda _, key=id(param): _engine_of.pop(key, None)), engine_ref)


def unregister(engine: Engine, params: Iterable[nn.Parameter]) -> None:
    for param in params:
        if _engine_for(param) is engine:
            del _engine_of[id(param)]


def engine_for(param: nn.Parameter) -> Engine | None:
    """The live engine that manages ``param``, if any."""
    return _engine_for(param)


def refuse_managed(model: nn.Module) -> None:
    """A model another live engine manages cannot be given to a second one (a frozen parameter every rank holds
    whole may be shared: no engine changes it)."""
    for name, param in model.named_parameters():
        engine = _engine_for(param)
        if engine is not None and id(param) not in engine.whole_frozen_ids:
            raise ValueError(f"parameter {name!r} is already managed by another zerocore engine; call "
                             "close() on that engine first (it hands the parameters back whole)")


def _engine_for(param: nn.Parameter) -> Engine | None:
    entry = _engine_of.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


@contextlib.contextmanager
def gathered(params: Iterable[nn.Parameter] | nn.Parameter, modifier_rank: int | None = None) -> Iterator[None]:
    """Makes ``params`` hold their full values inside the block.

    A collective: every rank of the engine's group must enter it with the same parameters. With
    ``modifier_rank`` set, changes that rank makes inside the block are written back to every rank's
    shard (and fp32 master) on exit; changes on other ranks are discarded. Without it, changes are
    discarded on every rank. Frozen parameters are gathered too where stage 3 shards them (Note [Frozen
    shards]); those every rank holds whole (stages 1-2) need no gathering, and with ``modifier_rank`` that
    rank's values of them are broadcast on exit too (without it they stay as each rank left them, as with
    DeepSpeed's at stages 1-2). Frozen parameters of no engine are passed over, so
    ``zerocore.gathered(model.parameters())`` works as DeepSpeed's ``GatheredParameters`` does.

    Raises:
        ValueError: when a parameter is not managed by a zerocore engine, or modifier_rank is out of range.
        TypeError: when modifier_rank is neither an int nor None.
    """
    if modifier_rank is not None:
        if isinstance(modifier_rank, bool) or not isinstance(modifier_rank, numbers.Integral):
            raise TypeError(f"zerocore.gathered(): modifier_rank must be an int rank or None, got "
                            f"{type(modifier_rank).__name__} {modifier_rank!r}")
        modifier_rank = int(modifier_rank)
    params = [params] if isinstance(params, nn.Parameter) else list(params)
    engines: dict[int, Engine] = {}
    for param in params:
        engine = _engine_for(param)
        if engine is None and not param.requires_grad:
            continue  # frozen and held whole (DeepSpeed's idiom passes every parameter)
        if engine is None:
            raise ValueError("zerocore.gathered() got a parameter that no zerocore engine manages "
                             f"(shape {list(param.shape)}); pass parameters of a model given to zerocore.initialize()")
        if modifier_rank is not None and not 0 <= modifier_rank < engine.world_size:
            raise ValueError(f"modifier_rank must be in [0, {engine.world_size}), got {modifier_rank}")
        engines[id(engine)] = engine
    entered = []
    try:
        for engine in engines.values():
            engine.gather_for_user(params)
            entered.append(engine)
        yield
    finally:
        for engine in entered:
            engine.release_for_user(params, modifier_rank)


_WRITE_GROUP_ELEMENTS = 1 << 27  # 512 MiB of fp32 gathered at once by write_whole_in_groups


def write_whole_in_groups(engine: Engine, writes: Sequence[tuple[nn.Parameter, Callable[[], torch.Tensor]]]) -> None:
    """Writes whole values into parameters the optimizer does not hold (frozen ones) through
    ``gathered(..., modifier_rank=0)``, a group of at most ``_WRITE_GROUP_ELEMENTS`` at a time, so stage 3 has only
    that much gathered at once (a LoRA run's whole frozen base model in one block would be the whole model on
    every rank). Every rank calls it with the same parameters in the same order; the values are taken on rank
    0 only (``value()`` is called there, when its group is written) and reach every rank."""
    from ._model_checks import failing_together

    group: list[tuple[nn.Parameter, Callable[[], torch.Tensor]]] = []
    elements = 0

    def write() -> None:
        # rank 0 reads the group's values before the block: a read that fails there (a disk error) raises on every
        # rank before anything is gathered, not on rank 0 alone after a half-written group was broadcast
        values: list[torch.Tensor] = []
        with failing_together(engine.comm, engine.device, lambda rank, message: OSError(
                f"rank {rank} could not read the values of frozen parameters to write ({message}); the groups "
                "before were written")):
            if engine.rank == 0:
                values = [value() for _, value in group]
        with gathered([param for param, _ in group], modifier_rank=0):
            for (param, _), whole in zip(group, values):  # (rank 0 only: the others have no values)
                param.copy_(whole)

    for param, value in writes:
        if group and elements + param.numel() > _WRITE_GROUP_ELEMENTS:
            write()
            group, elements = [], 0
        group.append((param, value))
        elements += param.numel()
    if group:
        write()
