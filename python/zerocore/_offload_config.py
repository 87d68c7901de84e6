"""Offload settings: where optimizer state and parameters are offloaded (DeepSpeed
``zero_optimization.offload_optimizer`` / ``offload_param``, also set by the deprecated ``cpu_offload*`` flags)
and the asynchronous file I/O engine that NVMe offload and checkpoint reads use (DeepSpeed ``aio``)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from ._config_values import INT32_MAX, INT64_MAX, as_bool, as_float, as_int, fail, no_auto

_AIO_ALIGN = 4096  # aio.block_size must be a multiple of this (O_DIRECT-aligned I/O)


def _offload_device(value: Any, path: str) -> str:
    no_auto(value, path)
    if not isinstance(value, str) or value.lower() not in ("none", "cpu", "nvme"):
        fail(path, f"expected 'none', 'cpu' or 'nvme' (case-insensitive), got {value!r}")
    return value.lower()


def _nvme_path(value: Any, device: str, path: str) -> str | None:
    if value is None:
        if device == "nvme":
            fail(path, "required when device is 'nvme': the directory (on the NVMe drive) to swap to")
        return None
    no_auto(value, path)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        fail(path, f"expected a directory path (a non-empty string) or null, got {value!r}")
    return value


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """Optimizer-state offload (DeepSpeed ``zero_optimization.offload_optimizer``); any ZeRO stage.
    Defaults are DeepSpeed 0.19.8's.

    Attributes:
        device: ``"none"`` (no offload), ``"cpu"`` or ``"nvme"``; case-insensitive on input, stored lower case.
        nvme_path: the directory to swap optimizer state to; required when ``device`` is ``"nvme"``.
        pin_memory: keep the offloaded state in page-locked CPU memory (DeepSpeed's default: true).
        buffer_count: buffers in the NVMe swap pool (>= 1).
        fast_init: DeepSpeed's fast optimizer initialization when offloading to NVMe.
        ratio: the fraction of the optimizer state offloaded; only 1.0 is accepted (DeepSpeed's partial
            offload, ZeRO-3 only, is not supported).

    Raises:
        ValueError: naming the key path (``zero_optimization.offload_optimizer.nvme_path``) of the first invalid
            value.
    """

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    buffer_count: int = 4
    fast_init: bool = False
    ratio: float = 1.0

    def __post_init__(self) -> None:
        set_, p = object.__setattr__, "zero_optimization.offload_optimizer."
        set_(self, "device", _offload_device(self.device, p + "device"))
        set_(self, "nvme_path", _nvme_path(self.nvme_path, self.device, p + "nvme_path"))
        set_(self, "pin_memory", as_bool(self.pin_memory, p + "pin_memory"))
        set_(self, "buffer_count", as_int(self.buffer_count, p + "buffer_count", 1, INT64_MAX))
        set_(self, "fast_init", as_bool(self.fast_init, p + "fast_init"))
        ratio = as_float(self.ratio, p + "ratio", 0.0)
        if ratio != 1.0:
            fail(p + "ratio", f"zerocore supports only ratio 1.0 (the whole optimizer state offloaded), got "
                 f"{self.ratio!r}; DeepSpeed's partial offload (ZeRO-3 only) is not supported")
        set_(self, "ratio", ratio)


@dataclass(frozen=True)
class OffloadParamConfig:
    """Parameter offload (DeepSpeed ``zero_optimization.offload_param``); stage 3 only. Defaults are
    DeepSpeed 0.19.8's.

    Attributes:
        device: ``"none"`` (no offload), ``"cpu"`` or ``"nvme"``; case-insensitive on input, stored lower case.
            Anything but ``"none"`` needs ``zero_optimization.stage`` 3.
        nvme_path: the directory to swap parameters to; required when ``device`` is ``"nvme"``.
        pin_memory: keep offloaded parameters in page-locked CPU memory (DeepSpeed's default: true).
        buffer_count: buffers in the NVMe swap pool (>= 1).
        buffer_size: elements per NVMe swap buffer (>= 1).
        max_in_cpu: parameter elements kept in CPU memory when offloading to NVMe (>= 0).

    Raises:
        ValueError: naming the key path (``zero_optimization.offload_param.buffer_size``) of the first invalid
            value.
    """

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000

    def __post_init__(self) -> None:
        set_, p = object.__setattr__, "zero_optimization.offload_param."
        set_(self, "device", _offload_device(self.device, p + "device"))
        set_(self, "nvme_path", _nvme_path(self.nvme_path, self.device, p + "nvme_path"))
        set_(self, "pin_memory", as_bool(self.pin_memory, p + "pin_memory"))
        set_(self, "buffer_count", as_int(self.buffer_count, p + "buffer_count", 1, INT64_MAX))
        set_(self, "buffer_size", as_int(self.buffer_size, p + "buffer_size", 1, INT64_MAX))
        set_(self, "max_in_cpu", as_int(self.max_in_cpu, p + "max_in_cpu", 0, INT64_MAX))


@dataclass(frozen=True)
class AioConfig:
    """The asynchronous file I/O engine used for NVMe offload and checkpoint reads (DeepSpeed's top-level
    ``aio``). Defaults are DeepSpeed 0.19.8's.

    Attributes:
        block_size: bytes per I/O request, a positive multiple of 4096.
        queue_depth: I/O requests in flight at once (>= 1).
        thread_count: I/O worker threads (>= 1); DeepSpeed 0.19.8 calls it ``intra_op_parallelism``, older
            versions ``thread_count``: both are read (not both at once), ``intra_op_parallelism`` is written.
        single_submit: submit requests one at a time rather than in batches.
        overlap_events: start the next request as soon as one completes, rather than in waves.

    DeepSpeed's ``use_gds`` (GPUDirect Storage) is accepted only as false.

    Raises:
        ValueError: naming the key path (``aio.block_size``) of the first invalid value.
    """

    block_size: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        block_size = as_int(self.block_size, "aio.block_size", _AIO_ALIGN, INT64_MAX)
        if block_size % _AIO_ALIGN:
            fail("aio.block_size", f"expected a positive multiple of {_AIO_ALIGN} (bytes), got {self.block_size!r}")
        set_(self, "block_size", block_size)
        set_(self, "queue_depth", as_int(self.queue_depth, "aio.queue_depth", 1, INT32_MAX))
        set_(self, "thread_count", as_int(self.thread_count, "aio.intra_op_parallelism (thread_count)", 1, INT32_MAX))
        set_(self, "single_submit", as_bool(self.single_submit, "aio.single_submit"))
        set_(self, "overlap_events", as_bool(self.overlap_events, "aio.overlap_events"))

    def settings(self) -> dict[str, Any]:
        """The C++ I/O engine's settings, as ``_safetensors_io.open_io`` takes them."""
        return asdict(self)


# DeepSpeed's deprecated zero_optimization flags -> what each one sets (cpu_offload*: true is device "cpu").
LEGACY_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param",
                  "cpu_offload_use_pin_memory": "pin_memory"}


def offload_configs(zero: dict[str, Any], sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ``offload_optimizer`` / ``offload_param`` configs from their sections (the ones given, already
    key-checked) and DeepSpeed's deprecated ``cpu_offload*`` flags, which are popped from ``zero``.

    ``cpu_offload: true`` is ``offload_optimizer`` device ``"cpu"`` (false: ``"none"``), likewise
    ``cpu_offload_param`` for ``offload_param``; ``cpu_offload_use_pin_memory`` is ``pin_memory`` of both.
    A flag and a section that disagree are an error naming both."""
    z = "zero_optimization."
    legacy = {key: zero.pop(key) for key in LEGACY_OFFLOAD if key in zero}
    legacy = {key: as_bool(value, z + key) for key, value in legacy.items() if value is not None}
    sections = {name: dict(sections.get(name, {})) for name in ("offload_optimizer", "offload_param")}
    for key in ("cpu_offload", "cpu_offload_param"):
        if key not in legacy:
            continue
        name = LEGACY_OFFLOAD[key]
        device = "cpu" if legacy[key] else "none"
        if "device" in sections[name]:
            given = _offload_device(sections[name]["device"], f"{z}{name}.device")
            if given != device:
                fail(z + key, f"{str(legacy[key]).lower()} (deprecated; means {z}{name}.device {device!r}) "
                     f"disagrees with {z}{name}.device {given!r}; remove {z}{key}")
        sections[name]["device"] = device
    if "cpu_offload_use_pin_memory" in legacy:
        pin = legacy["cpu_offload_use_pin_memory"]
        for name, section in sections.items():
            if "pin_memory" in section and as_bool(section["pin_memory"], f"{z}{name}.pin_memory") != pin:
                fail(z + "cpu_offload_use_pin_memory", f"{str(pin).lower()} (deprecated) disagrees with "
                     f"{z}{name}.pin_memory {str(section['pin_memory']).lower()}; remove "
                     f"{z}cpu_offload_use_pin_memory")
            section["pin_memory"] = pin
    return {"offload_optimizer": OffloadOptimizerConfig(**sections["offload_optimizer"]),
            "offload_param": OffloadParamConfig(**sections["offload_param"])}
