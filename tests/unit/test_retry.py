"""The one retry mechanism: the backoff's bounds, and RetryForever's series, stop and reports."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.registration_etcd import etcd_backoff
from sidecar_common.retry import Backoff, RetryForever


@given(st.integers(1, 200), st.floats(0, 0.999))
def test_a_pause_is_in_the_upper_half_of_its_capped_step(failures: int, rand: float) -> None:
    backoff = Backoff(0.2, 5.0)
    ceiling = min(5.0, 0.2 * 2 ** (failures - 1))
    assert ceiling / 2 <= backoff.pause(failures, lambda: rand) <= ceiling


def test_etcd_backoff_starts_at_a_fifth_of_a_second_and_stops_at_the_cap() -> None:
    backoff = etcd_backoff(5.0)
    assert [backoff.ceiling(n) for n in range(1, 8)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]


class _Flaky(Exception):
    pass


class _Script:
    """Attempts that fail as told; records the pauses and the reports."""

    def __init__(self, outcomes: list[str]) -> None:
        self.outcomes = outcomes
        self.pauses: list[float] = []
        self.reports: list[tuple[str, int, float]] = []
        self.retrying = RetryForever(
            Backoff(1.0, 4.0),
            retry_on=lambda e: isinstance(e, _Flaky),
            on_retry=lambda e, n, p: self.reports.append((str(e), n, p)),
            sleep=self.sleep,
            rand=lambda: 0.999,
        )

    async def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)

    async def attempt(self) -> str:
        outcome = self.outcomes.pop(0)
        if outcome == "progress-then-fail":
            self.retrying.made_progress()
            raise _Flaky(outcome)
        if outcome.startswith("fail"):
            raise _Flaky(outcome)
        if outcome == "bug":
            raise KeyError(outcome)
        return outcome


async def test_failures_in_a_row_back_off_and_progress_starts_a_new_series() -> None:
    script = _Script(["fail1", "fail2", "fail3", "fail4", "progress-then-fail", "fail5", "ok"])
    assert await script.retrying.run(script.attempt) == "ok"
    assert [n for _, n, _ in script.reports] == [1, 2, 3, 4, 1, 2]
    assert script.pauses == pytest.approx([1.0, 2.0, 4.0, 4.0, 1.0, 2.0], abs=0.01)
    assert [p for _, _, p in script.reports] == script.pauses


async def test_a_failure_it_does_not_retry_propagates_at_once() -> None:
    script = _Script(["fail1", "bug", "ok"])
    with pytest.raises(KeyError):
        await script.retrying.run(script.attempt)
    assert script.outcomes == ["ok"]


async def test_stop_raises_the_failure_instead_of_retrying_it() -> None:
    attempts: list[int] = []
    pauses: list[float] = []
    reports: list[int] = []

    async def attempt() -> None:
        attempts.append(len(attempts) + 1)
        raise _Flaky(f"fail{len(attempts)}")

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)

    retrying = RetryForever(
        Backoff(1.0, 4.0),
        retry_on=lambda e: True,
        on_retry=lambda e, n, p: reports.append(n),
        stop=lambda: len(attempts) >= 2,  # asked to stop while the second attempt runs
        sleep=sleep,
    )
    with pytest.raises(_Flaky, match="fail2"):
        await retrying.run(attempt)
    assert (attempts, len(pauses), reports) == ([1, 2], 1, [1])
