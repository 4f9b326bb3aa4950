"""Waiting for an engine that does not answer is said where it dials and why, at once, then at
a growing interval (never silence for minutes): the schedule as a table, and the retry loop on
a virtual clock."""

from __future__ import annotations

import itertools

import pytest
from structlog.testing import capture_logs

from sidecar_common.errors import SidecarError
from sidecar_common.pool import Deadline, ReportSchedule, RetryPolicy, retry_until_deadline
from tests.fakes_clock import FakeClock, ScriptedConnector, Step


@pytest.mark.parametrize(
    ("calls", "expected"),
    [
        # (now, due?) pairs: the first call reports at once, then 2, 4, 8, 16, 30, 30 s apart.
        ([0.0], [2.0]),
        ([0.0, 1.9], [2.0, None]),
        ([0.0, 2.0, 3.0, 6.0], [2.0, 4.0, None, 8.0]),
        ([0.0, 2.0, 6.0, 14.0, 30.0, 60.0, 90.0, 119.9], [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, None]),
        # Late calls (a long attempt in between): the next interval counts from the report.
        ([0.0, 50.0, 53.9, 54.0], [2.0, 4.0, None, 8.0]),
    ],
)
def test_report_schedule(calls: list[float], expected: list[float | None]) -> None:
    schedule = ReportSchedule()
    assert [schedule.due(now) for now in calls] == expected


def test_report_schedule_says_how_long_until_the_next_report() -> None:
    schedule = ReportSchedule()
    assert schedule.wait(100.0) == 2.0  # nothing reported yet: the first hang report
    schedule.due(100.0)
    assert schedule.wait(101.5) == pytest.approx(0.5)
    assert schedule.wait(105.0) == 0.0


async def test_a_refusing_engine_is_reported_at_once_then_at_a_growing_interval() -> None:
    clock = FakeClock(now=0.0)
    refused = ConnectionRefusedError(111, "Connection refused")
    connector = ScriptedConnector(clock, then=Step(takes=0.01, error=refused))
    with capture_logs() as logs, pytest.raises(SidecarError):
        await retry_until_deadline(
            "engine 127.0.0.1:1 slot 1/1",
            lambda timeout: connector("127.0.0.1:1", timeout),
            Deadline.start(clock, 120.0),
            RetryPolicy(attempt_timeout=5.0, max_interval=1.0),
        )
    waits = [e for e in logs if e["event"] == "waiting for engine"]
    assert waits, logs
    assert waits[0]["attempts"] == 1
    assert waits[0]["waited_secs"] == pytest.approx(0.01)
    for line in waits:
        assert line["log_level"] == "warning"
        assert line["dialling"] == "engine 127.0.0.1:1 slot 1/1"
        assert "Connection refused" in line["error"]
    intervals = [line["next_report_secs"] for line in waits]
    assert intervals == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0][: len(intervals)]
    assert len(intervals) >= 5
    # Each report comes no sooner than the interval the previous one announced, and the
    # attempts keep counting: a report per interval, not per attempt.
    for before, after in itertools.pairwise(waits):
        assert after["waited_secs"] - before["waited_secs"] >= before["next_report_secs"]
        assert after["attempts"] > before["attempts"]
    assert len(waits) < len(connector.calls) / 5
