"""``deepspeed.runtime`` for scripts switched to zerocore: ``runtime.lr_schedules``."""

from . import lr_schedules

__all__ = ["lr_schedules"]
