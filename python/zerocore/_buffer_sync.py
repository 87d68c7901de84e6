"""DDP's ``broadcast_buffers=True``: every rank's forward sees rank 0's buffers (BatchNorm running statistics).

Note [Buffers follow rank 0]
----------------------------
As DDP does, rank 0's buffers are broadcast at the start of a forward when the *previous* forward ran with grad
enabled outside ``no_sync()`` (DDP's ``require_forward_param_sync``), and at the first forward. So the values
every forward sees, and the buffers at rest on every rank, are DDP's: an evaluation forward under
``torch.no_grad()`` right after training runs on rank 0's statistics on every rank; the training forward after
an evaluation forward on each rank's own. As with DDP, that first evaluation forward through the engine is a
collective: evaluating on one rank alone goes through the module itself (``model(x)``, DDP's ``.module``), or
with ``engine.broadcast_buffers = False``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._transforms import outside_transforms


class BufferSync:
    """When rank 0's buffers are broadcast; ``enabled`` is the engine's ``broadcast_buffers``."""

    def __init__(self, comm: Any, module: nn.Module, world_size: int) -> None:
        self.comm, self.module, self.world_size = comm, module, world_size
        self.enabled = True
        self.due = True  # DDP's require_forward_param_sync: this forward starts from rank 0's buffers

    def before_forward(self) -> None:
        if self.enabled and self.due:
            sync_buffers(self.comm, self.module, self.world_size)

    def after_forward(self, synced: bool) -> None:
        """``synced``: the forward ran with grad enabled outside ``no_sync()`` (DDP syncs the next one)."""
        self.due = synced


@outside_transforms  # the broadcast writes the module's own buffers (Note [torch.func transforms])
def sync_buffers(comm: Any, module: nn.Module, world_size: int) -> None:
    """Rank 0's buffers on every rank."""
    if world_size > 1:
        broadcast_tensors(comm, list(module.buffers()), 0)


def broadcast_tensors(comm: Any, tensors: list[torch.Tensor], source: int) -> None:
    """``source``'s values of ``tensors`` (the same shapes on every rank) on every rank: one broadcast per dtype.
    Also for parameters every rank holds whole, written on one rank inside ``zerocore.gathered()``."""
    tensors = [t for t in tensors if t.numel()]
    with torch.no_grad():
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in same])
            comm.broadcast(flat, source, -1).wait()
            offset = 0
            for t in same:
                # through .data, as DDP's C++ broadcast writes: the buffer's autograd version stays, so a second
                # forward before the backward (contrastive pairs) does not invalidate the first one's graph
                t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
