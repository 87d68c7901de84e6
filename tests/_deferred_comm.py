"""GatherAtWait: a stand-in for the engine's Comm whose all-gathers are issued only when waited for.

Until a read lands such a gather, the peers' regions of a parameter buffer still hold their old values, so
a read that skipped the wait (Note [Gathers land on first read]) sees them and a test can tell."""

from __future__ import annotations

from typing import Any


class GatherAtWait:
    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def all_gather(self, bucket: Any, tag: Any, label: str = "all_gather", cuts: Any = ()) -> Any:
        comm = self._comm

        class Deferred:
            def wait(self) -> None:
                comm.all_gather(bucket, tag, label, list(cuts)).wait()

        return Deferred()
