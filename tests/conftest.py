"""Test-wide settings: a hypothesis profile for `make mutation` (chosen there with
``--hypothesis-profile=mutation``; the default profile is untouched). Under mutmut every
function call goes through a trampoline, so input generation is slower: health checks on
speed would fail for that reason only, and fewer examples keep each mutant's run short."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "mutation",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
