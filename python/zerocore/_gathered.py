"""``zerocore.gathered(params, modifier_rank=...)``: full parameters outside forward, for reading or for
modifying them on one rank and writing the change back into every rank's shard."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from .engine import Engine

# Which engine manages a parameter. Weak on both sides: an engine or a parameter that is gone is forgotten.
_engine_of: weakref.WeakKeyDictionary[nn.Parameter, weakref.ReferenceType[Engine]] = weakref.WeakKeyDictionary()


def register(engine: Engine, params: Iterable[nn.Parameter]) -> None:
    ref = weakref.ref(engine)
    for param in params:
        _engine_of[param] = ref


@contextlib.contextmanager
def gathered(params: Iterable[nn.Parameter] | nn.Parameter, modifier_rank: int | None = None) -> Iterator[None]:
    """Makes ``params`` hold their full values inside the block.

    A collective: every rank of the engine's group must enter it with the same parameters. With
    ``modifier_rank`` set, changes that rank makes inside the block are written back to every rank's
    shard (and fp32 master) on exit; changes on other ranks are discarded.

    Raises:
        ValueError: when a parameter is not managed by a zerocore engine.
    """
    params = [params] if isinstance(params, nn.Parameter) else list(params)
    engines: dict[int, Engine] = {}
    for param in params:
        ref = _engine_of.get(param)
        engine = ref() if ref is not None else None
        if engine is None:
            raise ValueError("zerocore.gathered() got a parameter that no zerocore engine manages "
                             f"(shape {list(param.shape)}); pass parameters of a model given to zerocore.initialize()")
        engines[id(engine)] = engine
    entered = []
    try:
        for engine in engines.values():
            engine._gather_for_user(params)
            entered.append(engine)
        yield
    finally:
        for engine in entered:
            engine._release_for_user(params, modifier_rank)
