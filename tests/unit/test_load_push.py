"""When a WatchLoad stream sends (sidecar_server.load_push, pure): at once, on a change at most
once per interval, at least once per heartbeat, never figures nobody read again."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_server.load_push import Pushed, PushTiming, Sample, wait_before_push

TIMING = PushTiming(interval=0.1, heartbeat=1.0)


def report(inflight: int = 0, running: int = 0) -> sidecar_pb2.LoadReport:
    return sidecar_pb2.LoadReport(
        inflight_requests=inflight, ranks=[sidecar_pb2.RankLoad(dp_rank=0, running_requests=running)]
    )


def sample(number: int, inflight: int = 0, running: int = 0) -> Sample:
    return Sample(report(inflight, running), number)


def pushed(number: int, at: float, inflight: int = 0, running: int = 0) -> Pushed:
    return Pushed(sample(number, inflight, running), at)


@pytest.mark.parametrize(
    ("last", "current", "now", "wait"),
    [
        # Nothing read yet (or the last read failed): nothing to send, whatever was sent.
        (None, None, 0.0, None),
        (pushed(1, 0.0), None, 5.0, None),
        # The first sample goes at once.
        (None, sample(1), 0.0, 0.0),
        (None, sample(7, inflight=3), 100.0, 0.0),
        # A change goes as soon as the interval since the last push has passed.
        (pushed(1, 10.0), sample(2, inflight=1), 10.1, 0.0),
        (pushed(1, 10.0), sample(2, running=1), 10.5, 0.0),
        # Within the interval it waits for the rest of it (then looks at the latest sample).
        (pushed(1, 10.0), sample(2, inflight=1), 10.04, 0.06),
        # Unchanged: it waits for the heartbeat, then says "still so".
        (pushed(1, 10.0), sample(2), 10.3, 0.7),
        (pushed(1, 10.0), sample(2), 11.0, 0.0),
        (pushed(1, 10.0), sample(9), 12.5, 0.0),
        # No read since the last push: nothing new to say, heartbeat due or not, changed or not.
        (pushed(4, 10.0), sample(4), 12.0, None),
        (pushed(4, 10.0, inflight=1), sample(4), 12.0, None),
    ],
)
def test_when_a_stream_sends(
    last: Pushed | None, current: Sample | None, now: float, wait: float | None
) -> None:
    got = wait_before_push(last, current, now, TIMING)
    if wait is None:
        assert got is None
    else:
        assert got == pytest.approx(wait)


def test_the_interval_and_heartbeat_are_the_given_ones() -> None:
    timing = PushTiming(interval=0.5, heartbeat=3.0)
    assert wait_before_push(pushed(1, 0.0), sample(2, inflight=1), 0.2, timing) == pytest.approx(0.3)
    assert wait_before_push(pushed(1, 0.0), sample(2), 2.0, timing) == pytest.approx(1.0)


def test_the_defaults_are_the_apis_promise() -> None:
    # docs/api.md: at most one per --load-push-interval-ms (100 ms by default), a heartbeat every second.
    assert PushTiming() == PushTiming(interval=0.1, heartbeat=1.0)


@st.composite
def runs(draw: st.DrawFn) -> list[tuple[float, int | None]]:
    """A stream's life: at each step the time advances and a read happens (a load figure, or
    None: the read failed)."""
    return draw(st.lists(st.tuples(st.floats(0.0, 0.7), st.none() | st.integers(0, 3)), max_size=60))


@given(runs())
def test_a_stream_driven_by_the_function_keeps_the_promise(steps: list[tuple[float, int | None]]) -> None:
    """Simulated: a stream that looks at each read (and at the times the function names)
    sends at most one report per interval, only reads made since its last send, every change
    within an interval of the read that showed it, and never lets a heartbeat pass while
    fresh reads come."""
    timing = TIMING
    now = 0.0
    latest: Sample | None = None
    last: Pushed | None = None
    sent: list[Pushed] = []
    reads = 0
    for advance, figure in steps:
        # Between reads: the stream wakes at the time the function asked for, if within.
        if last is not None and latest is not None:
            wait = wait_before_push(last, latest, now, timing)
            if wait is not None and 0.0 < wait <= advance:
                at = now + wait
                assert wait_before_push(last, latest, at, timing) == pytest.approx(0.0, abs=1e-9)
                last = Pushed(latest, at)
                sent.append(last)
        now += advance
        if figure is None:
            latest = None
        else:
            reads += 1
            latest = Sample(report(inflight=figure), reads)
        wait = wait_before_push(last, latest, now, timing)
        if wait == 0.0:
            assert latest is not None
            if last is not None and latest.report != last.sample.report:
                assert now - last.at >= timing.interval - 1e-9
            last = Pushed(latest, now)
            sent.append(last)
        elif wait is not None:
            assert last is not None
            assert latest is not None
            # Held back only by the interval (a change) or the heartbeat (none).
            limit = timing.interval if latest.report != last.sample.report else timing.heartbeat
            assert now - last.at < limit
    for before, after in itertools.pairwise(sent):
        assert after.sample.number > before.sample.number  # only reads made since
        assert after.at - before.at >= timing.interval - 1e-9  # coalesced
