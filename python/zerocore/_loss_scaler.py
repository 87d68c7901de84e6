"""fp16 loss scaling with DeepSpeed's semantics, so a DeepSpeed ``fp16`` config behaves the same here."""

from __future__ import annotations

from .config import FP16Config


class LossScaler:
    """Static (``loss_scale > 0``) or dynamic loss scale.

    Dynamic, DeepSpeed's rule (``DynamicLossScaler.update_scale`` as of mid-2025): starts at
    ``2**initial_scale_power``; an overflow halves the scale (not below ``min_loss_scale``) once ``hysteresis``
    overflows have been absorbed, and raises when the scale is already at its minimum (DeepSpeed's
    ``raise_error_at_min_scale``: an fp16 run overflowing every step would otherwise skip every update
    forever); ``loss_scale_window`` stable steps after the last overflow (``iteration - last_overflow - 1``,
    so one step later than before that release) double it and restore the hysteresis. With
    ``consecutive_hysteresis`` every overflow-free step restores the hysteresis.
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
        self.consecutive_hysteresis = config.consecutive_hysteresis
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
                if self.hysteresis == 1 or self._hysteresis_left == 1:
                    if self.scale == self.min_scale:
                        raise RuntimeError(
                            f"fp16 gradients overflowed at the minimum loss scale ({self.min_scale:g}), "
                            f"{self.overflows} overflows so far: every update would be skipped from here on. Lower "
                            "the learning rate, clip gradients (gradient_clipping), train in bf16, or lower "
                            "fp16.min_loss_scale")
                    self.scale = max(self.scale / 2.0, self.min_scale)
                else:
                    self._hysteresis_left -= 1
                self._last_overflow = self._iteration
            else:
                if self.consecutive_hysteresis:
                    self._hysteresis_left = self.hysteresis
                stable = self._iteration - self._last_overflow - 1
                if stable > 0 and stable % self.window == 0:
                    if not self.consecutive_hysteresis:
                        self._hysteresis_left = self.hysteresis
                    self.scale *= 2.0
        self._iteration += 1

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left, "iteration": self._iteration,
                "last_overflow": self._last_overflow, "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._iteration = int(state["iteration"])
        self._last_overflow = int(state["last_overflow"])
        self.overflows = int(state["overflows"])
