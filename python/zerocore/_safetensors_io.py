"""Safetensors files written and read at disk speed, every byte checked against a CRC-32C per block.

Note [Block checksums]
----------------------
Every file a checkpoint holds carries one CRC-32C per ``block`` bytes of its data (1 MiB; the last block
is shorter) and one of its header, computed from memory while the file is written and stored in
``index.json`` (the block checksums as one hex string, 8 characters per block: 8 MB of index per TB). A reader that needs only some
byte ranges of a file (a rank resharding a checkpoint, ``to-hf`` assembling one tensor) reads the blocks
covering them, through the C++ I/O engine (``_C.AsyncIO``), and checks each block before any byte is used: a truncated, flipped or swapped file is refused naming the file
and the byte range. One checksum per whole file would force every reader to read every byte of every file
it touches; small blocks keep the bytes read close to the bytes needed even when a rank's share is
scattered (stage 3 resharded from another world size takes a slice of every parameter).

Note [Huge pages for direct I/O]
-------------------------------
Every O_DIRECT read or write pins the user pages it moves and hands the device one segment per physical
page. Into 4 KiB pages that bookkeeping, not the disk, bounds a read: two ranks each loading 164 MB of
checkpoint read at 0.55-0.8 GB/s into fresh or pre-faulted 4 KiB pages, and at the disk's speed (1.0-1.2
GB/s, the same as a buffered ``readinto`` loop) into memory advised ``MADV_HUGEPAGE`` (2 MiB pages; the
kernel's default "madvise" mode gives them only to memory that asks). So ``aligned_empty`` places a buffer
of two huge pages or more at a huge page's start and advises it before any page is touched: the checkpoint
reader's destinations (which a load adopts as the optimizer state), its staging chunks and the NVMe bounce
buffers. Where the kernel has no transparent huge pages the advice is skipped and nothing else changes.
With the page cache filling all but 229 MiB of RAM, where each huge page must first be compacted out of it,
the same load read at the disk's speed all the same (107 ms against the disk's 107 ms; 2026-12-02).

The files are plain safetensors (an 8-byte little-endian header length, a JSON header of dtypes, shapes and
byte offsets, then the data), readable by the ``safetensors`` library; writing them here needs no numpy
(``safetensors.torch.save_file`` does, and torch's CPU wheels do not bring it).
"""

from __future__ import annotations

import bisect
import ctypes
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ._native import _C

BLOCK = 1 << 20
_CHUNK = 8 << 20  # bytes per read while loading
_IN_FLIGHT = 8  # reads in flight while loading
ALIGN = 4096  # O_DIRECT needs buffer, offset and length aligned to the device's block
_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
             torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
             torch.complex64: "C64"}  # Llama's rotary freqs_cis buffer
_TORCH_DTYPE = {v: k for k, v in _ST_DTYPE.items()}


def writable(dtype: torch.dtype) -> bool:
    """Whether safetensors has a name for ``dtype`` (complex128, for one, has none)."""
    return dtype in _ST_DTYPE

Entry = tuple[str, Sequence[int], torch.dtype]


def numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    return numel(shape) * torch.empty((), dtype=dtype).element_size()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor as a flat uint8 view (no copy)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _writable(data: torch.Tensor) -> Any:
    """A buffer-protocol view of a contiguous uint8 CPU tensor's memory, for ``file.write`` without a copy."""
    return (ctypes.c_char * data.numel()).from_address(data.data_ptr())


class BlockChecksums:
    """CRC-32C of every ``block`` bytes of a stream fed in pieces of any size (Note [Block checksums])."""

    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self.crcs: list[int] = []
        self._crc = 0
        self._filled = 0

    def update(self, data: torch.Tensor) -> None:
        pos, n = 0, data.numel()
        while pos < n:
            take = min(n - pos, self.block - self._filled)
            self._crc = _C.crc32c(data[pos : pos + take], self._crc)
            self._filled += take
            pos += take
            if self._filled == self.block:
                self.crcs.append(self._crc)
                self._crc, self._filled = 0, 0

    def finish(self) -> list[int]:
        if self._filled:
            self.crcs.append(self._crc)
            self._crc, self._filled = 0, 0
        return self.crcs


def write(path: str, entries: Sequence[Entry], tensor: Callable[[str, Sequence[int], torch.dtype], torch.Tensor],
          block: int = BLOCK) -> dict[str, Any]:
    """Writes ``entries`` (name, shape, dtype) as one safetensors file, asking ``tensor(name, shape, dtype)``
    for each in turn and dropping it once written, so a file can be assembled one tensor at a time: the
    header is known from the shapes alone. The header is padded (with spaces, as the format allows) so the
    data starts on a 4 KiB boundary, where O_DIRECT reads can land. Written under a temporary name, fsynced
    and renamed. Returns the file's checksums (Note [Block checksums])."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dt in entries:
        if dt not in _ST_DTYPE:
            raise ValueError(f"cannot write {name!r}: safetensors has no {dt}")
        size = nbytes(shape, dt)
        header[name] = {"dtype": _ST_DTYPE[dt], "shape": [int(d) for d in shape],
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    head = len(raw).to_bytes(8, "little") + raw
    sums = BlockChecksums(block)
    tmp = path + ".tmp"
    with open(tmp, "wb", buffering=0) as f:
        f.write(head)
        for name, shape, dt in entries:
            value = tensor(name, shape, dt)
            if list(value.shape) != [int(d) for d in shape] or value.dtype != dt:
                raise ValueError(f"{name!r}: expected {dt} {list(shape)}, got {value.dtype} {list(value.shape)}")
            data = _as_bytes(value.cpu().contiguous())
            sums.update(data)
            if data.numel():
                f.write(_writable(data))
            del value, data
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"size": len(head) + offset, "header_bytes": len(head),
            "header_crc32c": _C.crc32c(torch.frombuffer(bytearray(head), dtype=torch.uint8), 0),
            "block": block, "crc32c": "".join(f"{c:08x}" for c in sums.finish())}


def write_tensors(path: str, tensors: Mapping[str, torch.Tensor], block: int = BLOCK) -> dict[str, Any]:
    """``tensors`` as one safetensors file (see :func:`write`)."""
    return write(path, [(name, list(t.shape), t.dtype) for name, t in tensors.items()],
                 lambda name, shape, dt: tensors[name], block)


class VerifiedFile:
    """Byte ranges of one safetensors file's data, each read with the blocks around it and checked against
    the file's block checksums before it is handed out (Note [Block checksums])."""

    def __init__(self, io: Any, path: str, checksums: Mapping[str, Any]) -> None:
        self.path = path
        try:
            self.size = int(checksums["size"])
            self.data_start = int(checksums["header_bytes"])
            self.block = int(checksums["block"])
            text = checksums["crc32c"]
            self.crcs = [int(text[i : i + 8], 16) for i in range(0, len(text), 8)]
            header_crc = int(checksums["header_crc32c"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"index.json has no valid checksums for {path} ({error!r}): the index is damaged") from None
        blocks = -(-(self.size - self.data_start) // self.block) if self.block > 0 else -1
        if self.block <= 0 or not 8 <= self.data_start <= self.size or len(self.crcs) != blocks:
            raise ValueError(f"index.json lists {len(self.crcs)} checksums for {path}, which should have {blocks} "
                             f"data blocks of {self.block} bytes: the index is damaged")
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint file {path} is missing")
        actual = os.path.getsize(path)
        if actual != self.size:
            raise ValueError(f"checkpoint file {path} has {actual} bytes but {self.size} were written "
                             f"({'truncated' if actual < self.size else 'grown'} after saving)")
        self._io = io
        self._handle = io.open(path, "r")
        head = torch.empty(self.data_start, dtype=torch.uint8)
        io.wait(io.read(self._handle, 0, head))
        if _C.crc32c(head, 0) != header_crc:
            raise ValueError(f"checkpoint file {path} does not match its checksum in index.json in its header "
                             f"(bytes [0, {self.data_start})): changed or damaged after saving")
        raw = _writable(head).raw
        try:
            if int.from_bytes(raw[:8], "little") != self.data_start - 8:
                raise ValueError("header length")
            self.header = json.loads(raw[8:])
        except (UnicodeDecodeError, ValueError) as error:
            raise ValueError(f"checkpoint file {path} has a damaged header: {error}") from None
        self.header.pop("__metadata__", None)

    def close(self) -> None:
        if self._handle is not None:
            self._io.close(self._handle)
            self._handle = None

    def tensor_range(self, name: str) -> tuple[int, torch.dtype, list[int]]:
        """``(byte offset in the data, dtype, shape)`` of the tensor ``name``."""
        entry = self.header.get(name)
        if entry is None:
            raise ValueError(f"checkpoint file {self.path} holds no tensor {name!r}")
        start, end = entry["data_offsets"]
        dtype = _TORCH_DTYPE.get(entry["dtype"])
        if dtype is None or end - start != nbytes(entry["shape"], dtype) or self.data_start + end > self.size:
            raise ValueError(f"checkpoint file {self.path}: tensor {name!r} has an inconsistent header entry {entry}")
        return start, dtype, list(entry["shape"])

    def read(self, ranges: Sequence[tuple[int, int]], into: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The data bytes ``[offset, offset + length)`` of every range (offsets from the start of the data),
        after checking every block they touch: written into ``into`` (one contiguous uint8 tensor per range,
        of its length) or into fresh uint8 tensors, which are returned. The blocks are read in chunks of at
        most ``_CHUNK`` bytes, ``_IN_FLIGHT`` chunks at a time, each checked and its bytes copied where they
        belong before it is dropped: the memory is the ranges' bytes plus the chunks in flight, however
        the ranges are scattered (a stage-3 shard of a checkpoint saved at another world size is). A
        destination that fails the check may hold some of the file's unchecked bytes."""
        # a chunk inside one range whose destination sits at the same offset modulo 4 KiB as its bytes in the
        # file (as fresh ones do) is read straight into it with O_DIRECT; any other chunk is read with O_DIRECT
        # into a buffer and copied: reading into a destination out of phase would go through the page cache,
        # a copy all the same and slower than the direct read (Note [Huge pages for direct I/O])
        if into is None:
            out = [aligned_empty(length, skew=offset) for offset, length in ranges]
        else:
            out = list(into)
            for (_, length), dest in zip(ranges, out, strict=True):
                if dest.dtype != torch.uint8 or dest.numel() != length or not dest.is_contiguous():
                    raise ValueError(f"read(into=...): each destination must be a contiguous uint8 tensor of "
                                     f"its range's {length} bytes, got {dest.dtype} {list(dest.shape)}")
        requested = out
        ranges, out = _coalesced(ranges, out)
        data_size = self.size - self.data_start
        wanted = sorted({b for offset, length in ranges if length
                         for b in range(offset // self.block, (offset + length - 1) // self.block + 1)})
        order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
        starts = [ranges[i][0] for i in order]
        pending: list[tuple[int, int, torch.Tensor, int, bool]] = []

        def inside(start: int, end: int) -> int | None:
            """The range holding all of ``[start, end)``, if one does."""
            i = bisect.bisect_right(starts, start) - 1
            if i >= 0:
                offset, length = ranges[order[i]]
                if end <= offset + length:
                    return order[i]
            return None

        # runs of consecutive blocks, at most per_chunk long, each held by one range or by none: a run ends
        # where a range does, so only the blocks a boundary cuts through go through a buffer, not the whole
        # chunk around them
        per_chunk = max(1, _CHUNK // self.block)
        chunks: list[tuple[int, int, int | None]] = []  # (first block, end block, the range holding them)
        for b in wanted:
            holder = inside(b * self.block, min((b + 1) * self.block, data_size))
            if chunks and chunks[-1][1] == b and b - chunks[-1][0] < per_chunk and chunks[-1][2] == holder:
                chunks[-1] = (chunks[-1][0], b + 1, holder)
            else:
                chunks.append((b, b + 1, holder))

        def land(first: int, last: int, buffer: torch.Tensor, request: int, direct: bool) -> None:
            self._io.wait(request)
            start, end = first * self.block, min(last * self.block, data_size)
            for b in range(first, last):
                lo = b * self.block - start
                hi = min(lo + self.block, end - start)
                if _C.crc32c(buffer[lo:hi], 0) != self.crcs[b]:
                    at = self.data_start + b * self.block
                    raise ValueError(f"checkpoint file {self.path} does not match its checksum in index.json in "
                                     f"bytes [{at}, {at + hi - lo}) (changed or damaged after saving)")
            if direct:
                return
            # every range overlapping [start, end) takes its part
            i = max(bisect.bisect_right(starts, start) - 1, 0)
            while i < len(order) and starts[i] < end:
                offset, length = ranges[order[i]]
                lo, hi = max(offset, start), min(offset + length, end)
                if lo < hi:
                    out[order[i]][lo - offset : hi - offset].copy_(buffer[lo - start : hi - start])
                i += 1

        for first, last, holder in chunks:
            if len(pending) == _IN_FLIGHT:
                land(*pending.pop(0))
            start, end = first * self.block, min(last * self.block, data_size)
            buffer = None
            if holder is not None:
                buffer = out[holder][start - ranges[holder][0] : end - ranges[holder][0]]
                if (buffer.data_ptr() - self.data_start - start) % ALIGN:
                    buffer = None  # a destination out of phase with the file would be read without O_DIRECT
            direct = buffer is not None
            if buffer is None:
                buffer = aligned_empty(end - start, skew=self.data_start + start)
            pending.append((first, last, buffer, self._io.read(self._handle, self.data_start + start, buffer),
                            direct))
        while pending:
            land(*pending.pop(0))
        return requested

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (checked)."""
        offset, dtype, shape = self.tensor_range(name)
        (data,) = self.read([(offset, nbytes(shape, dtype))])
        if not data.numel():
            return torch.empty(shape, dtype=dtype)
        return as_elements(data, dtype).view(shape)


def as_elements(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes read from a file as elements of ``dtype`` (a view, or a copy where they sit unaligned: safetensors
    packs tensors without aligning them to their element size)."""
    if data.storage_offset() % dtype.itemsize:
        data = data.clone()
    return data.view(dtype)


def _coalesced(ranges: Sequence[tuple[int, int]], out: Sequence[torch.Tensor]
               ) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
    """The ranges with their destinations, those that follow each other both in the file and in one
    storage's memory merged into one (read whole, no chunk of them goes through a buffer)."""
    merged_ranges: list[tuple[int, int]] = []
    merged_out: list[torch.Tensor] = []
    for i in sorted(range(len(ranges)), key=lambda i: ranges[i][0]):
        (offset, length), dest = ranges[i], out[i]
        if merged_ranges and length:
            last_offset, last_length = merged_ranges[-1]
            last = merged_out[-1]
            if (last_offset + last_length == offset and last.data_ptr() + last_length == dest.data_ptr()
                    and last.untyped_storage().data_ptr() == dest.untyped_storage().data_ptr()):
                merged_ranges[-1] = (last_offset, last_length + length)
                merged_out[-1] = torch.empty(0, dtype=torch.uint8).set_(
                    last.untyped_storage(), last.storage_offset(), (last_length + length,))
                continue
        merged_ranges.append((offset, length))
        merged_out.append(dest)
    return merged_ranges, merged_out


def aligned_empty(n: int, skew: int = 0) -> torch.Tensor:
    """An uninitialized uint8 tensor of ``n`` bytes whose data starts ``skew`` bytes past an ``ALIGN``
    boundary (modulo ``ALIGN``); one of at least two huge pages is backed by huge pages where the kernel
    has them (Note [Huge pages for direct I/O])."""
    huge = _C.huge_page_size()
    if huge and n >= 2 * huge:
        raw = torch.empty(n + huge + ALIGN, dtype=torch.uint8)
        start = (-raw.data_ptr()) % huge  # a huge page's start, advised before any page is touched
        _C.advise_huge_pages(raw[start:])
        return raw[start + skew % ALIGN : start + skew % ALIGN + n]
    raw = torch.empty(n + ALIGN, dtype=torch.uint8)
    skip = (skew - raw.data_ptr()) % ALIGN
    return raw[skip : skip + n]


def open_io(aio: Mapping[str, Any] | None = None) -> Any:
    """The C++ I/O engine with the DeepSpeed ``aio`` section's settings (block_size, queue_depth,
    thread_count, single_submit, overlap_events), or its defaults."""
    settings = dict(aio or {})
    return _C.AsyncIO(block_size=int(settings.get("block_size", 1 << 20)),
                      queue_depth=int(settings.get("queue_depth", 8)),
                      thread_count=int(settings.get("thread_count", 1)),
                      single_submit=bool(settings.get("single_submit", False)),
                      overlap_events=bool(settings.get("overlap_events", True)))
