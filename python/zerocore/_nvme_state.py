"""Optimizer state on NVMe (ZeRO-Infinity's ``offload_optimizer: {device: nvme}``).

Note [NVMe optimizer state]
---------------------------
Each rank keeps its fp32 optimizer state in one file under ``nvme_path``, never whole in RAM. The rank's
shards are cut into *sub-groups* of at most ``sub_group_size`` elements; a sub-group's states (the fp32
master when it is not the parameter shard itself, then both moments) lie next to each other in the file,
each 4 KiB aligned, so one sub-group is one read and one write, both O_DIRECT.

``step()`` walks the sub-groups with three buffers in rotation: while the Adam kernel updates sub-group
``i`` in one buffer, the read of ``i + 1`` fills the next and the write of ``i - 1`` drains the one before,
all through the C++ I/O engine (``_C.AsyncIO``, the ``aio`` section's settings). The Adam kernel and the
order of the elements are the ones of the in-memory path, so the results are bitwise the same.

Failures: the file is created and fully allocated at initialize (a missing or read-only ``nvme_path``, a
full disk: an error naming the path before training starts); before a step changes anything, the file is
checked to be whole. An I/O error in the middle of a step is recorded; the step then skips its remaining
sub-groups but still calls ``after_shard`` for every shard, so every rank issues the same collectives, and
the engine raises on every rank after the step (Note [Backward outcome]-style verdict) with the path and
the offset: the parameters are then torn and the last checkpoint must be loaded.

The file has no name while it is in use: it is created (``zerocore-optimizer-rank{rank}-{random}.swp``),
opened by the store and the I/O engine, and unlinked at once, so the kernel frees its blocks when the last
descriptor closes -- at ``close()``, when the store is collected, or when the process dies however it dies
(SIGKILL, the OOM killer, a node's job scheduler), where a named file would stay on the disk for good. Nothing
needs the name again: every read, write and allocation goes through descriptors opened before the unlink.
Messages still name the path it was created at; ``ls -l /proc/<pid>/fd`` shows it as "(deleted)", and
``df`` counts its space while training runs. Since nobody can delete the file, only its truncation (through
``/proc``) is checked before a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._safetensors_io import ALIGN, aligned_empty

_F32 = 4


@dataclass(frozen=True)
class SubGroup:
    """Elements ``[start, end)`` of shard ``shard``; its states begin at byte ``file_offset`` of the file,
    each ``stride`` bytes apart."""

    shard: int
    start: int
    end: int
    file_offset: int
    stride: int
    states: tuple[str, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        return self.stride * len(self.states)


def plan_sub_groups(shard_sizes: Sequence[int], separate_master: Sequence[bool],
                    sub_group_size: int) -> tuple[list[SubGroup], int]:
    """The state file's layout: every shard cut into sub-groups of at most ``sub_group_size`` elements, each
    state 4 KiB aligned; and the file's size in bytes. Pure: the store allocates by it, and
    ``zerocore.estimate_memory`` sizes the file by it."""
    sub_groups: list[SubGroup] = []
    offset = 0
    for index, (numel, separate) in enumerate(zip(shard_sizes, separate_master)):
        states = ("master", "exp_avg", "exp_avg_sq") if separate else ("exp_avg", "exp_avg_sq")
        for start in range(0, numel, sub_group_size):
            end = min(numel, start + sub_group_size)
            stride = -(-(end - start) * _F32 // ALIGN) * ALIGN
            sub_groups.append(SubGroup(index, start, end, offset, stride, states))
            offset += stride * len(states)
    return sub_groups, offset


def sub_group_totals(shard_sizes: Sequence[int], separate_master: Sequence[bool],
                     sub_group_size: int) -> tuple[int, int, int]:
    """What :func:`plan_sub_groups` gives, counted without a SubGroup per sub-group (the estimate plans
    launches of any size: ``sub_group_size: 1`` at 7e9 parameters is billions of them): (sub-groups, bytes of
    the largest, the file's size)."""
    count = largest = size = 0
    for numel, separate in zip(shard_sizes, separate_master):
        states = 3 if separate else 2
        whole, rest = divmod(numel, sub_group_size)
        for n, elements in ((whole, sub_group_size), (1 if rest else 0, rest)):
            if n:
                stride = -(-elements * _F32 // ALIGN) * ALIGN
                count += n
                largest = max(largest, stride * states)
                size += n * stride * states
    return count, largest, size


def pipeline_depth(sub_groups: int) -> int:
    """The step's rotating I/O buffers: three (read, update, write) when there is more than one sub-group."""
    return 3 if sub_groups > 1 else 1


def pipeline_buffers(sub_groups: Sequence[SubGroup]) -> tuple[int, int]:
    """(count, bytes each) of the step's rotating I/O buffers (:func:`pipeline_depth`)."""
    return pipeline_depth(len(sub_groups)), max((g.nbytes for g in sub_groups), default=0)


class NamelessFile:
    """A file created under ``directory`` (checked first: errors name ``key``), opened for the store (``fd``)
    and the I/O engine (``handle``), and unlinked at once (see the Note above): ``close()``, the store being
    collected or the process dying give its blocks back."""

    def __init__(self, io: Any, directory: str, key: str, prefix: str) -> None:
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"{key}: {directory} does not exist or is not a directory")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"{key}: {directory} is not writable by this process")
        self.io = io
        # the name the file was created at, for messages: it is unlinked before this returns
        self.path = os.path.join(directory, f"{prefix}-{uuid.uuid4().hex[:12]}.swp")
        self.fd, handle = _open_nameless(io, self.path)
        self.handle: int | None = handle
        self._release = weakref.finalize(self, _release, io, handle, self.fd)  # also if never closed

    def close(self) -> None:
        """Closes the file's descriptors: the kernel frees its blocks (it has no name left)."""
        if self.handle is not None:
            try:
                self.io.wait_all()
            except OSError:
                pass
        self.handle = None
        self._release()


class NvmeStateStore(NamelessFile):
    """One rank's optimizer state file and the pipelined walk over its sub-groups."""

    def __init__(self, io: Any, directory: str, rank: int, sub_group_size: int) -> None:
        super().__init__(io, directory, "zero_optimization.offload_optimizer.nvme_path",
                         f"zerocore-optimizer-rank{rank}")
        self.sub_group_size = sub_group_size
        self.sub_groups: list[SubGroup] = []
        self.size = 0
        self._shards = 0
        self.failure: str | None = None
        self.bytes_read = 0
        self.bytes_written = 0
        self.buffers: list[torch.Tensor] = []

    def add_shard(self, numel: int, separate_master: bool, master: torch.Tensor | None) -> int:
        """Appends a shard's sub-groups to the file (allocated now: a full disk fails here, naming the file)
        and writes its initial state, one sub-group at a time: the fp32 ``master`` values when the master is
        separate, zero moments. Returns the shard's index. Shards are added as the engine builds them, so the
        fp32 values of one shard at a time are ever in memory."""
        groups, size = plan_sub_groups([numel], [separate_master], self.sub_group_size)
        index, start = self._shards, self.size
        groups = [dataclasses.replace(g, shard=index, file_offset=g.file_offset + start) for g in groups]
        if size:
            try:
                os.posix_fallocate(self.fd, start, size)
            except OSError as error:
                raise type(error)(error.errno, "zero_optimization.offload_optimizer.nvme_path: cannot allocate "
                                               f"{size} bytes for the optimizer state at offset {start} of "
                                               f"{self.path}: {error.strerror}", self.path) from None
        self.sub_groups += groups
        self.size += size
        self._shards += 1
        count, largest = pipeline_buffers(self.sub_groups)
        if not self.buffers or self.buffers[0].numel() < largest:
            self.buffers = [aligned_empty(largest)]
        for group in groups:
            buffer = self.buffers[0]
            buffer[: group.nbytes].zero_()  # moments start at zero; the alignment padding is written too
            if separate_master:
                assert master is not None
                self.views(group, buffer)["master"].copy_(master[group.start : group.end])
            self._wait(self._write(group, buffer), group)
        return index

    def finish(self) -> None:
        """Every shard is added: the step's rotating buffers."""
        count, largest = pipeline_buffers(self.sub_groups)
        self.buffers = self.buffers[:1] + [aligned_empty(largest) for _ in range(count - 1)]
        self.bytes_read = self.bytes_written = 0  # the initial writes are not a step's I/O

    # ---- whole shards (initialize, checkpoints, writes by the user) ---------------------------------------
    def views(self, group: SubGroup, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The sub-group's fp32 states inside ``buffer`` (its layout in the file)."""
        floats = buffer[: group.nbytes].view(torch.float32)
        step = group.stride // _F32
        return {name: floats[i * step : i * step + group.numel] for i, name in enumerate(group.states)}

    def read_shard(self, shard: int) -> dict[str, torch.Tensor]:
        """The shard's states, read into fresh tensors (one shard in RAM at a time)."""
        groups = [g for g in self.sub_groups if g.shard == shard]
        return self.read_range(shard, 0, groups[-1].end if groups else 0)

    def _overlapping(self, shard: int, start: int, end: int) -> list[SubGroup]:
        return [g for g in self.sub_groups if g.shard == shard and g.start < end and g.end > start]

    def read_range(self, shard: int, start: int, end: int) -> dict[str, torch.Tensor]:
        """Elements ``[start, end)`` of the shard's states, read into fresh tensors: only the sub-groups that
        hold them are read (one parameter's state, not its whole shard)."""
        groups = self._overlapping(shard, start, end)
        out = {name: torch.empty(end - start, dtype=torch.float32) for name in (groups[0].states if groups else ())}
        for group in groups:
            buffer = self.buffers[0]
            self._wait(self._read(group, buffer), group)
            lo, hi = max(start, group.start), min(end, group.end)
            for name, view in self.views(group, buffer).items():
                out[name][lo - start : hi - start].copy_(view[lo - group.start : hi - group.start])
        return out

    def write_range(self, shard: int, start: int, values: dict[str, torch.Tensor]) -> None:
        """Writes elements ``[start, start + n)`` of the shard's states from ``values`` (n elements each; a
        state left out keeps its values): each sub-group holding them is read, changed and written back."""
        end = start + next(iter(values.values())).numel() if values else start
        for group in self._overlapping(shard, start, end):
            buffer = self.buffers[0]
            self._wait(self._read(group, buffer), group)
            lo, hi = max(start, group.start), min(end, group.end)
            views = self.views(group, buffer)
            for name, value in values.items():
                views[name][lo - group.start : hi - group.start].copy_(value[lo - start : hi - start])
            self._wait(self._write(group, buffer), group)

    def write_shard(self, shard: int, values: dict[str, torch.Tensor]) -> None:
        for group in (g for g in self.sub_groups if g.shard == shard):
            buffer = self.buffers[0]
            buffer[: group.nbytes].zero_()  # the alignment padding is written too: keep it deterministic
            for name, view in self.views(group, buffer).items():
                view.copy_(values[name][group.start : group.end])
            self._wait(self._write(group, buffer), group)

    # ---- the step --------------------------------------------------------------------------------------
    def check_whole(self) -> str | None:
        """Why the file cannot serve a step (not its size), or None."""
        try:
            size = os.fstat(self.fd).st_size
        except OSError as error:
            return f"cannot stat the optimizer state file {self.path}: {error.strerror}"
        if size < self.size:
            return f"the optimizer state file {self.path} was truncated to {size} of {self.size} bytes"
        return None

    def step(self, update: Callable[[SubGroup, dict[str, torch.Tensor]], None],
             after_shard: Callable[[int], None] | None,
             before_shard: Callable[[int], None] | None = None) -> None:
        """Reads, updates (``update(group, views)``) and writes back every sub-group, three deep; calls
        ``before_shard(i)`` before shard ``i``'s first sub-group is updated and ``after_shard(i)`` once its
        last one is. An I/O error is recorded in ``failure`` (the remaining sub-groups are skipped, both hooks
        are still called for every shard)."""
        groups = self.sub_groups
        slots = len(self.buffers)
        reads: dict[int, int] = {}
        writes: dict[int, int] = {}

        def start_read(i: int) -> None:
            if i < len(groups) and self.failure is None:
                previous = i - slots  # the last user of this buffer wrote it back
                if previous in writes:
                    self._wait_in_step(writes.pop(previous), groups[previous])
                if self.failure is None:
                    reads[i] = self._read(groups[i], self.buffers[i % slots])

        start_read(0)
        for i, group in enumerate(groups):
            if before_shard is not None and (i == 0 or groups[i - 1].shard != group.shard):
                before_shard(group.shard)
            start_read(i + 1)
            if self.failure is None:
                self._wait_in_step(reads.pop(i), group)
            if self.failure is None:
                update(group, self.views(group, self.buffers[i % slots]))
                writes[i] = self._write(group, self.buffers[i % slots])
            last_of_shard = i + 1 == len(groups) or groups[i + 1].shard != group.shard
            if last_of_shard and after_shard is not None:
                after_shard(group.shard)
        for i, request in sorted(writes.items()):
            self._wait_in_step(request, groups[i])
        for i, request in sorted(reads.items()):
            self._wait_in_step(request, groups[i])

    def _read(self, group: SubGroup, buffer: torch.Tensor) -> int:
        self.bytes_read += group.nbytes
        return self.io.read(self.handle, group.file_offset, buffer[: group.nbytes])

    def _write(self, group: SubGroup, buffer: torch.Tensor) -> int:
        self.bytes_written += group.nbytes
        return self.io.write(self.handle, group.file_offset, buffer[: group.nbytes])

    def _wait(self, request: int, group: SubGroup) -> None:
        try:
            self.io.wait(request)
        except OSError as error:
            raise OSError(error.errno, f"{error} (optimizer state of shard {group.shard}, elements "
                                       f"[{group.start}, {group.end}))", self.path) from None

    def _wait_in_step(self, request: int, group: SubGroup) -> None:
        try:
            self._wait(request, group)
        except OSError as error:
            if self.failure is None:
                self.failure = str(error)

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise OSError(self.failure)


def _open_nameless(io: Any, path: str) -> tuple[int, int]:
    """Creates ``path``, opens it for the store (an fd) and for ``io`` (a handle), and unlinks it; on any
    failure nothing is left open or on the disk."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    handle = None
    try:
        handle = io.open(path, "rw")
        os.unlink(path)
    except BaseException:
        if handle is not None:
            io.close(handle)
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return fd, handle


def _release(io: Any, handle: int, fd: int) -> None:
    io.close(handle)  # requests still in flight keep their descriptors until they finish
    os.close(fd)
