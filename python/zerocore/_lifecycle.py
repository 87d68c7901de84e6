"""The engine's training state machine.

Note [Engine states]
--------------------
::

    IDLE --forward--> FORWARD --backward--> AWAITING_STEP --step--> IDLE
      |                  |                                   (updates at the accumulation boundary)
      +---- no_sync() ---+--> NO_SYNC: forwards and backwards accumulate gradients locally; leaving the
                               block returns to FORWARD when a forward awaits its backward, else IDLE
    any state but BACKWARD --close--> CLOSED (final)

BACKWARD is the inside of ``engine.backward()``. Every public method checks its transition with
:meth:`Lifecycle.require`, which raises ``RuntimeError`` naming the state and the fix.
"""

from __future__ import annotations

import enum


class EngineState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward done, awaiting backward"
    BACKWARD = "backward in progress"
    AWAITING_STEP = "gradients reduced, awaiting step()"
    NO_SYNC = "inside no_sync()"
    CLOSED = "closed"


# the states in which an engine method that needs no particular phase of the cycle may run (not inside a
# backward, not after close)
USABLE = (EngineState.IDLE, EngineState.FORWARD, EngineState.AWAITING_STEP, EngineState.NO_SYNC)

_FIX = {
    EngineState.CLOSED: "the engine was closed (engine.close() handed the model back); build a new engine with "
                        "zerocore.initialize() to train again",
    EngineState.BACKWARD: "engine methods cannot run from inside a backward pass (e.g. from a tensor hook); call "
                          "them after engine.backward() returns",
    EngineState.AWAITING_STEP: "call engine.step() after every engine.backward() (it only updates at the "
                               "accumulation boundary), or wrap accumulation backwards in engine.no_sync()",
    EngineState.NO_SYNC: "leave the engine.no_sync() block and run a backward outside it first: gradients "
                         "accumulated inside no_sync() are not reduced across ranks yet",
}


class Lifecycle:
    """The current :class:`EngineState` and the transitions each public method may take."""

    def __init__(self) -> None:
        self.state = EngineState.IDLE
        self.local_grads = False  # gradients accumulated inside no_sync() and not reduced yet
        self.forward_pending = False  # a training forward ran and no backward followed yet
        self.forwards = 0  # training forwards since the last backward outcome exchange (stage 3: the last step)
        self.forward_raised = False  # and whether one of them raised

    def require(self, action: str, *allowed: EngineState, fix: str | None = None) -> None:
        if self.state not in allowed:
            why = fix or _FIX.get(self.state, "")
            raise RuntimeError(f"engine.{action} is not allowed while the engine is {self.state.value!r}"
                               + (f": {why}" if why else ""))

    def to(self, state: EngineState) -> None:
        self.state = state

    def enter_no_sync(self) -> bool:
        """True when this call entered (a nested no_sync() changes nothing)."""
        self.require("no_sync()", EngineState.IDLE, EngineState.FORWARD, EngineState.NO_SYNC)
        if self.state is EngineState.NO_SYNC:
            return False
        self.state = EngineState.NO_SYNC
        return True

    def exit_no_sync(self) -> None:
        if self.state is EngineState.NO_SYNC:
            self.state = EngineState.FORWARD if self.forward_pending else EngineState.IDLE
