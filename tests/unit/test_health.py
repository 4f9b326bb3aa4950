"""The engine health rules, pure: the watch's failure threshold and when an engine fault is the
engine going away (sidecar_server.health, the typing rule in sidecar_common.errors)."""

from __future__ import annotations

import anyio
import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.errors import FailureReason, SidecarError, engine_went_away, is_engine_fault
from sidecar_common.rpc import NotHealthy
from sidecar_common.rpc import probe as health_probe
from sidecar_server.health import FAILURE_THRESHOLD, HealthStreak, Probe, after_engine_fault

H, U, L = Probe.HEALTHY, Probe.UNHEALTHY, Probe.LATE


@pytest.mark.parametrize(
    ("probes", "changes", "healthy"),
    [
        ([], [], True),
        ([L], [None], True),
        ([L, L], [None, None], True),
        ([L, L, L], [None, None, False], False),
        ([U, L, U], [None, None, False], False),
        ([L, L, H, L, L], [None, None, None, None, None], True),  # a success starts the count over
        ([L, L, H, L, L, L], [None, None, None, None, None, False], False),
        ([U, U, U, U, U], [None, None, False, None, None], False),  # said once
        ([U, U, U, H], [None, None, False, True], True),  # one success is enough to come back
        ([U, U, U, H, U, U], [None, None, False, True, None, None], True),
        ([H, H], [None, None], True),
    ],
)
def test_the_verdict_changes_after_threshold_failures_in_a_row_and_one_success(
    probes: list[Probe], changes: list[bool | None], healthy: bool
) -> None:
    streak = HealthStreak()
    assert [streak.observe(p) for p in probes] == changes
    assert streak.healthy is healthy


def test_the_default_threshold_is_three() -> None:
    assert FAILURE_THRESHOLD == 3
    assert HealthStreak().threshold == 3


@given(st.integers(1, 6), st.lists(st.sampled_from(list(Probe)), max_size=40))
def test_unhealthy_exactly_when_threshold_probes_failed_since_the_last_success(
    threshold: int, probes: list[Probe]
) -> None:
    streak = HealthStreak(threshold)
    for probe in probes:
        streak.observe(probe)
    tail = 0
    for probe in reversed(probes):
        if probe is Probe.HEALTHY:
            break
        tail += 1
    assert streak.failures == tail
    assert streak.healthy is (tail < threshold)


def test_reset_starts_from_a_known_verdict() -> None:
    streak = HealthStreak(2)
    streak.reset(False)
    assert not streak.healthy
    assert streak.observe(H) is True
    streak.reset(True)
    assert streak.observe(L) is None
    assert streak.observe(L) is False


def test_a_threshold_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        HealthStreak(0)


INTERNAL = "Generate: EngineCore encountered an issue. See stack trace (above) for the root cause. (INTERNAL)"


@pytest.mark.parametrize("reason", list(FailureReason))
@pytest.mark.parametrize("probe", list(Probe))
def test_only_an_untyped_engine_fault_with_the_engine_unhealthy_becomes_the_engine_going_away(
    reason: FailureReason, probe: Probe
) -> None:
    error = SidecarError(reason, INTERNAL)
    typed = after_engine_fault(error, probe, "engine reports not healthy: Engine is not alive")
    if reason is FailureReason.UNKNOWN and probe is Probe.UNHEALTHY:
        assert typed is not None
        assert typed.reason is FailureReason.ENGINE_SHUTDOWN
        assert typed.migratable
        # The engine's own words stay, and why it was judged gone follows them.
        assert typed.message == (
            f"{INTERNAL}; the engine then reported itself unhealthy: "
            "engine reports not healthy: Engine is not alive"
        )
    else:
        assert typed is None


@pytest.mark.parametrize(
    ("reason", "fault"),
    [(reason, reason is FailureReason.UNKNOWN) for reason in FailureReason],
)
def test_which_failures_are_engine_faults(reason: FailureReason, fault: bool) -> None:
    assert is_engine_fault(SidecarError(reason, "x")) is fault


def test_the_engine_going_away_is_migratable_with_the_engines_words() -> None:
    gone = engine_went_away(SidecarError(FailureReason.UNKNOWN, "Generate: boom (INTERNAL)"), "why")
    assert (gone.reason, gone.migratable) == (FailureReason.ENGINE_SHUTDOWN, True)
    assert gone.message == "Generate: boom (INTERNAL); the engine then reported itself unhealthy: why"


class _Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "probe"


async def test_a_probe_tells_a_late_answer_from_an_unhealthy_one() -> None:
    why: list[str] = []

    async def hangs(timeout: float) -> None:
        await anyio.sleep_forever()

    async def deadline(timeout: float) -> None:
        raise _Status(grpc.StatusCode.DEADLINE_EXCEEDED)

    async def refused(timeout: float) -> None:
        raise _Status(grpc.StatusCode.UNAVAILABLE)

    async def not_healthy(timeout: float) -> None:
        raise NotHealthy("engine reports not healthy: Engine is not alive")

    with pytest.raises(TimeoutError, match="no health check answer within"):
        await health_probe(hangs, 0.01, why.append)
    with pytest.raises(TimeoutError, match="DEADLINE_EXCEEDED"):
        await health_probe(deadline, 0.01, why.append)
    assert await health_probe(refused, 0.01, why.append) is False
    assert await health_probe(not_healthy, 0.01, why.append) is False
    assert why[2:] == ["HealthCheck: probe (UNAVAILABLE)", "engine reports not healthy: Engine is not alive"]
