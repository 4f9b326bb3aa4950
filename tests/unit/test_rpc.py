"""The shared bounded-call helpers of the gRPC engine adapters."""

from __future__ import annotations

import grpc
import pytest

from sidecar_common.errors import FailureReason, SidecarError
from sidecar_common.pool import Deadline, RetryPolicy
from sidecar_common.rpc import NotHealthy, bounded_call, discovery_timeout, probe
from tests.fakes_clock import FakeClock


class _Failed(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self) -> str:
        return "queue full"


async def test_an_rpc_error_becomes_the_typed_error_named_after_the_rpc() -> None:
    async def call(timeout: float) -> None:
        raise _Failed()

    with pytest.raises(SidecarError) as info:
        await bounded_call("GetLoads", 1.0, call)
    assert info.value.reason is FailureReason.OVERLOADED
    assert info.value.message == "GetLoads: queue full (RESOURCE_EXHAUSTED)"


async def test_the_call_gets_the_timeout_and_its_answer_comes_back() -> None:
    seen: list[float] = []

    async def call(timeout: float) -> str:
        seen.append(timeout)
        return "ok"

    assert await bounded_call("HealthCheck", 0.25, call) == "ok"
    assert seen == [0.25]


def test_discovery_is_bounded_by_the_attempt_timeout_and_the_remaining_deadline() -> None:
    clock = FakeClock()
    deadline = Deadline.start(clock, 10.0)
    policy = RetryPolicy(attempt_timeout=3.0)
    assert discovery_timeout("GetModelInfo", deadline, policy) == 3.0
    clock.now += 8.5
    assert discovery_timeout("GetModelInfo", deadline, policy) == pytest.approx(1.5)
    clock.now += 2.0
    with pytest.raises(SidecarError) as info:
        discovery_timeout("GetModelInfo", deadline, policy)
    assert info.value.reason is FailureReason.CONNECTION_TIMEOUT
    assert "GetModelInfo" in info.value.message
    assert "10s" in info.value.message


@pytest.mark.parametrize(
    ("error", "verdict"),
    [(None, True), (NotHealthy("warming up"), False), (_Failed(), False)],
)
async def test_a_probe_reports_a_verdict(error: Exception | None, verdict: bool) -> None:
    async def attempt(timeout: float) -> None:
        if error is not None:
            raise error

    assert await probe(attempt, 1.0) is verdict


async def test_a_probe_does_not_hide_a_bug() -> None:
    async def attempt(timeout: float) -> None:
        raise KeyError("a programming error")

    with pytest.raises(KeyError):
        await probe(attempt, 1.0)
