"""``deepspeed.runtime.lr_schedules`` for scripts switched to zerocore: DeepSpeed's schedules (zerocore.lr_schedules,
the same classes the config's ``scheduler`` section builds). One built on the optimizer passed to
``deepspeed.initialize`` moves the engine's lr once passed as its ``lr_scheduler`` (Note [DeepSpeed's
initialize])."""

from ...lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
