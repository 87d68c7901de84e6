"""Stage 3 keeps the memory of up to two released units for the next gathers.

Note [Spare gather storage]
---------------------------
A unit's full buffer is freed when the unit is released and allocated again at its next gather (Note [Stage 3
gather and release]). On the CPU, memory of a unit's size freed to the C allocator goes back to the kernel, so
every gather faults its pages in again, one 4 KiB page at a time, while the gather is being waited for:
thousands of page faults a unit, several percent of a step. So the runtime keeps the memory of released units
as spares, up to ``capacity`` bytes (the two largest units: the root unit, released at every step and gathered
first, and a block that a prefetching gather takes while the block before it is released). A release past
the capacity frees the oldest spares smaller than it to make room, if that makes enough: every block of a
model is released in its backward before the root, and keeping only the first releases had left the root,
gathered first in the step, no spare (5-8k page faults a step on the 27.4M GPT in fp32); freeing older blocks
for newer ones too would hold the whole capacity through the backward, at its memory peak. A gather takes the
newest spare of its exact size when there is one (``_C.move_storage`` hands the pages over: no copy, no allocation;
every view of the unit's storage sees them, as after a resize). ``memory_report()`` counts them as
``gather_spares``. On an accelerator the caching allocator already does this, so the spares are not used
there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._native import _C


def spare_capacity(unit_numels: Sequence[int], width: int) -> int:
    """The bytes of spares a stage-3 runtime keeps: its two largest units (the engine and estimate_memory
    both size them here)."""
    return sum(sorted(unit_numels, reverse=True)[:2]) * width


class GatherSpares:
    """Released units' memory; a capacity of 0 keeps none (every release frees, every fill allocates)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._spares: list[torch.Tensor] = []  # empty uint8 tensors owning the storages' memory
        self.held_bytes = 0

    def release(self, full: torch.Tensor) -> None:
        """``full``'s storage is left empty; its memory becomes a spare while there is room, or once spares
        smaller than it, oldest first, are freed to make room; else it is freed."""
        storage = full.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        smaller = sum(spare.untyped_storage().nbytes() for spare in self._spares
                      if spare.untyped_storage().nbytes() < nbytes)
        if full.device.type == "cpu" and self.held_bytes - smaller + nbytes <= self.capacity:
            while self.held_bytes + nbytes > self.capacity:
                index = next(i for i, spare in enumerate(self._spares) if spare.untyped_storage().nbytes() < nbytes)
                self.held_bytes -= self._spares.pop(index).untyped_storage().nbytes()
            spare = torch.empty(0, dtype=torch.uint8)
            _C.move_storage(spare, full)
            spare.resize_(nbytes)  # no allocation: the spare now covers its storage, as move_storage wants of a src
            self._spares.append(spare)
            self.held_bytes += nbytes
        else:
            storage.resize_(0)

    def fill(self, full: torch.Tensor, nbytes: int) -> None:
        """``full``'s empty storage gets ``nbytes`` of memory (uninitialized): a spare of that size if one is
        held, else a fresh allocation."""
        for index in reversed(range(len(self._spares))):
            spare = self._spares[index]
            if spare.untyped_storage().nbytes() == nbytes:
                _C.move_storage(full, spare)
                del self._spares[index]
                self.held_bytes -= nbytes
                return
        full.untyped_storage().resize_(nbytes)

    def clear(self) -> None:
        self._spares.clear()
        self.held_bytes = 0
