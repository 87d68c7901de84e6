"""The fp16 dynamic loss scale follows DeepSpeed's current rule (issue 9, items 17 and 23), checked against a
transcription of ``DynamicLossScaler.update_scale`` (deepspeed/runtime/fp16/loss_scaler.py, mid-2025) on
random overflow sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerocore._loss_scaler import LossScaler
from zerocore.config import FP16Config


class DeepSpeedRule:
    """The oracle: DeepSpeed's update_scale, statement by statement (raise_error_at_min_scale=True)."""

    def __init__(self, init_scale: float, window: int, min_scale: float, delayed_shift: int, consecutive: bool):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_window, self.min_scale = window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise RuntimeError("at minimum")
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1


@settings(max_examples=300, deadline=None)
@given(overflows=st.lists(st.booleans(), max_size=60), power=st.integers(0, 8), window=st.integers(1, 5),
       min_power=st.integers(0, 3), hysteresis=st.integers(1, 3), consecutive=st.booleans())
def test_the_scale_follows_deepspeeds_rule(overflows, power, window, min_power, hysteresis, consecutive):
    config = FP16Config(enabled=True, initial_scale_power=power, loss_scale_window=window,
                        min_loss_scale=float(2**min_power), hysteresis=hysteresis, consecutive_hysteresis=consecutive)
    ours = LossScaler(config)
    theirs = DeepSpeedRule(float(2**power), window, float(2**min_power), hysteresis, consecutive)
    for overflow in overflows:
        try:
            theirs.update_scale(overflow)
        except RuntimeError:
            with pytest.raises(RuntimeError, match="minimum loss scale"):
                ours.update(overflow)
            return
        ours.update(overflow)
        assert ours.scale == theirs.cur_scale


def test_growth_waits_one_step_longer_after_an_overflow():
    """Window 2: an overflow at step 0; the scale doubles at step 3 (two stable steps after the step that
    followed the overflow), where the old rule doubled it at step 2."""
    ours = LossScaler(FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=2, hysteresis=1))
    scales = []
    for overflow in [True, False, False, False, False, False]:
        ours.update(overflow)
        scales.append(ours.scale)
    assert scales == [8.0, 8.0, 8.0, 16.0, 16.0, 32.0]


def test_overflowing_at_the_minimum_scale_raises_naming_the_ways_out():
    ours = LossScaler(FP16Config(enabled=True, initial_scale_power=1, min_loss_scale=1.0, hysteresis=1))
    ours.update(True)  # 2 -> 1
    with pytest.raises(RuntimeError, match=r"minimum loss scale \(1\).*bf16.*min_loss_scale"):
        ours.update(True)
