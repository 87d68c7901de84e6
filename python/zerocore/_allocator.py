"""The CUDA caching allocator's health between steps: ``memory_report()["allocator"]``, and one warning when
it starts flushing its cache.

Note [Allocator pressure]
-------------------------
When torch's caching allocator finds no free block for a request, it frees every cached block (``cudaFree``,
which synchronizes the device) and retries; ``num_alloc_retries`` counts these. A training step that does this
is nearly out of memory and slow in a way no timer points at (the FSDP paper measured a backward slowed by it
on 128 GPUs), and DeepSpeed reports it as "N pytorch allocator cache flushes since last step" on every step,
which users do not know how to read (USER_PAINS #8). Here the counter is read after every applied or skipped
update (a host call into the allocator, no device sync), kept with the reserved, allocated and inactive-split
bytes for ``memory_report()["allocator"]``, and the first step that added retries warns once, saying what it
costs and what to change. Not on the CPU, whose allocator has no such cache (the section is then None).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ._user_frames import user_stacklevel

_STATS = ("num_alloc_retries", "num_ooms", "reserved_bytes.all.current", "allocated_bytes.all.current",
          "allocated_bytes.all.peak", "inactive_split_bytes.all.current")


class AllocatorWatch:
    """Reads the CUDA allocator's counters of ``device`` after each step (Note [Allocator pressure])."""

    def __init__(self, device: torch.device,
                 stats: Callable[[torch.device], dict[str, Any]] | None = None) -> None:
        self.device = device
        self._stats = stats or torch.cuda.memory_stats
        self.active = device.type == "cuda"
        self._retries_seen = self._read()["num_alloc_retries"] if self.active else 0
        self.retries_in_steps = 0  # flushes during steps of this engine
        self.steps_with_retries = 0
        self._warned = False

    def _read(self) -> dict[str, int]:
        stats = self._stats(self.device)
        return {key: int(stats.get(key, 0)) for key in _STATS}

    def after_step(self, step: int) -> None:
        if not self.active:
            return
        now = self._read()
        new, self._retries_seen = now["num_alloc_retries"] - self._retries_seen, now["num_alloc_retries"]
        if new <= 0:
            return
        self.retries_in_steps += new
        self.steps_with_retries += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"step {step}: the CUDA caching allocator ran out of free blocks and flushed its cache to retry "
                f"{new} time(s) (each flush waits for the device; {_gib(now['reserved_bytes.all.current'])} GiB "
                f"reserved, {_gib(now['allocated_bytes.all.current'])} GiB allocated, "
                f"{_gib(now['inactive_split_bytes.all.current'])} GiB in fragments). Memory is nearly full: set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or lower the micro-batch, reduce_bucket_size or "
                "stage3_prefetch_bucket_size, or shard more (a higher stage, offload). "
                "engine.memory_report()['allocator'] counts them; this warning is given once.",
                RuntimeWarning, stacklevel=user_stacklevel())

    def report(self) -> dict[str, Any] | None:
        if not self.active:
            return None
        now = self._read()
        reserved = now["reserved_bytes.all.current"]
        return {
            "num_alloc_retries": now["num_alloc_retries"],  # since the process started, as torch counts
            "retries_in_steps": self.retries_in_steps,
            "steps_with_retries": self.steps_with_retries,
            "num_ooms": now["num_ooms"],
            "reserved_bytes": reserved,
            "allocated_bytes": now["allocated_bytes.all.current"],
            "peak_allocated_bytes": now["allocated_bytes.all.peak"],
            "inactive_split_bytes": now["inactive_split_bytes.all.current"],
            # reserved but not allocated: cached blocks, free for reuse only by requests that fit them
            "cached_free_fraction": 1.0 - now["allocated_bytes.all.current"] / reserved if reserved else 0.0,
        }


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f}"
