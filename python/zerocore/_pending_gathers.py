"""Stages 1-2: the post-step parameter all-gathers land while the next forward already runs.

Note [Waiting for parameters on read]
-------------------------------------
``step()`` launches one all-gather per bucket and returns. The next forward runs under
:class:`PendingGathers.guard`, a ``TorchFunctionMode`` that sees every torch operation: one that reads a
parameter whose bucket is still in flight first waits for that bucket (and, to keep the waits in launch
order, for every bucket launched before it). So a module computes on the first buckets while the last
ones still travel, and no operation, whichever module it sits in (a parent reading a child's weight, a
tied head), ever reads a parameter before its gather landed. Everything still pending is waited for when
the forward returns, before backward, and before any other engine call that reads parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class PendingGathers:
    """The all-gathers in flight, in launch order, and which bucket position each parameter waits for."""

    def __init__(self, buckets: Iterable[Iterable[torch.Tensor]]) -> None:
        self.position_of: dict[int, int] = {}
        for position, params in enumerate(buckets):
            for param in params:
                self.position_of[id(param)] = position
        self.works: list[Any] = []
        self._waited = 0

    def launched(self, work: Any) -> None:
        self.works.append(work)

    def wait_through(self, position: int) -> None:
        while self._waited <= position and self._waited < len(self.works):
            self.works[self._waited].wait()
            self._waited += 1

    def wait_all(self) -> None:
        self.wait_through(len(self.works) - 1)
        self.works = []
        self._waited = 0

    @property
    def in_flight(self) -> bool:
        return self._waited < len(self.works)

    def guard(self) -> TorchFunctionMode:
        return _WaitOnRead(self)


class _WaitOnRead(TorchFunctionMode):
    def __init__(self, pending: PendingGathers) -> None:
        super().__init__()
        self.pending = pending

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        pending = self.pending
        if pending.in_flight:
            position_of = pending.position_of
            for value in (*args, *kwargs.values()):
                if isinstance(value, (list, tuple)):  # torch.cat([w1, w2]), foreach ops
                    for item in value:
                        if id(item) in position_of:
                            pending.wait_through(position_of[id(item)])
                elif id(value) in position_of:
                    pending.wait_through(position_of[id(value)])
        return func(*args, **kwargs)
