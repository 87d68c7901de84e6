"""zerocore.build_info(): what was compiled and what this machine will run."""

from __future__ import annotations

import os
from typing import Any

import torch

from ._native import _C, _build_config


def cpu_cores() -> int:
    """The cores this process may run on (its affinity), the count the CPU kernels' thread rule uses (Note
    [Kernel threads under torchrun])."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def build_info() -> dict[str, Any]:
    """Returns the build and run-time facts of this zerocore installation.

    Returns:
        A JSON-serialisable dict: ``version``, ``torch_version_built`` (the torch it was compiled against),
        ``torch_version_running``, ``compiler``, ``simd_compiled`` (CPU kernel paths in this build),
        ``simd_best`` (the widest one this CPU supports), ``simd_active`` (the one kernels use now),
        ``cuda_compiled``, ``cuda_archs``, ``cuda_compiler``, ``cuda_available`` and ``cpu_threads``.
    """
    native = _C.native_build_info()
    return {
        "version": _build_config.VERSION,
        "torch_version_built": _build_config.TORCH_VERSION,
        "torch_version_running": torch.__version__,
        "compiler": native["compiler"],
        "simd_compiled": list(native["simd_compiled"]),
        "simd_best": native["simd_best"],
        "simd_active": native["simd_active"],
        "cuda_compiled": bool(native["cuda_compiled"]),
        "cuda_archs": [str(arch) for arch in _build_config.CUDA_ARCHS] if native["cuda_compiled"] else [],
        "cuda_compiler": _build_config.CUDA_COMPILER.strip() or None,
        "cuda_available": torch.cuda.is_available(),
        "cpu_threads": _C.get_num_threads(),
    }
