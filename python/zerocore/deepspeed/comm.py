"""``deepspeed.comm`` for scripts switched to zerocore (``import zerocore.deepspeed.comm as dist``): torch.distributed's
functions under DeepSpeed's names, with DeepSpeed's profiling keywords (``prof``, ``log_name``, ``debug``,
``use_caller_func_name``) accepted and dropped, since zerocore's own collectives are counted by
``engine.comm_report()``. Also DeepSpeed's ``init_distributed``, ``get_local_rank`` (torchrun's ``LOCAL_RANK``),
``get_world_group`` and ``has_all_gather_into_tensor``/``has_reduce_scatter_tensor`` (both always true)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as _dist
from torch.distributed import ReduceOp

__all__ = [
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single", "barrier", "broadcast",
    "destroy_process_group", "gather", "get_backend", "get_global_rank", "get_local_rank", "get_rank",
    "get_world_group", "get_world_size", "has_all_gather_into_tensor", "has_reduce_scatter_tensor",
    "init_distributed", "irecv", "is_available", "is_initialized", "isend", "new_group", "recv", "reduce",
    "reduce_scatter_tensor", "scatter", "send",
]

_PROFILING = ("prof", "log_name", "debug", "use_caller_func_name")


def _without_profiling(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        for key in _PROFILING:
            kwargs.pop(key, None)
        return function(*args, **kwargs)

    return call


all_gather = _without_profiling(_dist.all_gather)
all_gather_into_tensor = _without_profiling(_dist.all_gather_into_tensor)
all_reduce = _without_profiling(_dist.all_reduce)
all_to_all_single = _without_profiling(_dist.all_to_all_single)
barrier = _without_profiling(_dist.barrier)
broadcast = _without_profiling(_dist.broadcast)
gather = _without_profiling(_dist.gather)
irecv = _without_profiling(_dist.irecv)
isend = _without_profiling(_dist.isend)
recv = _without_profiling(_dist.recv)
reduce = _without_profiling(_dist.reduce)
reduce_scatter_tensor = _without_profiling(_dist.reduce_scatter_tensor)
scatter = _without_profiling(_dist.scatter)
send = _without_profiling(_dist.send)

destroy_process_group = _dist.destroy_process_group
get_backend = _dist.get_backend
get_global_rank = _dist.get_global_rank
get_rank = _dist.get_rank
get_world_size = _dist.get_world_size
is_available = _dist.is_available
is_initialized = _dist.is_initialized
new_group = _dist.new_group


def init_distributed(*args: Any, **kwargs: Any) -> None:
    """DeepSpeed's ``deepspeed.comm.init_distributed`` (``zerocore.deepspeed.init_distributed``)."""
    from . import init_distributed as initialize_group

    initialize_group(*args, **kwargs)


def get_local_rank() -> int:
    """This process's rank on its host, from torchrun's ``LOCAL_RANK`` (0 when not set, as DeepSpeed reads it)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_world_group() -> Any:
    """The default process group (every rank)."""
    return _dist.group.WORLD


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True
