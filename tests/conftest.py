"""Test-wide settings: the hypothesis profile every run loads, and one for `make mutation`
(chosen there with ``--hypothesis-profile=mutation``, which replaces the first). Under mutmut
every function call goes through a trampoline, so input generation is slower: health checks
on speed would fail for that reason only, and fewer examples keep each mutant's run short."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

# No per-example deadline and no "input generation is slow" health check: both are timed
# assertions (hypothesis's defaults: 200 ms per example, 1 s to draw a few inputs), and a loaded
# machine (make test on several workers, other work beside it) misses them with nothing wrong
# in the code. Every other setting, the number of examples included, is hypothesis's default.
settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")

settings.register_profile(
    "mutation",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
