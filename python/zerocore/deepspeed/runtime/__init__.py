"""``deepspeed.runtime`` for scripts switched to zerocore: ``runtime.lr_schedules`` and ``runtime.zero``."""

from . import lr_schedules, zero

__all__ = ["lr_schedules", "zero"]
