"""Page-cache control without root, for benchmarks that must read from the disk, not from memory.

``evict_tree(path)`` fsyncs every file under ``path`` (so no page is left dirty) and asks the kernel to drop
its cached pages with ``posix_fadvise(POSIX_FADV_DONTNEED)``; a clean page of a file nobody has mapped is
dropped at once. ``resident_fraction(path)`` says, with ``mincore``, which fraction of the pages of the files
under ``path`` is still in the page cache (so a benchmark can show that its eviction worked).
``fsync_tree(path, keep)`` fsyncs the files under ``path`` for which ``keep(name)`` is true.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Callable


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(root, f) for root, _, files in os.walk(path) for f in files)


def fsync_tree(path: str, keep: Callable[[str], bool] = lambda name: True) -> None:
    for name in files_under(path):
        if keep(os.path.basename(name)):
            fd = os.open(name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def evict_tree(path: str) -> None:
    """Drops every file under ``path`` from the page cache (fsync first: dirty pages cannot be dropped)."""
    for name in files_under(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = None


def _load_libc():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        _libc = libc
    return _libc


def resident_fraction(path: str) -> float:
    """Fraction of the pages of the files under ``path`` that are in the page cache (mincore of a read-only
    shared mapping, which maps the cached pages without faulting any in); nan when it cannot be measured."""
    try:
        libc = _load_libc()
    except OSError:
        return float("nan")
    page = mmap.PAGESIZE
    resident = total = 0
    for name in files_under(path):
        size = os.path.getsize(name)
        if size == 0:
            continue
        pages = (size + page - 1) // page
        fd = os.open(name, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return float("nan")
            try:
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    return float("nan")
                resident += sum(b & 1 for b in vec)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        total += pages
    return resident / total if total else 0.0
