"""``deepspeed.checkpointing`` for scripts switched to zerocore: activation checkpointing through torch's own
(``torch.utils.checkpoint``, non-reentrant), which zerocore's stage-3 gathers work with (the recomputation
gathers a unit again as its forward did).

``configure`` takes DeepSpeed's arguments: ``mpu_`` (model parallelism) and the two that exist for it,
``partition_activations`` and ``checkpoint_in_cpu`` (activations partitioned over the model-parallel ranks, then
moved to the host), are refused by name, since zerocore shards data-parallel state only and would otherwise
train with the memory a script did not plan for; the others (contiguous buffers, their count, synchronizing,
profiling) only tune DeepSpeed's own implementation and are accepted. The config's ``activation_checkpointing``
section is read by ``zerocore.initialize`` under the same rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"]

_configured = False


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's (the module's docstring)."""
    global _configured
    del deepspeed_config, contiguous_checkpointing, num_checkpoints, synchronize, profile
    if mpu_ is not None:
        raise ValueError("deepspeed.checkpointing.configure: model parallelism (mpu_) is not supported by zerocore: it "
                         "shards data-parallel state only")
    for name, value in (("partition_activations", partition_activations), ("checkpoint_in_cpu", checkpoint_in_cpu)):
        if value:
            raise ValueError(f"deepspeed.checkpointing.configure: {name}=True partitions activations over "
                             "model-parallel ranks (then moves them to the host), which zerocore does not do; leave it "
                             "False (checkpointed activations are recomputed, not kept)")
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """DeepSpeed's: frees its contiguous buffers between steps; torch's checkpointing keeps none."""


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, its activations recomputed in the backward instead of kept (DeepSpeed's signature)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


non_reentrant_checkpoint = checkpoint
