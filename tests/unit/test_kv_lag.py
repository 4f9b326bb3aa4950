"""The events lag rule both lag histograms use (sidecar_common.kv_lag): the time a batch is
seen minus the engine's time of it, never negative, from a ``now`` the caller passes in."""

from __future__ import annotations

import math

import pytest

from sidecar_common.kv_lag import events_lag


def test_the_lag_is_now_minus_the_engines_time() -> None:
    assert events_lag(1_700_000_000.25, 1_700_000_000.0) == 0.25


def test_an_engine_clock_ahead_of_ours_counts_as_no_lag() -> None:
    # Clock skew between hosts: the engine's time is after ours.
    assert events_lag(100.0, 100.5) == 0.0


@pytest.mark.parametrize("engine_time", [math.nan, math.inf, -math.inf])
def test_a_time_that_is_not_a_number_counts_as_no_lag(engine_time: float) -> None:
    assert events_lag(100.0, engine_time) == 0.0
