"""``deepspeed.checkpointing`` for scripts switched to zerocore: activation checkpointing through torch's own
(``torch.utils.checkpoint``, non-reentrant), which zerocore's stage-3 gathers work with (the recomputation
gathers a unit again as its forward did).

``configure`` takes DeepSpeed's arguments, and reads the ``activation_checkpointing`` section of
``deepspeed_config`` (a dict or a JSON path) as DeepSpeed does, the arguments given overriding it. ``mpu_`` (model
parallelism) is refused by name, since zerocore shards data-parallel state only, and so is ``checkpoint_in_cpu``
(the section's ``cpu_checkpointing``: checkpointed activations moved to the host), which zerocore does not do and a
script would have planned its device memory around. ``partition_activations`` splits activations over the
model-parallel ranks, of which there is one here, so it changes nothing (as in DeepSpeed without an ``mpu_``), and
the others (contiguous buffers, their count, synchronizing, profiling) only tune DeepSpeed's own implementation:
these are accepted. ``zerocore.initialize`` accepts the section whatever it says: DeepSpeed's engine never reads
it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
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
    del partition_activations, contiguous_checkpointing, num_checkpoints, synchronize, profile
    if mpu_ is not None:
        raise ValueError("deepspeed.checkpointing.configure: model parallelism (mpu_) is not supported by zerocore: it "
                         "shards data-parallel state only")
    if checkpoint_in_cpu is None and deepspeed_config is not None:
        checkpoint_in_cpu = _section(deepspeed_config).get("cpu_checkpointing", False)
    if checkpoint_in_cpu:
        raise ValueError("deepspeed.checkpointing.configure: checkpoint_in_cpu (the config's activation_checkpointing."
                         "cpu_checkpointing) moves checkpointed activations to the host, which zerocore does not do; "
                         "leave it false (checkpointed activations are recomputed, not kept)")
    _configured = True


def _section(deepspeed_config: Any) -> Mapping[str, Any]:
    """The ``activation_checkpointing`` section of a DeepSpeed config given as a dict or a JSON path."""
    from .._deepspeed_json import load_json

    config = deepspeed_config if isinstance(deepspeed_config, Mapping) else load_json(deepspeed_config)
    section = config.get("activation_checkpointing") or {}
    if not isinstance(section, Mapping):
        raise ValueError(f"activation_checkpointing: expected a JSON object (a mapping), got {section!r}")
    return section


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """DeepSpeed's: frees its contiguous buffers between steps; torch's checkpointing keeps none."""


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, its activations recomputed in the backward instead of kept (DeepSpeed's
    signature: the keyword arguments go to ``function``, a Hugging Face layer's ``attention_mask=`` and the
    like, never to torch's checkpoint options)."""
    run = functools.partial(function, **kwargs) if kwargs else function
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)


non_reentrant_checkpoint = checkpoint
