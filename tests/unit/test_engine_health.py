"""The engine-health monitor: the verdict and the still-down reports, pure, with the time given
(sidecar_server.health.EngineVerdict), then the monitor over a scripted engine with a fake clock
(sidecar_server.engine_health): what it logs, whom it tells, and how it types an engine fault."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from sidecar_common.errors import FailureReason, SidecarError
from sidecar_server.engine import HEALTHY, EngineHealth
from sidecar_server.engine_health import EngineHealthMonitor
from sidecar_server.health import (
    EngineVerdict,
    FailedProbe,
    HealthNote,
    Probe,
    StillDown,
    Verdict,
)
from tests.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(30)

H, U, L = Probe.HEALTHY, Probe.UNHEALTHY, Probe.LATE


def observe_all(verdict: EngineVerdict, probes: Sequence[tuple[float, Probe]]) -> list[HealthNote | None]:
    return [verdict.observe(probe, f"why@{now:g}", now) for now, probe in probes]


# --- the verdict, pure -----------------------------------------------------------------------


def test_failed_probes_are_said_below_the_threshold_then_the_verdict_once() -> None:
    verdict = EngineVerdict(3)
    notes = observe_all(verdict, [(0, L), (1, U), (2, H), (3, L), (4, L), (5, U), (6, U)])
    assert notes == [
        FailedProbe(L, "why@0", 1, 3),
        FailedProbe(U, "why@1", 2, 3),
        None,  # a success starts the count over and is not news
        FailedProbe(L, "why@3", 1, 3),
        FailedProbe(L, "why@4", 2, 3),
        Verdict(False, "why@5"),
        None,  # the next report is not due yet
    ]
    assert not verdict.healthy
    assert verdict.problem == "why@5"


def test_an_engine_that_stays_down_is_reported_again_at_a_growing_interval() -> None:
    verdict = EngineVerdict(1)
    assert verdict.observe(U, "refused", 100.0) == Verdict(False, "refused")
    seconds = [100.5, 101.9, 102.0, 103.0, 105.9, 106.0, 113.9, 114.0, 130.0, 160.0, 189.9, 190.0]
    reports = {now: note for now in seconds if (note := verdict.observe(L, f"late@{now:g}", now)) is not None}
    # The verdict line is the first report; then 2, 4, 8, 16 s apart, at most 30.
    assert reports == {
        102.0: StillDown("late@102", 2.0, 4.0),
        106.0: StillDown("late@106", 6.0, 8.0),
        114.0: StillDown("late@114", 14.0, 16.0),
        130.0: StillDown("late@130", 30.0, 30.0),
        160.0: StillDown("late@160", 60.0, 30.0),
        190.0: StillDown("late@190", 90.0, 30.0),
    }


def test_one_success_brings_the_engine_back_and_a_new_outage_starts_its_reports_over() -> None:
    verdict = EngineVerdict(1)
    verdict.observe(U, "first", 0.0)
    assert verdict.observe(U, "x", 2.0) == StillDown("x", 2.0, 4.0)
    assert verdict.observe(H, "", 3.0) == Verdict(True, "")
    assert verdict.healthy
    assert verdict.problem == "first"  # what the last verdict said, until the next one
    assert verdict.observe(U, "second", 50.0) == Verdict(False, "second")
    assert verdict.observe(U, "y", 51.0) is None
    assert verdict.observe(U, "y", 52.0) == StillDown("y", 2.0, 4.0)


def test_an_engine_gone_after_a_fault_is_the_verdict_at_once() -> None:
    verdict = EngineVerdict(3)
    assert verdict.gone("engine reports not healthy", 10.0) == Verdict(False, "engine reports not healthy")
    assert verdict.gone("again", 11.0) is None  # already said
    assert verdict.problem == "engine reports not healthy"
    assert verdict.observe(L, "late", 12.0) == StillDown("late", 2.0, 4.0)
    assert verdict.observe(H, "", 13.0) == Verdict(True, "")


def test_discovery_makes_the_engine_healthy_without_a_verdict() -> None:
    verdict = EngineVerdict(2)
    verdict.gone("down", 0.0)
    verdict.discovered()
    assert verdict.healthy
    # The count starts over: the threshold applies in full again.
    assert observe_all(verdict, [(1, L), (2, L)]) == [FailedProbe(L, "why@1", 1, 2), Verdict(False, "why@2")]


@given(
    st.integers(1, 4),
    st.lists(st.tuples(st.floats(0, 20), st.sampled_from(list(Probe))), max_size=60),
)
def test_verdicts_alternate_and_reports_come_only_while_down_and_never_early(
    threshold: int, steps: list[tuple[float, Probe]]
) -> None:
    verdict = EngineVerdict(threshold)
    now, healthy = 0.0, True
    down_at = 0.0
    next_due = 0.0  # when the next still-down report may come
    for gap, probe in steps:
        now += gap
        note = verdict.observe(probe, "why", now)
        match note:
            case Verdict():
                assert note.healthy is not healthy
                healthy = note.healthy
                if not healthy:
                    down_at, next_due = now, now + 2.0
            case StillDown():
                assert not healthy
                assert now >= next_due
                assert note.down_secs == now - down_at
                next_due = now + note.next_report_secs
            case FailedProbe():
                assert healthy
                assert probe is not Probe.HEALTHY
                assert note.failures < threshold
            case None:
                pass
        assert verdict.healthy is healthy


# --- the monitor over an engine --------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Scripted(FakeEngine):
    """Each probe takes the next answer ("ok", "unhealthy", "late", "bug"); then "ok"."""

    answers: list[str] = field(default_factory=list)
    probes: int = 0

    async def health(self) -> EngineHealth:
        self.probes += 1
        answer = self.answers.pop(0) if self.answers else "ok"
        if answer == "late":
            raise TimeoutError("HealthCheck: no answer within 1.5s")
        if answer == "bug":
            raise KeyError("status")
        return HEALTHY if answer == "ok" else EngineHealth.unhealthy("Engine is not alive")


@dataclass
class Watch:
    engine: Scripted
    monitor: EngineHealthMonitor
    clock: Clock
    changes: list[tuple[bool, str]]
    bugs: list[tuple[str, str]]


def watch(answers: Sequence[str], *, threshold: int = 3, fault_window: float = 5.0) -> Watch:
    engine = Scripted(answers=list(answers))
    clock = Clock()
    changes: list[tuple[bool, str]] = []
    bugs: list[tuple[str, str]] = []

    def internal_error(where: str, exc: BaseException) -> SidecarError:
        bugs.append((where, repr(exc)))
        return SidecarError(FailureReason.UNKNOWN, f"fake {where}: {type(exc).__name__}")

    monitor = EngineHealthMonitor(
        engine,
        watch_interval=3600.0,  # the tests call check() themselves
        probe_timeout=10.0,
        failure_threshold=threshold,
        fault_window=fault_window,
        on_change=lambda ok, why: changes.append((ok, why)),
        internal_error=internal_error,
        clock=clock,
    )
    return Watch(engine, monitor, clock, changes, bugs)


async def test_each_probe_of_the_watch_is_logged_and_the_verdict_is_told() -> None:
    w = watch(["late", "unhealthy", "late", "late", "late", "ok"])
    with capture_logs() as logs:
        for _ in range(6):
            await w.monitor.check()
            w.clock.now += 1.0
    said = [(e["event"], e.get("failures"), e.get("reason")) for e in logs]
    assert said == [
        ("engine health probe late", 1, "HealthCheck: no answer within 1.5s"),
        ("engine health probe failed", 2, "Engine is not alive"),
        ("engine unhealthy: refusing new requests", None, "HealthCheck: no answer within 1.5s"),
        # The verdict came at 502: the first report is due two seconds after it.
        ("engine still unhealthy: refusing new requests", None, "HealthCheck: no answer within 1.5s"),
        ("engine healthy again", None, None),
    ]
    still = next(e for e in logs if e["event"].startswith("engine still"))
    assert (still["down_secs"], still["next_report_secs"], still["log_level"]) == (2.0, 4.0, "warning")
    assert w.changes == [(False, "HealthCheck: no answer within 1.5s"), (True, "")]
    assert w.monitor.healthy
    assert w.monitor.problem == "HealthCheck: no answer within 1.5s"  # the last verdict's why


async def test_a_bug_in_a_probe_reads_as_unhealthy_and_is_reported_as_a_bug() -> None:
    w = watch(["bug"])
    assert await w.monitor.probe() == (Probe.UNHEALTHY, "fake health_watch: KeyError")
    assert w.bugs == [("health_watch", "KeyError('status')")]


async def test_a_probe_that_never_answers_is_late_after_the_probe_timeout() -> None:
    class Hangs(Scripted):
        async def health(self) -> EngineHealth:
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

    engine = Hangs()
    monitor = EngineHealthMonitor(
        engine,
        watch_interval=3600.0,
        probe_timeout=0.01,
        failure_threshold=3,
        fault_window=1.0,
        on_change=lambda ok, why: None,
        internal_error=lambda where, exc: SidecarError(FailureReason.UNKNOWN, where),
    )
    assert await monitor.probe() == (Probe.LATE, "no health check answer within 0.01s")


FAULT = SidecarError(FailureReason.UNKNOWN, "Generate: EngineCore encountered an issue (INTERNAL)")


async def test_an_engine_fault_then_an_unhealthy_engine_is_the_engine_going_away_at_once() -> None:
    w = watch(["ok", "late", "unhealthy"], fault_window=30.0)
    typed = await w.monitor.typed_fault(FAULT)
    assert (typed.reason, typed.migratable) == (FailureReason.ENGINE_SHUTDOWN, True)
    assert typed.message.endswith("; the engine then reported itself unhealthy: Engine is not alive")
    assert w.engine.probes == 3
    # The verdict is at once, without the threshold, and told.
    assert w.changes == [(False, "Engine is not alive")]
    assert not w.monitor.healthy
    # A later fault while the engine is down needs no probe.
    again = await w.monitor.typed_fault(FAULT)
    assert again.reason is FailureReason.ENGINE_SHUTDOWN
    assert w.engine.probes == 3


async def test_an_engine_that_stays_healthy_leaves_the_fault_as_it_was() -> None:
    w = watch([], fault_window=0.05)
    assert await w.monitor.typed_fault(FAULT) is FAULT
    assert w.engine.probes >= 1
    assert w.changes == []


async def test_a_typed_failure_is_not_an_engine_fault_and_probes_nothing() -> None:
    w = watch(["unhealthy"])
    refused = SidecarError(FailureReason.INVALID_ARGUMENT, "bad")
    assert await w.monitor.typed_fault(refused) is refused
    assert w.engine.probes == 0


async def test_concurrent_faults_share_the_probes() -> None:
    gate = anyio.Event()
    answered: list[str] = []

    class Gated(Scripted):
        async def health(self) -> EngineHealth:
            await gate.wait()
            answered.append("unhealthy")
            return await super().health()

    engine = Gated(answers=["unhealthy"])
    changes: list[tuple[bool, str]] = []
    monitor = EngineHealthMonitor(
        engine,
        watch_interval=3600.0,
        probe_timeout=10.0,
        failure_threshold=3,
        fault_window=30.0,
        on_change=lambda ok, why: changes.append((ok, why)),
        internal_error=lambda where, exc: SidecarError(FailureReason.UNKNOWN, where),
    )
    results: list[SidecarError] = []

    async def fail() -> None:
        results.append(await monitor.typed_fault(FAULT))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(fail)
            await anyio.wait_all_tasks_blocked()
            gate.set()
    assert [r.reason for r in results] == [FailureReason.ENGINE_SHUTDOWN] * 3
    assert engine.probes == 1
    assert changes == [(False, "Engine is not alive")]


async def test_once_closed_a_fault_stands_and_nothing_starts() -> None:
    w = watch(["unhealthy"])
    await w.monitor.close()
    assert await w.monitor.typed_fault(FAULT) is FAULT
    w.monitor.start()
    assert w.engine.probes == 0
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("sidecar server")]


def _hanging_monitor(activity: list[int], *, streams: bool) -> EngineHealthMonitor:
    """A monitor over an engine whose health check never answers; while it waits, the engine
    relays a message (``streams``) or nothing."""

    class Hangs(Scripted):
        async def health(self) -> EngineHealth:
            if streams:
                activity[0] += 1  # an engine message relayed while the probe waits
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

    return EngineHealthMonitor(
        Hangs(),
        watch_interval=3600.0,
        probe_timeout=0.01,
        failure_threshold=1,
        fault_window=1.0,
        on_change=lambda ok, why: None,
        internal_error=lambda where, exc: SidecarError(FailureReason.UNKNOWN, where),
        activity=lambda: activity[0],
    )


async def test_a_late_probe_while_the_engine_streams_finds_it_busy_not_gone() -> None:
    monitor = _hanging_monitor([0], streams=True)
    assert await monitor.probe() == (Probe.HEALTHY, "")
    await monitor.check()
    assert monitor.healthy  # threshold 1: one counted failure would have taken it out


async def test_a_late_probe_while_nothing_streams_still_counts() -> None:
    monitor = _hanging_monitor([0], streams=False)
    assert await monitor.probe() == (Probe.LATE, "no health check answer within 0.01s")
    await monitor.check()
    assert not monitor.healthy
