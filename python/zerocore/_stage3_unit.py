"""A stage-3 unit's storage and its gather state machine (SHARDED -> GATHERING -> GATHERED -> SHARDED);
Stage3Runtime in _stage3.py schedules the units (Note [Stage 3 gather and release])."""

from __future__ import annotations

import enum
from typing import Any

import torch

from ._divergence import DivergenceCheck
from ._sharded_buffer import ShardedBuffer
from ._units import UnitSpec
from .layout import FlatLayout


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Unit:
    """A unit's storage (a ShardedBuffer of one bucket, Note [Sharded buffer]) and its place in the
    schedule: gather state, gathers this step, gradients still due in this backward, persistence."""

    def __init__(self, spec: UnitSpec, buffer: ShardedBuffer) -> None:
        self.spec = spec
        self.index = spec.index
        self.name = spec.name or "<root>"
        self.params = spec.params
        self.buffer = buffer
        self.state = UnitState.SHARDED
        self.pending: Any = None
        self.calls = 0  # gathers of this unit in the current step (for the divergence tag)
        self.grads_left = 0  # parameters of this unit still waiting for their gradient in this backward
        self.persistent = False
        self.pinned = False  # used outside its own forward: gathered until the backward ends (Note [External parameters])
        self.pinned_for_backward = False  # pinned in a grad-enabled forward: a no-grad forward's end keeps it
        self.in_backward = False
        self.user_holds = 0  # zerocore.gathered() blocks holding it whole: no hook releases it meanwhile
        self._tag_check: Any = None
        # hpZ: this rank's slice of the unit's values from its last forward gather, which its backward gathers
        # within the partition (Stage3Runtime.hpz_slot says which slice)
        self.secondary: torch.Tensor | None = None
        self._keep_secondary: tuple[int, int] | None = None
        self.quantized = False  # gathered through qwZ: the values are the dequantized int8 ones

    @property
    def numel(self) -> int:
        return self.buffer.numel

    @property
    def layout(self) -> FlatLayout:
        return self.buffer.layout

    @property
    def full(self) -> torch.Tensor:
        return self.buffer.full

    @property
    def shard(self) -> torch.Tensor:
        return self.buffer.shard

    def build_from(self, values: list[torch.Tensor]) -> None:
        """Takes this rank's shard (and fp32 master) from full-size parameter values; the unit is sharded."""
        self.buffer.build_from(values)

    def _move(self, expected: UnitState, to: UnitState) -> None:
        if self.state is not expected:
            raise RuntimeError(f"zerocore internal error: unit {self.name!r} went {self.state.value} -> "
                               f"{to.value}, but only {expected.value} -> {to.value} is legal")
        self.state = to

    def start_gather(self, comm: Any, label: str, check: DivergenceCheck, tag: Any,
                     keep_secondary: tuple[int, int] | None = None) -> None:
        """SHARDED -> GATHERING (this rank's values already staged by ``ShardedBuffer.stage_own``): the
        all-gather is issued right after its divergence tag's (``tag``). With
        ``keep_secondary`` (hpZ partition size, index in it) the landed values' slice is kept for the backward."""
        self._move(UnitState.SHARDED, UnitState.GATHERING)
        self.pending = self.buffer.gather(comm, 0, label, staged=True)
        self._tag_check = (check, tag)
        self._keep_secondary = keep_secondary

    def start_partition_gather(self, comm: Any, label: str, check: DivergenceCheck, tag: Any,
                               slot: tuple[int, int]) -> None:
        """SHARDED -> GATHERING from the hpZ secondary slices (``slot``: partition size, index in it), inside
        the partition only (``comm``)."""
        assert self.secondary is not None
        self._move(UnitState.SHARDED, UnitState.GATHERING)
        self.pending = self.buffer.gather_from_slice(comm, self.secondary, *slot, label)
        self._tag_check = (check, tag)
        self._keep_secondary = None

    def wait(self) -> None:
        """GATHERING -> GATHERED: the tag is checked first (Note [Divergence tags]), then the gather lands."""
        if self.state is UnitState.GATHERING:
            check, tag = self._tag_check
            check.after_gather(tag)  # raises while ranks diverged: then every later wait raises it again
            self._tag_check = None
            self.pending.wait()
            self.pending = None
            self._move(UnitState.GATHERING, UnitState.GATHERED)
            if self._keep_secondary is not None:
                self.secondary = self.buffer.partition_slice(*self._keep_secondary).clone()
                self._keep_secondary = None
            self.buffer.attach_views()

    def release(self) -> None:
        """GATHERED -> SHARDED (a gather in flight lands first: never free memory a collective writes). A write
        to the unit's parameters while it was whole (``nn.Embedding(max_norm=)`` renormalizes rows in its
        forward; a hook may scale a weight) reaches this rank's shard and master first, as at stages 1-2."""
        self.wait()
        if self.buffer.params_written():
            if self.quantized:
                raise RuntimeError(
                    f"a parameter of unit {self.name!r} was written in place while gathered through "
                    "zero_quantized_weights (int8): its other values are the quantized ones, so the write cannot be "
                    "kept apart from them. Write parameters outside the forward, inside zerocore.gathered(..., "
                    "modifier_rank=0), or turn zero_quantized_weights off")
            self.buffer.absorb_param_writes()
        self.buffer.free()
        self._move(UnitState.GATHERED, UnitState.SHARDED)
