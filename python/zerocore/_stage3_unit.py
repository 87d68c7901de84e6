"""A stage-3 unit's storage and its gather state machine (SHARDED -> GATHERING -> GATHERED -> SHARDED);
Stage3Runtime in _stage3.py schedules the units (Note [Stage 3 gather and release])."""

from __future__ import annotations

import enum
from typing import Any

import torch

from ._divergence import DivergenceCheck
from ._sharded_buffer import ShardedBuffer
from ._units import UnitSpec


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Unit:
    """A unit's storage (a ShardedBuffer of one bucket for its trainable parameters, Note [Sharded buffer],
    and one per dtype for its frozen ones, Note [Frozen shards]) and its place in the schedule: gather
    state, gathers this step, gradients still due in this backward, persistence. Every storage is gathered
    and released together."""

    def __init__(self, spec: UnitSpec, buffer: ShardedBuffer | None, frozen: list[ShardedBuffer]) -> None:
        self.spec = spec
        self.index = spec.index
        self.name = spec.name or "<root>"
        self.params = spec.params  # the trainable ones (``buffer``'s)
        self.buffer = buffer
        self.frozen = frozen
        self.storages: list[ShardedBuffer] = ([] if buffer is None else [buffer]) + frozen
        self.all_params = [p for storage in self.storages for p in storage.params]
        self.all_names = [n for storage in self.storages for n in storage.names]
        self.state = UnitState.SHARDED
        self.flags: bytearray | None = None  # the runtime's per-unit "sharded" bytes, kept here (set by it)
        self.slot = 0  # this unit's byte in flags
        self.pending: list[Any] = []
        self.calls = 0  # gathers of this unit in the current step (for the divergence tag)
        self.grads_left = 0  # parameters of this unit still waiting for their gradient in this backward
        # Note [Units with frozen parameters in backward]: forwards of this unit whose inputs' gradients are
        # still to come in this backward, and whether a forward had no input requiring grad (then the
        # backward's end releases the unit)
        self.input_grads_left = 0
        self.held_to_backward_end = False
        self.persistent = False
        self.pinned = False  # used outside its own forward: gathered until the backward ends (Note [External parameters])
        self.pinned_for_backward = False  # pinned in a grad-enabled forward: a no-grad forward's end keeps it
        self.in_backward = False
        self.backward_hooked = False  # a forward since the last backward registered its pre-backward hook
        self.hooks_backward: bool | None = None  # its last forward with grad returned outputs that require grad
        self.user_holds = 0  # zerocore.gathered() blocks holding it whole: no hook releases it meanwhile
        self._tag_check: Any = None
        self._gather_failed: BaseException | None = None  # the transport's error from a gather that never landed
        # hpZ: this rank's slice of each storage's values from its last forward gather, which its backward
        # gathers within the partition (Stage3Runtime.hpz_slot says which slice)
        self.secondary: list[torch.Tensor] | None = None
        self._keep_secondary: tuple[int, int] | None = None
        self.quantized_storages = [False] * len(self.storages)  # gathered through qwZ: dequantized int8 values

    @property
    def quantized(self) -> bool:
        return any(self.quantized_storages)

    @property
    def numel(self) -> int:
        return sum(storage.numel for storage in self.storages)

    @property
    def nbytes(self) -> int:
        """The gathered unit's bytes (storages may differ in dtype: frozen ones keep theirs at fp32 compute)."""
        return sum(storage.numel * storage.dtype.itemsize for storage in self.storages)

    def build_from(self, values: dict[int, torch.Tensor]) -> None:
        """Takes this rank's shards (and fp32 masters) from full-size parameter values by ``id`` of the
        parameter; the unit is sharded."""
        for storage in self.storages:
            storage.build_from([values[id(p)] for p in storage.params])

    def _move(self, expected: UnitState, to: UnitState) -> None:
        if self.state is not expected:
            raise RuntimeError(f"zerocore internal error: unit {self.name!r} went {self.state.value} -> "
                               f"{to.value}, but only {expected.value} -> {to.value} is legal")
        self.state = to
        if self.flags is not None:
            self.flags[self.slot] = to is UnitState.SHARDED

    def stage_own(self) -> str | None:
        """Every storage's own shard in place for a gather; a failed read (an NVMe parameter shard) is returned."""
        failures = [storage.stage_own(0) for storage in self.storages]
        return next((f for f in failures if f is not None), None)

    def start_gather(self, comms: list[Any], label: str, check: DivergenceCheck, tag: Any,
                     keep_secondary: tuple[int, int] | None = None) -> None:
        """SHARDED -> GATHERING (this rank's values already staged by ``stage_own``): each storage's
        all-gather, over its ``comms`` entry, is issued right after the divergence tag's (``tag``). With
        ``keep_secondary`` (hpZ partition size, index in it) the landed values' slices are kept for the backward."""
        self._move(UnitState.SHARDED, UnitState.GATHERING)
        self.pending = [storage.gather(comm, 0, label, staged=True) for storage, comm in zip(self.storages, comms)]
        self._tag_check = (check, tag)
        self._keep_secondary = keep_secondary

    def start_partition_gather(self, comm: Any, label: str, check: DivergenceCheck, tag: Any,
                               slot: tuple[int, int]) -> None:
        """SHARDED -> GATHERING from the hpZ secondary slices (``slot``: partition size, index in it), inside
        the partition only (``comm``)."""
        assert self.secondary is not None
        self._move(UnitState.SHARDED, UnitState.GATHERING)
        self.pending = [storage.gather_from_slice(comm, values, *slot, label)
                        for storage, values in zip(self.storages, self.secondary)]
        self._tag_check = (check, tag)
        self._keep_secondary = None

    def wait(self) -> None:
        """GATHERING -> GATHERED: the tag is checked first (Note [Divergence tags]), then the gathers land."""
        if self.state is UnitState.GATHERING:
            if self._gather_failed is not None:  # a later wait (a release while the error unwinds) says so again
                raise RuntimeError(f"the gather of unit {self.name!r} failed earlier ({self._gather_failed}); the "
                                   "ranks' collectives are out of step") from self._gather_failed
            check, tag = self._tag_check
            check.after_gather(tag)  # raises while ranks diverged: then every later wait raises it again
            try:
                for pending in self.pending:
                    pending.wait()
            except BaseException as error:
                self._gather_failed = error
                raise
            self._tag_check = None
            self.pending = []
            self._move(UnitState.GATHERING, UnitState.GATHERED)
            if self._keep_secondary is not None:
                self.secondary = [storage.partition_slice(*self._keep_secondary).clone() for storage in self.storages]
                self._keep_secondary = None
            for storage in self.storages:
                storage.attach_views()

    def release(self) -> None:
        """GATHERED -> SHARDED (a gather in flight lands first: never free memory a collective writes). A write
        to the unit's parameters while it was whole (``nn.Embedding(max_norm=)`` renormalizes rows in its
        forward; a hook may scale a weight) reaches this rank's shard and master first, as at stages 1-2."""
        self.wait()
        for storage, quantized in zip(self.storages, self.quantized_storages):
            if storage.params_written():
                if quantized:
                    raise RuntimeError(
                        f"a parameter of unit {self.name!r} was written in place while gathered through "
                        "zero_quantized_weights (int8): its other values are the quantized ones, so the write "
                        "cannot be kept apart from them. Write parameters outside the forward, inside "
                        "zerocore.gathered(..., modifier_rank=0), or turn zero_quantized_weights off")
                storage.absorb_param_writes()
        for storage in self.storages:
            storage.free()
        self._move(UnitState.GATHERED, UnitState.SHARDED)
