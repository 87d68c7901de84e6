"""zerocore: a ZeRO (Zero Redundancy Optimizer) engine for PyTorch with a C++/CUDA core."""

from ._native import _C  # noqa: F401  (checks the torch version before anything native loads)
from ._info import build_info
from .layout import Bucket, FlatLayout, Piece
from . import ops
from . import optim
from . import lr_schedules
from .config import FP16Config, OptimizerConfig, SchedulerConfig, ZeroConfig, ZeroOptimizationConfig
from .engine import Engine, initialize
from ._gathered import gathered
from ._full_param_state import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state,
                                safe_update_full_grad_vectorized)
from ._local_param_state import (local_range, safe_get_local_fp32_param, safe_get_local_grad,
                                 safe_get_local_optimizer_state, safe_set_local_fp32_param, safe_set_local_grad,
                                 safe_set_local_optimizer_state)

__version__ = build_info()["version"]

__all__ = [
    "build_info", "FlatLayout", "Bucket", "Piece", "ops", "optim", "ZeroConfig", "OptimizerConfig", "FP16Config",
    "ZeroOptimizationConfig", "SchedulerConfig", "lr_schedules", "Engine", "initialize", "gathered", "estimate_memory",
    "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
    "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_set_full_grad", "safe_get_local_fp32_param",
    "safe_set_local_fp32_param", "safe_get_local_optimizer_state", "safe_set_local_optimizer_state",
    "safe_get_local_grad", "safe_set_local_grad", "local_range", "safe_update_full_grad_vectorized", "__version__",
]


def __getattr__(name: str) -> object:
    # zerocore.estimate_memory, imported on first use: importing zerocore.estimate here would make
    # `python -m zerocore.estimate` run a module already imported (runpy's RuntimeWarning).
    if name == "estimate_memory":
        from .estimate import estimate_memory

        return estimate_memory
    raise AttributeError(f"module 'zerocore' has no attribute {name!r}")
