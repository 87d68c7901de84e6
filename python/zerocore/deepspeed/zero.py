"""``deepspeed.zero`` for scripts switched to zerocore: the names of ``runtime.zero`` (DeepSpeed's ``deepspeed.zero``
is its ``deepspeed.runtime.zero``), also importable as a module here (``from zerocore.deepspeed.zero import
GatheredParameters``, as earlier zerocore versions had it)."""

from .runtime.zero import (GatheredParameters, Init, ZeroParamStatus, partition_parameters,
                           register_external_parameter, stage3, unregister_external_parameter,
                           unwrap_model_for_generation)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "partition_parameters", "register_external_parameter",
           "stage3", "unregister_external_parameter", "unwrap_model_for_generation"]
