"""``deepspeed.runtime.zero``, which DeepSpeed also exposes as ``deepspeed.zero``: partition_parameters' names,
``unwrap_model_for_generation``, and the memory estimators in ``stage3`` and ``stage_1_and_2``."""

from . import partition_parameters, stage3, stage_1_and_2
from .partition_parameters import (GatheredParameters, Init, ZeroParamStatus, register_external_parameter,
                                   unregister_external_parameter)
from .stage3 import unwrap_model_for_generation

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "partition_parameters", "register_external_parameter",
           "stage3", "stage_1_and_2", "unregister_external_parameter", "unwrap_model_for_generation"]
