"""Shared test settings: hypothesis profiles and markers."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# CI runs every property on at least 500 examples; ZEROCORE_HYPOTHESIS_PROFILE=dev gives a quick pass.
settings.register_profile(
    "ci", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("ZEROCORE_HYPOTHESIS_PROFILE", "ci"))
