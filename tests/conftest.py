"""Test-wide settings: hypothesis profiles ("ci": derandomized and bounded; "dev": longer, random),
chosen by HYPOTHESIS_PROFILE, defaulting to "ci" so a plain `pytest` is reproducible."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=25, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
