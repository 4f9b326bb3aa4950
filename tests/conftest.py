"""Test-wide settings: the hypothesis profile every run loads, and one for `make mutation`
(chosen there with ``--hypothesis-profile=mutation``, which replaces the first). Under mutmut
every function call goes through a trampoline, so input generation is slower: health checks
on speed would fail for that reason only, and fewer examples keep each mutant's run short."""

from __future__ import annotations

import pytest
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


def _expected_seconds(item: pytest.Item) -> float:
    marker = item.get_closest_marker("slow")
    if marker is None:
        return 0.0
    return float(marker.args[0]) if marker.args else 1.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the modules holding ``slow`` tests first, the longest first (by the seconds their
    marker says); every other module after them, in the order collected.

    `make test` runs on pytest-xdist workers that take a module (or a class) at a time in this
    order (it passes --no-loadscope-reorder: xdist's own reordering, by number of tests, starts
    the modules of a few long tests last). The run ends when its last worker does, so the long
    units go first and the many short ones fill the gaps after them. A module moves as a whole,
    so its module-scoped fixtures still start once in a run without xdist.
    """
    weight: dict[object, float] = {}
    for item in items:
        weight[item.path] = max(weight.get(item.path, 0.0), _expected_seconds(item))
    items.sort(key=lambda item: -weight[item.path])
