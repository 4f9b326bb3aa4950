"""The watch over the engine's own state (sidecar_server.engine_state_watch) over a scripted
engine: each change said once and handed on, a failed read leaving the last reading standing;
the health monitor skipping its probe while the engine says it is paused; the load watch
reading at once when asked; the metrics of the engine's state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import pytest
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_server.engine import EngineHealth
from sidecar_server.engine_health import EngineHealthMonitor
from sidecar_server.engine_state import Change, Continued, EngineStatus, Paused, WeightVersionChanged
from sidecar_server.engine_state_watch import EngineStateWatch
from sidecar_server.load_push import PushTiming
from sidecar_server.load_watch import LoadWatch
from sidecar_server.metrics import Metrics
from tests.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(30)

WAIT = 30.0
Reading = EngineStatus | SidecarError


@dataclass
class Script:
    readings: list[Reading]
    reads: int = 0

    async def read(self) -> EngineStatus:
        self.reads += 1
        reading = self.readings.pop(0)
        if isinstance(reading, SidecarError):
            raise reading
        return reading


def watch_over(
    readings: Sequence[Reading],
) -> tuple[EngineStateWatch, list[tuple[EngineStatus, tuple[Change, ...]]]]:
    told: list[tuple[EngineStatus, tuple[Change, ...]]] = []
    script = Script(list(readings))
    watch = EngineStateWatch(
        script.read, interval=3600.0, timeout=10.0, on_change=lambda s, c: told.append((s, c))
    )
    return watch, told


async def test_each_change_is_said_once_and_handed_on_and_a_failed_read_changes_nothing() -> None:
    down = SidecarError(FailureReason.CANNOT_CONNECT, "GET /ready: refused")
    watch, told = watch_over(
        [
            EngineStatus(False, "v1"),
            EngineStatus(False, "v1"),
            EngineStatus(True, "v1"),
            down,
            EngineStatus(True, "v2"),
            EngineStatus(False, "v2"),
        ]
    )
    with capture_logs() as logs:
        for _ in range(6):
            await watch.poll()
            if watch.status == EngineStatus(True, "v1"):
                assert watch.paused
    assert told == [
        (EngineStatus(False, "v1"), (WeightVersionChanged(None, "v1"),)),
        (EngineStatus(True, "v1"), (Paused(),)),
        (EngineStatus(True, "v2"), (WeightVersionChanged("v1", "v2"),)),
        (EngineStatus(False, "v2"), (Continued(),)),
    ]
    said = [(e["event"], e.get("old"), e.get("new")) for e in logs]
    assert said == [
        ("engine weight version changed", None, "v1"),
        ("engine paused: its health is not probed until it continues", None, None),
        ("engine state not read: the last reading stands", None, None),
        ("engine state readable again", None, None),
        ("engine weight version changed", "v1", "v2"),
        ("engine continued", None, None),
    ]
    assert not watch.paused


async def test_a_reading_that_hangs_is_bounded_and_the_last_one_stands() -> None:
    async def hang() -> EngineStatus:
        await anyio.sleep_forever()
        raise AssertionError

    watch = EngineStateWatch(hang, interval=3600.0, timeout=0.05, on_change=lambda s, c: None)
    with capture_logs() as logs:
        assert await watch.poll() == EngineStatus()
    assert logs[0]["error"] == "no answer within 0.05s"


# --- the health monitor while paused ---------------------------------------------------------


@dataclass
class Probed(FakeEngine):
    probes: int = 0

    async def health(self) -> EngineHealth:
        self.probes += 1
        return EngineHealth.unhealthy("GET /health answered HTTP 503")


async def test_no_health_probe_while_the_engine_says_it_is_paused_and_the_verdict_stands() -> None:
    engine = Probed()
    paused = [True]
    changes: list[tuple[bool, str]] = []
    monitor = EngineHealthMonitor(
        engine,
        watch_interval=3600.0,
        probe_timeout=10.0,
        failure_threshold=1,
        fault_window=1.0,
        on_change=lambda ok, why: changes.append((ok, why)),
        internal_error=lambda where, exc: SidecarError(FailureReason.UNKNOWN, where),
        paused=lambda: paused[0],
    )
    for _ in range(5):
        await monitor.check()
    assert engine.probes == 0
    assert monitor.healthy
    # An engine fault while paused is not taken for the engine going away.
    fault = SidecarError(FailureReason.UNKNOWN, "Generate: boom (INTERNAL)")
    assert await monitor.typed_fault(fault) is fault
    assert engine.probes == 0
    paused[0] = False
    await monitor.check()
    assert engine.probes == 1
    assert changes == [(False, "GET /health answered HTTP 503")]


# --- the load watch reads at once when asked -------------------------------------------------


@dataclass
class Loads:
    reads: int = 0
    read_done: anyio.Event = field(default_factory=anyio.Event)

    async def read(self) -> sidecar_pb2.LoadReport:
        self.reads += 1
        done, self.read_done = self.read_done, anyio.Event()
        done.set()
        return sidecar_pb2.LoadReport(inflight_requests=0)


async def test_refresh_reads_the_load_now_rather_than_at_the_next_interval() -> None:
    loads = Loads()
    # Reads an hour apart; the same figures are sent again at once (heartbeat 0).
    watch = LoadWatch(loads.read, PushTiming(interval=3600.0, heartbeat=0.0))
    got: list[sidecar_pb2.LoadReport] = []
    arrived = anyio.Event()

    async def write(report: sidecar_pb2.LoadReport) -> None:
        nonlocal arrived
        got.append(report)
        arrived.set()
        arrived = anyio.Event()

    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(watch.watch, write)
            with anyio.fail_after(WAIT):
                while len(got) < 1:
                    await arrived.wait()
                assert loads.reads == 1
                watch.refresh()
                while len(got) < 2:
                    await arrived.wait()
            assert loads.reads == 2
            tasks.cancel_scope.cancel()
    finally:
        await watch.close(5.0)


# --- metrics ---------------------------------------------------------------------------------


def exposition(metrics: Metrics) -> list[str]:
    text = generate_latest(metrics.registry).decode()
    return [line for line in text.splitlines() if line.startswith("sidecar_engine_")]


def test_the_engine_state_metrics_follow_what_the_engine_says() -> None:
    metrics = Metrics("sglang")
    assert not [line for line in exposition(metrics) if "paused{" in line or "weight_version{" in line]
    metrics.set_engine_status(True, "v1")
    lines = exposition(metrics)
    assert 'sidecar_engine_paused{engine="sglang"} 1.0' in lines
    assert 'sidecar_engine_weight_version{engine="sglang",version="v1"} 1.0' in lines
    metrics.set_engine_status(False, "v2")
    lines = exposition(metrics)
    assert 'sidecar_engine_paused{engine="sglang"} 0.0' in lines
    assert 'sidecar_engine_weight_version{engine="sglang",version="v2"} 1.0' in lines
    assert not [line for line in lines if 'version="v1"' in line]
    metrics.set_engine_status(None, None)
    assert not [line for line in exposition(metrics) if "paused{" in line or "weight_version{" in line]
