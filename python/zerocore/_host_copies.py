"""ZeRO-Offload's copies between a GPU's parameter shards and the host buffers the CPU Adam works in.

Note [Offload copies]
---------------------
With the optimizer state in host memory (``offload_optimizer: cpu``) and the parameters on a GPU, the step
walks the shards: a shard's reduced gradients (and, in 16-bit training, its parameters as they are, for
Note [Writes through .data]) come into pinned host staging buffers, the CPU Adam updates the fp32 master
and writes the new parameters, and those go back. The copies run on two streams of their own, so they
overlap the CPU's work instead of waiting for it:

* to the host: at the start of the step every shard's copies are queued on the device-to-host stream,
  behind all the work the current stream holds (the gradients' reduction); the CPU waits for shard ``i``'s
  copies only (an event) before updating it, while the later shards' copies are still running;
* to the device: shard ``i``'s parameters go back on the host-to-device stream while the CPU updates shard
  ``i + 1``; the current stream waits for that copy (an event, no host sync) before anything issued after
  it there reads the shard: the step's ``after_shard`` (stages 1-2's all-gather of the bucket, stage 3's
  gathers for the next forward) and the next forward.

Ordering across steps: each step's device-to-host copies wait for the current stream, which waited for the
previous step's host-to-device copies, so a staging buffer is never refilled while a copy still reads it;
and the CPU has waited for every device-to-host copy before the step returns, so the next backward can
write the gradients. Each host-to-device copy also waits for the current stream first: whatever was issued
there before it (a previous shard's gather) is ordered before the shard is overwritten. With parameter
shards on NVMe (``before_shard`` loads shard ``i`` just before its update) shard ``i``'s copies to the host
are queued only once it is loaded. Without pinned memory (``pin_memory: false``) the same code runs, the
copies to the host then completing before they return (CUDA's rule for pageable memory).

A CPU-only machine never stages (the state and the parameters share the host's memory);
tests/test_offload.py runs this walk on the CPU with copies that land only when waited for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class StreamCopies:
    """The two copy streams of Note [Offload copies] on one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.to_host_stream = torch.cuda.Stream(device)
        self.to_device_stream = torch.cuda.Stream(device)

    def to_host(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Queues ``dst.copy_(src)`` (host ``dst``, device ``src``) for each pair behind the current stream's
        work; returns what :meth:`wait_on_host` takes."""
        self.to_host_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.to_host_stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        return self.to_host_stream.record_event()

    def wait_on_host(self, ticket: Any) -> None:
        """Blocks the CPU until the copies ``to_host`` returned ``ticket`` for have landed."""
        ticket.synchronize()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queues ``dst.copy_(src)`` (device ``dst``, host ``src``); the current stream waits for it."""
        current = torch.cuda.current_stream(self.device)
        self.to_device_stream.wait_stream(current)
        with torch.cuda.stream(self.to_device_stream):
            dst.copy_(src, non_blocking=True)
        current.wait_event(self.to_device_stream.record_event())
