"""Stage-3 parameter shards on NVMe (ZeRO-Infinity's ``offload_param: {device: nvme}``).

Note [NVMe parameter shards]
----------------------------
At rest a stage-3 unit's only copy of its values is this rank's shard of them (compute dtype, Note [Stage 3
gather and release]). With ``offload_param: nvme`` the shards of the units beyond the first ``max_in_cpu``
elements (DeepSpeed's meaning: that many parameter elements per rank stay in memory, in unit order) live in
one file per rank under ``nvme_path``; their in-memory storage is resized to zero at rest, like a released
unit's full buffer. A shard comes back into memory only for as long as something reads or writes it:

* a gather reads the unit's region of the file into this rank's region of the gathered buffer, which is
  where the shard's values are copied to anyway; and once the prefetch order is recorded (Note [Stage 3
  gather and release]), each gather starts reading the shard of the unit gathered after it (the next in
  forward, the previous in backward) into a read-ahead buffer, so the disk works while the unit computes;
* the optimizer step loads each offloaded shard just before Adam updates it and writes it back and frees
  it right after (``OptimizerState.step``'s ``before_shard``/``after_shard``), so a step holds one shard;
* everything else that touches a shard (checkpoint loads, writes made inside ``zerocore.gathered``, writes
  absorbed before a step) goes through ``OptimizerState.resident``, which holds the shard in memory for
  its block and writes it back when the block wrote.

The file is made and fully allocated at initialize (a missing or read-only path, a full disk: an error
naming the key and the path), and unlinked at once like the optimizer state's (Note [NVMe optimizer state]):
it goes when the engine closes or the process dies. Reads and writes go through the C++ I/O engine, O_DIRECT
through 4 KiB-aligned buffers of the largest shard's size, one to bounce through and one to read ahead into
(a shard's own memory and a gathered buffer's region are not 4 KiB aligned). A write drops a read-ahead of
the same shard, which it makes stale. The values are the same bytes as in memory, so training is bitwise
the same as without the offload.

An I/O error never leaves a rank alone in a collective: a gather whose read failed still issues its
all-gather (zeros for this rank's region) and flags the failure in the unit's divergence tag, so every rank
raises at that gather's wait, naming the ranks that failed (Note [Divergence tags]); a read or write that
fails in the step is kept (``step_failure``) and the engine's after-step verdict makes every rank raise.
Writes and reads outside these two (checkpoint loads, ``zerocore.gathered`` writes) raise where they fail.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ._nvme_state import NamelessFile
from ._safetensors_io import ALIGN, aligned_empty

_KEY = "zero_optimization.offload_param.nvme_path"


class ParamShardFile(NamelessFile):
    """One rank's file of offloaded parameter shards, and the budget of elements kept in memory."""

    def __init__(self, io: Any, directory: str, rank: int, max_in_cpu: int) -> None:
        super().__init__(io, directory, _KEY, f"zerocore-params-rank{rank}")
        self.in_memory_budget = max_in_cpu
        self.kept_in_memory = 0  # elements of shards kept in memory (the first max_in_cpu, in unit order)
        self.size = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.bounce = torch.empty(0, dtype=torch.uint8)
        self.ahead = torch.empty(0, dtype=torch.uint8)  # where the next unit's shard comes off the disk
        self._ahead: tuple[int, int] | None = None  # (file offset, request) of the read-ahead in flight
        self.reads_ahead_used = 0
        # A shard that cannot be placed (full disk) stays in memory and the error is kept, not raised: the
        # other ranks go on through initialize's collectives, then every rank raises (_step.agree_on_state_files).
        self.failure: OSError | None = None
        self.step_failure: str | None = None  # an I/O error of the step's loads and write-backs

    def place(self, numel: int, dtype: torch.dtype) -> int | None:
        """Where a shard of ``numel`` ``dtype`` elements lives: None to keep it in memory (within
        ``max_in_cpu``), else its byte offset in the file (allocated now: a full disk fails here)."""
        if self.failure is not None or self.kept_in_memory + numel <= self.in_memory_budget:
            self.kept_in_memory += numel
            return None
        nbytes = numel * dtype.itemsize
        stride = _aligned(nbytes)
        offset = self.size
        try:
            os.posix_fallocate(self.fd, offset, stride)
        except OSError as error:
            self.failure = type(error)(error.errno, f"{_KEY}: cannot allocate {stride} bytes for parameter "
                                                    f"shards at offset {offset} of {self.path}: {error.strerror}",
                                       self.path)
            self.kept_in_memory += numel
            return None
        self.size += stride
        if self.bounce.numel() < stride:
            self.bounce, self.ahead = aligned_empty(stride), aligned_empty(stride)
        return offset

    def read_ahead(self, offset: int, nbytes: int) -> None:
        """Starts reading the shard at ``offset`` into the read-ahead buffer (one at a time), so the gather
        that needs it next finds it there or on its way."""
        if self._ahead is not None:
            if self._ahead[0] == offset:
                return
            self._drop_ahead()
        window = self.ahead[: _aligned(nbytes)]
        self._ahead = (offset, self.io.read(self.handle, offset, window))
        self.bytes_read += window.numel()

    def _drop_ahead(self) -> None:
        assert self._ahead is not None
        _, request = self._ahead
        self._ahead = None
        try:
            self.io.wait(request)
        except OSError:
            pass  # nobody used it; a read that needs the shard reads it again and raises then

    def read(self, offset: int, out: torch.Tensor) -> None:
        """``out`` (contiguous) takes its bytes from ``offset`` (from the read-ahead when it is that shard)."""
        nbytes = out.numel() * out.element_size()
        if self._ahead is not None and self._ahead[0] == offset:
            _, request = self._ahead
            self._ahead = None
            self._wait(request, "reading", offset, _aligned(nbytes))
            out.view(-1).view(torch.uint8).copy_(self.ahead[:nbytes])
            self.reads_ahead_used += 1
            return
        window = self.bounce[: _aligned(nbytes)]
        self._wait(self.io.read(self.handle, offset, window), "reading", offset, window.numel())
        out.view(-1).view(torch.uint8).copy_(window[:nbytes])
        self.bytes_read += window.numel()

    def write(self, offset: int, values: torch.Tensor) -> None:
        """``values``' bytes go to ``offset`` (the rest of the aligned block is zero)."""
        nbytes = values.numel() * values.element_size()
        if self._ahead is not None and self._ahead[0] == offset:
            self._drop_ahead()  # it holds the values this write replaces
        window = self.bounce[: _aligned(nbytes)]
        window[:nbytes].copy_(values.reshape(-1).view(torch.uint8))
        window[nbytes:].zero_()
        self._wait(self.io.write(self.handle, offset, window), "writing", offset, window.numel())
        self.bytes_written += window.numel()

    def try_read(self, offset: int, out: torch.Tensor) -> str | None:
        """``read``, but a failure is returned (``out`` is then zeros), not raised: a gather still issues its
        collectives and every rank learns of it through the unit's tag (Note [Divergence tags])."""
        try:
            self.read(offset, out)
            return None
        except OSError as error:
            out.zero_()
            return str(error)

    def _wait(self, request: int, doing: str, offset: int, nbytes: int) -> None:
        try:
            self.io.wait(request)
        except OSError as error:
            raise OSError(error.errno, f"offload_param: {doing} {nbytes} bytes of parameter shards at offset "
                                       f"{offset} of {self.path} failed: {error}", self.path) from None

def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class _Failed:
    """What a rank that could not create its parameter file holds: no shard is placed, the error is kept."""

    def __init__(self, error: OSError) -> None:
        self.failure = error
        self.size = self.bytes_read = self.bytes_written = 0
        self.bounce = self.ahead = torch.empty(0, dtype=torch.uint8)
        self.reads_ahead_used = 0
        self.step_failure = None

    def place(self, numel: int, dtype: torch.dtype) -> None:
        return None

    def close(self) -> None:
        pass


def plan_param_file(shards: list[tuple[int, int]], max_in_cpu: int) -> tuple[list[bool], int, int]:
    """Pure, as ``ParamShardFile.place`` decides for shards (elements, bytes per element) given in the order
    the engine builds them: which are offloaded, the file's size and the bytes of its two buffers (bounce
    and read-ahead; ``zerocore.estimate_memory`` plans with it)."""
    offloaded, kept, size, bounce = [], 0, 0, 0
    for numel, width in shards:
        if kept + numel <= max_in_cpu:
            kept += numel
            offloaded.append(False)
            continue
        stride = _aligned(numel * width)
        size += stride
        bounce = max(bounce, stride)
        offloaded.append(True)
    return offloaded, size, 2 * bounce


def param_file_for(offload: Any, aio: dict[str, Any], rank: int) -> ParamShardFile | _Failed:
    """``offload_param: {device: nvme}``: this rank's parameter file (or, when it cannot be made, a holder
    of the error: see ``ParamShardFile.failure``)."""
    from ._safetensors_io import open_io

    try:
        return ParamShardFile(open_io(aio), offload.nvme_path, rank, int(offload.max_in_cpu))
    except OSError as error:
        return _Failed(error)
