"""fp16 loss scaling with DeepSpeed's semantics, so a DeepSpeed ``fp16`` config behaves the same here."""

from __future__ import annotations

from .config import FP16Config


class LossScaler:
    """Static (``loss_scale > 0``) or dynamic loss scale.

    Dynamic: starts at ``2**initial_scale_power``; an overflow lowers the scale by 2 (not below
    ``min_loss_scale``) once ``hysteresis`` overflows have been seen since the last raise, as in DeepSpeed;
    ``loss_scale_window`` steps without an overflow double it.
    """

    def __init__(self, config: FP16Config) -> None:
        self.dynamic = config.enabled and config.loss_scale == 0
        if not config.enabled:
            self.scale = 1.0
        elif self.dynamic:
            self.scale = float(2 ** config.initial_scale_power)
        else:
            self.scale = float(config.loss_scale)
        self.min_scale = float(config.min_loss_scale)
        self.window = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self._hysteresis_left = config.hysteresis
        self._iteration = 0
        self._last_overflow = -1
        self.overflows = 0

    def update(self, overflow: bool) -> None:
        """Records one boundary step's verdict (agreed by all ranks) and adjusts the scale."""
        if overflow:
            self.overflows += 1
        if self.dynamic:
            if overflow:
                if self._hysteresis_left <= 1:
                    self.scale = max(self.scale / 2.0, self.min_scale)
                else:
                    self._hysteresis_left -= 1
                self._last_overflow = self._iteration
            elif (self._iteration - self._last_overflow) % self.window == 0:
                self._hysteresis_left = self.hysteresis
                self.scale *= 2.0
        self._iteration += 1

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left, "iteration": self._iteration,
                "last_overflow": self._last_overflow, "overflows": self.overflows}
