"""Stage-3 parameter shards in host memory on a GPU machine (ZeRO-Offload's ``offload_param: {device: cpu}``).

Note [Host parameter shards]
----------------------------
The NVMe parameter file's protocol (Note [NVMe parameter shards]) with host memory in place of the file: every
stage-3 shard, trainable and frozen, is copied to a host tensor of its own (page-locked with ``pin_memory``,
DeepSpeed's default) when it is built, and its device storage is resized to nothing at rest. A gather copies
the shard from the host straight into this rank's region of the gathered buffer; the optimizer step brings one
shard at a time to the device and sends it back after Adam updated it; checkpoint loads and writes inside
``zerocore.gathered`` go through ``OptimizerState.resident`` as they do for the file. The copies are
synchronous (the host tensor is the only copy of the values, so nothing may run ahead of them), the values are
the same bytes, and training is bitwise the same as without the offload. DeepSpeed's ``max_in_cpu`` is about
NVMe only, so every shard is offloaded. On a CPU-only machine the parameters already are in host memory and
``offload_param: cpu`` changes nothing (no object of this class is made there).

The class answers to what the engine asks of a parameter file (``place``, ``read``, ``try_read``, ``write``,
``read_ahead``, ``close``, ``failure``, ``step_failure`` and the report's counters); host memory cannot fail a
copy the way a disk can, so the failures stay None and the NVMe counters 0. ``memory_report()`` shows the
shards' bytes as ``bytes["param_offload"]`` (host memory).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ._user_frames import user_stacklevel


def offloads_to_host(offload: Any, device: torch.device) -> bool:
    """Whether ``offload_param`` (the config's section) moves stage 3's shards off ``device`` into host memory."""
    return offload.device == "cpu" and device.type != "cpu"


class HostParamShards:
    """One rank's stage-3 parameter shards in host memory (Note [Host parameter shards])."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._shards: dict[int, torch.Tensor] = {}  # by offset: each shard's bytes
        self.host_bytes = 0
        # what the report reads of a parameter file: no file, no bounce or read-ahead buffers, no I/O
        self.size = self.bytes_read = self.bytes_written = self.reads_ahead_used = 0
        self.bounce = self.ahead = torch.empty(0, dtype=torch.uint8)
        self.failure: OSError | None = None
        self.step_failure: str | None = None

    def place(self, numel: int, dtype: torch.dtype) -> int:
        """A host tensor for a shard of ``numel`` ``dtype`` elements; its key (offsets in the order placed)."""
        nbytes = numel * dtype.itemsize
        offset = self.host_bytes
        try:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        except RuntimeError as error:  # pinning past the memlock limit (ulimit -l), typically
            if not self.pin_memory:
                raise
            warnings.warn(f"zero_optimization.offload_param.pin_memory: pinning {nbytes} more bytes of parameter "
                          f"shards (after {self.host_bytes}) failed ({error}); this rank keeps its shards in "
                          "pageable host memory instead (the same values, slower copies). Raise `ulimit -l`, or "
                          "set pin_memory false; `python -m zerocore.doctor` checks it", RuntimeWarning,
                          stacklevel=user_stacklevel())
            self.pin_memory = False
            host = torch.empty(nbytes, dtype=torch.uint8)
        self._shards[offset] = host
        self.host_bytes += nbytes
        return offset

    def read(self, offset: int, out: torch.Tensor) -> None:
        """``out`` (contiguous, on the device) takes the shard's values."""
        out.view(-1).view(torch.uint8).copy_(self._shards[offset])

    def try_read(self, offset: int, out: torch.Tensor) -> str | None:
        self.read(offset, out)
        return None

    def write(self, offset: int, values: torch.Tensor) -> None:
        """The shard takes ``values`` (its parameter shard, on the device)."""
        self._shards[offset].copy_(values.reshape(-1).view(torch.uint8))

    def read_ahead(self, offset: int, nbytes: int) -> None:
        """Nothing to start: a copy from host memory needs no disk read ahead of it."""

    def close(self) -> None:
        self._shards.clear()
