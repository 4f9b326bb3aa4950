"""The retry budget (issue 27): retries across workers as a fraction of recent successes plus
a floor, so an overloaded fleet never multiplies its own load."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_frontend.retry_budget import RetryBudget, RetryBudgetSettings


def allowed(budget: RetryBudget, now: float, tries: int) -> int:
    return sum(budget.try_retry(now) for _ in range(tries))


@pytest.mark.parametrize(
    ("settings", "successes", "expected"),
    [
        # A quiet fleet: the floor alone, min_per_second * window.
        (RetryBudgetSettings(ratio=0.2, min_per_second=5.0, window=10.0), 0, 50),
        (RetryBudgetSettings(ratio=0.2, min_per_second=0.5, window=10.0), 0, 5),
        # A busy one: the floor plus ratio per success.
        (RetryBudgetSettings(ratio=0.2, min_per_second=5.0, window=10.0), 100, 70),
        (RetryBudgetSettings(ratio=0.5, min_per_second=0.0, window=10.0), 10, 5),
        (RetryBudgetSettings(ratio=0.5, min_per_second=0.0, window=10.0), 11, 5),
        # Nothing at all: never a retry.
        (RetryBudgetSettings(ratio=0.0, min_per_second=0.0, window=10.0), 1000, 0),
        (RetryBudgetSettings(ratio=0.5, min_per_second=0.0, window=10.0), 0, 0),
    ],
)
def test_retries_allowed_at_one_time(settings: RetryBudgetSettings, successes: int, expected: int) -> None:
    budget = RetryBudget(settings)
    for _ in range(successes):
        budget.succeeded(3.0)
    assert allowed(budget, 3.5, expected + 20) == expected


def test_a_refused_retry_spends_nothing_and_the_budget_comes_back_with_successes() -> None:
    budget = RetryBudget(RetryBudgetSettings(ratio=1.0, min_per_second=0.1, window=10.0))
    assert allowed(budget, 0.0, 5) == 1
    assert allowed(budget, 0.0, 5) == 0
    budget.succeeded(0.5)
    budget.succeeded(0.5)
    assert allowed(budget, 0.5, 5) == 2


def test_successes_older_than_the_window_count_no_more() -> None:
    budget = RetryBudget(RetryBudgetSettings(ratio=1.0, min_per_second=0.0, window=10.0))
    for _ in range(10):
        budget.succeeded(0.0)
    assert allowed(budget, 9.0, 3) == 3
    # Ten seconds on, those successes are gone (and so are the retries they paid for).
    assert allowed(budget, 10.0, 3) == 0
    assert allowed(budget, 30.0, 3) == 0


def test_the_floor_comes_back_once_the_retries_that_spent_it_are_a_window_old() -> None:
    budget = RetryBudget(RetryBudgetSettings(ratio=0.0, min_per_second=1.0, window=10.0))
    assert allowed(budget, 0.0, 20) == 10
    assert allowed(budget, 5.0, 20) == 0
    assert allowed(budget, 10.5, 20) == 0  # a bucket more than the window: still counted
    assert allowed(budget, 11.0, 20) == 10


def test_a_clock_that_steps_back_counts_as_the_latest_time() -> None:
    budget = RetryBudget(RetryBudgetSettings(ratio=1.0, min_per_second=0.0, window=10.0))
    budget.succeeded(100.0)
    budget.succeeded(50.0)  # before the latest: counted at 100
    assert allowed(budget, 100.0, 5) == 2


def test_the_default_settings_are_the_issues() -> None:
    settings = RetryBudgetSettings()
    assert (settings.ratio, settings.min_per_second, settings.window) == (0.2, 5.0, 10.0)
    assert RetryBudget().settings == settings


@pytest.mark.parametrize(
    "bad",
    [
        {"ratio": -0.1},
        {"ratio": float("nan")},
        {"ratio": float("inf")},
        {"min_per_second": -1.0},
        {"window": 0.0},
        {"window": -5.0},
        {"window": float("inf")},
    ],
)
def test_settings_out_of_range_are_refused(bad: dict[str, Any]) -> None:
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        RetryBudgetSettings(**bad)


# Events: (milliseconds since the previous event, is it a retry (else a success)).
EVENTS = st.lists(st.tuples(st.integers(0, 3000), st.booleans()), max_size=300)


@given(
    EVENTS,
    st.sampled_from([0.0, 0.1, 0.2, 1.0, 2.5]),
    st.sampled_from([0.0, 0.1, 1.0, 5.0]),
    st.sampled_from([5.0, 10.0, 20.0]),  # bucket widths exact in binary
)
def test_the_budget_never_allows_more_than_its_share_of_a_window(
    events: list[tuple[int, bool]], ratio: float, min_per_second: float, window: float
) -> None:
    """At every allowed retry at time t: the retries allowed in [t - window, t] are at most
    ratio * the successes in (t - window, t] + min_per_second * window."""
    settings = RetryBudgetSettings(ratio=ratio, min_per_second=min_per_second, window=window)
    budget = RetryBudget(settings)
    window_ms = round(window * 1000)
    now_ms = 0
    successes: list[int] = []
    retries: list[int] = []
    for delay, is_retry in events:
        now_ms += delay
        now = now_ms / 1000
        if not is_retry:
            budget.succeeded(now)
            successes.append(now_ms)
            continue
        if not budget.try_retry(now):
            continue
        retries.append(now_ms)
        recent_retries = sum(1 for at in retries if at >= now_ms - window_ms)
        recent_successes = sum(1 for at in successes if at > now_ms - window_ms)
        assert recent_retries <= ratio * recent_successes + min_per_second * window + 1e-9


@given(st.integers(0, 100), st.integers(0, 10_000))
def test_a_retry_is_never_refused_while_the_last_window_leaves_room(successes: int, start_ms: int) -> None:
    """The other side: what the budget refuses, the formula refused too. At one time (every
    success and retry in the current bucket) exactly floor(ratio * successes + floor) pass."""
    settings = RetryBudgetSettings(ratio=0.25, min_per_second=0.5, window=10.0)
    budget = RetryBudget(settings)
    now = start_ms / 1000
    for _ in range(successes):
        budget.succeeded(now)
    expected = int(0.25 * successes + 5.0)
    assert allowed(budget, now, expected + 5) == expected
