"""``deepspeed.accelerator`` for scripts switched to zerocore: ``get_accelerator()``, DeepSpeed's device-neutral
interface (``get_accelerator().device_name(local_rank)`` where a script would write ``"cuda"``), for the device
zerocore trains on.

The device is CUDA where torch sees a GPU, else the CPU; ``DS_ACCELERATOR=cpu|cuda`` chooses, as with DeepSpeed
(``cuda`` without a GPU is refused by name). The methods are DeepSpeed's common runtime ones: device names and
counts, synchronization, random state, memory statistics, streams and events, dtype support and the collective
backend's name. On the CPU, as with DeepSpeed's CPU accelerator, memory figures are the process's resident set
(``memory_allocated``) and its peak (``max_memory_allocated``, which the kernel keeps and nothing can reset),
streams and events are ``None`` and synchronizing does nothing; ``device_count`` is torchrun's
``LOCAL_WORLD_SIZE`` (the ranks sharing this host), else 1.
"""

from __future__ import annotations

import contextlib
import os
import resource
from typing import Any

import torch

__all__ = ["Accelerator", "get_accelerator"]

_ACCELERATOR: Accelerator | None = None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {key}")


class Accelerator:
    """One device kind, ``"cpu"`` or ``"cuda"`` (:func:`get_accelerator` picks it)."""

    def __init__(self, name: str) -> None:
        if name not in ("cpu", "cuda"):
            raise ValueError(f"zerocore trains on 'cpu' or 'cuda', not {name!r}")
        self._name = name
        self._communication_backend_name = "nccl" if name == "cuda" else "gloo"
        self._cuda = name == "cuda"

    # -- devices ---------------------------------------------------------------------------------------------------

    def device_name(self, device_index: int | None = None) -> str:
        if not self._cuda or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    # -- random state ----------------------------------------------------------------------------------------------

    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    # -- memory ----------------------------------------------------------------------------------------------------

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else _rss_bytes()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        # (Linux reports KiB, and updates the peak lazily: the resident set can be ahead of it)
        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, _rss_bytes())

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else _rss_bytes()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else self.max_memory_allocated()

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": _rss_bytes(), "allocated_bytes.all.peak": self.max_memory_allocated()}

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return _meminfo_bytes("MemTotal")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return _meminfo_bytes("MemAvailable")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        del align_bytes
        return tensor.pin_memory() if self._cuda else tensor

    # -- streams and events ----------------------------------------------------------------------------------------

    @property
    def Stream(self) -> Any:  # noqa: N802 (DeepSpeed's name: get_accelerator().Stream(...))
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self) -> Any:  # noqa: N802
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    # -- dtypes ----------------------------------------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True  # zerocore trains fp16 with a loss scale on both (DeepSpeed's CPU accelerator says so too)

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def __repr__(self) -> str:
        return f"zerocore.deepspeed.accelerator.Accelerator({self._name!r})"


def get_accelerator() -> Accelerator:
    """The accelerator of this process (the module's docstring): one object for the process, as DeepSpeed's."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        chosen = os.environ.get("DS_ACCELERATOR")
        if chosen is None:
            chosen = "cuda" if torch.cuda.is_available() else "cpu"
        if chosen not in ("cpu", "cuda"):
            raise ValueError(f"DS_ACCELERATOR={chosen!r}: zerocore trains on 'cpu' or 'cuda'")
        if chosen == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("DS_ACCELERATOR=cuda, but torch sees no CUDA device")
        _ACCELERATOR = Accelerator(chosen)
    return _ACCELERATOR
