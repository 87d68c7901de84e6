"""``deepspeed.runtime.zero``, which DeepSpeed also exposes as ``deepspeed.zero``: partition_parameters' names."""

from . import partition_parameters
from .partition_parameters import (GatheredParameters, Init, ZeroParamStatus, register_external_parameter,
                                   unregister_external_parameter)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "partition_parameters", "register_external_parameter",
           "unregister_external_parameter"]
