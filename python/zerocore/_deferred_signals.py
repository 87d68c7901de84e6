"""Interrupts held back while the engine's state changes as a whole.

Note [Interrupts deferred in an update]
---------------------------------------
Python runs a signal's handler between two bytecodes of the main thread, so Ctrl-C (KeyboardInterrupt, which
torchrun forwards to every rank) or a preemption handler the user installed for SIGTERM can land between two
shards of the optimizer update, or between two tensors of a checkpoint load. The engine would then hold some
parameters and moments of step N+1 and the rest of step N, and an emergency ``save_checkpoint`` in the user's
``except KeyboardInterrupt:`` would write that torn state as if it were a step; on some ranks the rest of the
step's all-gathers would be missing. Inside ``deferred_interrupts()`` such a signal is recorded and its
handler runs when the block ends, once the state is whole again: the interrupt surfaces right after the step,
as a KeyboardInterrupt from ``engine.step()``. A second one inside the block runs the handler at once, so a
step stuck in a collective can still be interrupted (the engine is then left as it is, and says so).
Only handlers written in Python are held back: a signal whose action is the default (SIGTERM's: the process
ends) or ignored keeps it. Off the main thread no handler can run meanwhile, so nothing is installed.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

_DEFERRED = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def deferred_interrupts(what: str) -> Iterator[None]:
    """Holds back SIGINT and a Python SIGTERM handler for the block; ``what`` names the block in the message
    printed when a signal arrives (Note [Interrupts deferred in an update])."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in _DEFERRED}
    held = {sig: handler for sig, handler in previous.items() if callable(handler)}
    pending: list[tuple[int, FrameType | None]] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        if pending:  # a second signal: the user insists; the state may be torn from here
            pending.clear()
            _restore(previous)
            print(f"zerocore: second {signal.Signals(signum).name} during {what}: interrupting it now, which may "
                  "leave the model and optimizer state partly updated (load the last checkpoint)",
                  file=sys.stderr, flush=True)
            held[signum](signum, frame)
            return
        pending.append((signum, frame))
        print(f"zerocore: {signal.Signals(signum).name} received during {what}: it takes effect once it is "
              "complete, so the model and optimizer state stay whole (send it again to interrupt now)",
              file=sys.stderr, flush=True)

    for sig in held:
        signal.signal(sig, hold)
    try:
        yield
    finally:  # also when the block raised: the interrupt then comes with that error as its context
        _restore(previous)
        for signum, frame in pending:
            held[signum](signum, frame)


def _restore(previous: dict[signal.Signals, Any]) -> None:
    for sig, handler in previous.items():
        if handler is not None:  # None: installed from outside Python; getsignal cannot say what it was
            signal.signal(sig, handler)
