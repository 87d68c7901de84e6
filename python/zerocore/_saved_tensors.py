"""A zerocore checkpoint's tensors read whole without an engine or a process group (the exports of
``python -m zerocore.checkpoint``): a trainable parameter's fp32 master or Adam moment assembled from the ranks'
pieces, reading only the blocks that hold them (each checked against its checksum), or a tensor of the model
file (buffers, frozen parameters)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import _safetensors_io as stio
from ._checkpoint_format import CHECKPOINT_IO, covering, open_file, piece_sources


class SavedTensors:
    """Every file the index names is opened (and checked) here, before a caller writes anything."""

    def __init__(self, path: str, index: Mapping[str, Any]) -> None:
        self.index = index
        self._sources = piece_sources(index)
        io = stio.open_io(CHECKPOINT_IO)
        self._files: list[stio.VerifiedFile] = []
        try:
            self._files += [open_file(io, path, entry) for entry in index["ranks"]]
            self._model = open_file(io, path, index["model_file"])
        except BaseException:
            self.close()
            raise

    def trainable(self, name: str, state: str = "master") -> torch.Tensor:
        """A trainable parameter's ``state`` (``master``, ``exp_avg`` or ``exp_avg_sq``), whole, in fp32."""
        shape = self.index["params"][name]
        flat = torch.empty(stio.numel(shape), dtype=torch.float32)
        by_rank: dict[int, list[tuple[int, int, int, int]]] = {}
        for lo, hi, rank, shard, offset in covering(self._sources, name, 0, flat.numel()):
            by_rank.setdefault(rank, []).append((lo, hi, shard, offset))
        for rank, pieces in by_rank.items():
            ranges = []
            for lo, hi, shard, offset in pieces:
                start, _, _ = self._files[rank].tensor_range(f"{shard}.{state}")
                ranges.append((start + 4 * offset, 4 * (hi - lo)))
            for (lo, hi, _, _), data in zip(pieces, self._files[rank].read(ranges)):
                flat[lo:hi] = data.view(torch.float32)
        return flat.view(shape)

    def untracked(self, name: str) -> torch.Tensor:
        """A buffer or frozen parameter of the model file, as saved."""
        return self._model.tensor(name)

    def close(self) -> None:
        for file in self._files + ([self._model] if hasattr(self, "_model") else []):
            file.close()

    def __enter__(self) -> SavedTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
