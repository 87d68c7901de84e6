"""``deepspeed.runtime.zero``, which DeepSpeed also exposes as ``deepspeed.zero``: partition_parameters' names and
``unwrap_model_for_generation``."""

from . import partition_parameters, stage3
from .partition_parameters import (GatheredParameters, Init, ZeroParamStatus, register_external_parameter,
                                   unregister_external_parameter)
from .stage3 import unwrap_model_for_generation

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "partition_parameters", "register_external_parameter",
           "stage3", "unregister_external_parameter", "unwrap_model_for_generation"]
