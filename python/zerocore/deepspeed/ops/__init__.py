"""``deepspeed.ops`` for scripts switched to zerocore: ``ops.adam`` (DeepSpeed's ``FusedAdam`` and
``DeepSpeedCPUAdam``)."""

from . import adam

__all__ = ["adam"]
