"""A checkpoint directory on disk, without an engine (Note [Checkpoint format] in checkpoint.py): tags and
``latest``, durable writes, the index, the files it names opened against their checksums, and where every
parameter's saved pieces are. Used by the save and load (checkpoint.py) and by the command line
(_checkpoint_cli.py)."""

from __future__ import annotations

import bisect
import json
import os
import warnings
import zlib
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

from . import _safetensors_io as stio
from ._user_frames import user_stacklevel

FORMAT = "zerocore-checkpoint/2"
# Four reads in flight (the I/O engine runs one per thread): the disk stays busy while chunks are checked.
CHECKPOINT_IO = {"block_size": 8 << 20, "queue_depth": 8, "thread_count": 4}


# ---- the directory: index, tags, files --------------------------------------------------------------------
def open_file(io: Any, path: str, entry: Mapping[str, Any]) -> stio.VerifiedFile:
    name = entry.get("file")
    if not isinstance(name, str) or "/" in name or name.startswith("."):
        raise ValueError(f"{path}/index.json names an invalid file {name!r}: the index is damaged")
    if "checksums" not in entry:
        raise ValueError(f"{path}/index.json has no checksums for {name}: the index is damaged")
    return stio.VerifiedFile(io, os.path.join(path, name), entry["checksums"])


def read_index(path: str) -> dict[str, Any]:
    file = os.path.join(path, "index.json")
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{path} is a file, not a checkpoint directory")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} is missing: {path} is not a complete zerocore checkpoint")
    try:
        index = json.loads(read_bytes(file).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file} is not valid JSON ({error}): the checkpoint is damaged") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{file} is not a {FORMAT} index (format {index.get('format') if isinstance(index, dict) else None!r})")
    saved = index.pop(_INDEX_CHECKSUM, None)  # absent from indexes written before it was added
    if saved is not None and saved != _index_checksum(index):
        raise ValueError(f"{file} does not match its checksum ({_INDEX_CHECKSUM}): the index was damaged or edited")
    return index


_INDEX_CHECKSUM = "index_crc32"


def _index_checksum(index: Mapping[str, Any]) -> str:
    """CRC-32 of the index's canonical JSON (sorted keys): a flipped digit in a piece's offset or a counter
    would otherwise load wrong values silently, as the files' own checksums cannot see it."""
    return f"{zlib.crc32(json.dumps(index, sort_keys=True, separators=(',', ':')).encode()):08x}"


def index_identity(index: Mapping[str, Any]) -> str:
    """What tells two checkpoints apart (the CRC-32 of the index, which names every file's checksums): ranks
    about to load must hold the same, whatever the directory is called on each (node-local copies)."""
    return _index_checksum(index)


def index_bytes(index: Mapping[str, Any]) -> bytes:
    """``index`` as the text of index.json, its checksum included."""
    return json.dumps({**index, _INDEX_CHECKSUM: _index_checksum(index)}, indent=1).encode()


def resolve_tag(directory: str, tag: str | None, pointer: str = "latest") -> str:
    """``tag``, or the one ``directory/<pointer>`` names (``latest``; DeepSpeed's ``latest_universal``); checked
    to be a plain directory name."""
    source = "checkpoint tag"
    if tag is None:
        latest = os.path.join(directory, pointer)
        if not os.path.exists(latest):
            raise FileNotFoundError(f"{latest} does not exist (no checkpoint was completed in {directory}); pass "
                                    "tag= to load a specific one")
        try:
            tag = read_bytes(latest).decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ValueError(f"{latest} is not text (not UTF-8): it should hold a checkpoint tag; pass tag= to load "
                             "a specific one") from None
        source = f"the tag in {latest}"
    check_tag(tag, source)
    return tag


def tag_path(directory: str, tag: str) -> str:
    """Where the checkpoint ``tag`` is: ``directory/tag``, or, when a re-save of that tag was killed between
    its two renames (the old copy moved aside to ``.tag.old``, the new one not yet in place), that previous
    copy, which is complete: a process killed at any moment of a save leaves the previous checkpoint loadable."""
    path = os.path.join(directory, tag)
    previous = os.path.join(directory, f".{tag}.old")
    if not os.path.lexists(path) and os.path.isfile(os.path.join(previous, "index.json")):
        warnings.warn(f"checkpoint {path} is missing but its previous copy {previous} is complete (a save of "
                      f"tag {tag!r} was interrupted): loading that copy", RuntimeWarning, stacklevel=user_stacklevel())
        return previous
    return path


def check_tag(tag: str, source: str = "checkpoint tag") -> None:
    if not isinstance(tag, str) or not tag or tag in (".", "..") or "/" in tag or os.sep in tag or tag.startswith("."):
        raise ValueError(f"{source} {tag!r} must be a plain directory name (no '/', not starting with '.')")
    if tag in ("latest", "latest.tmp"):  # the pointer file and its temporary: a directory there would replace it
        raise ValueError(f"{source} {tag!r} is the name of the file that names the newest checkpoint; choose "
                         "another tag")


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, data: bytes) -> None:
    write_file_durably(path, lambda f: f.write(data))


def write_file_durably(path: str, write: Callable[[BinaryIO], object]) -> None:
    """``write(f)`` fills a temporary file, which is fsynced and renamed to ``path``: a reader sees the old file
    or the whole new one, also after a crash."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


# ---- saved pieces -----------------------------------------------------------------------------------------
def piece_sources(index: Mapping[str, Any]) -> dict[str, list[tuple[int, int, int, int, int]]]:
    """Per parameter name, the saved pieces ``(tensor_offset, length, rank, shard, shard_offset)`` by offset."""
    sources: dict[str, list[tuple[int, int, int, int, int]]] = {}
    for rank, entry in enumerate(index["ranks"]):
        for shard, saved in enumerate(entry["shards"]):
            for name, tensor_offset, shard_offset, length in saved["pieces"]:
                sources.setdefault(name, []).append((tensor_offset, length, rank, shard, shard_offset))
    for pieces in sources.values():
        pieces.sort()
    return sources


def covering(sources: dict[str, list[tuple[int, int, int, int, int]]], name: str, start: int, length: int):
    """The saved pieces overlapping elements ``[start, start + length)`` of ``name``, with the overlap."""
    pieces = sources[name]
    i = max(bisect.bisect_right(pieces, (start, float("inf"))) - 1, 0)
    end = start + length
    covered = start
    for tensor_offset, plen, rank, shard, shard_offset in pieces[i:]:
        if tensor_offset >= end:
            break
        lo, hi = max(start, tensor_offset), min(end, tensor_offset + plen)
        if lo >= hi:
            continue
        if lo != covered:
            raise ValueError(f"checkpoint does not hold elements [{covered}, {lo}) of parameter {name!r}")
        yield lo, hi, rank, shard, shard_offset + (lo - tensor_offset)
        covered = hi
    if covered != end:
        raise ValueError(f"checkpoint does not hold elements [{covered}, {end}) of parameter {name!r}")
