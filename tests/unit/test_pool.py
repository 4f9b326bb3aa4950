"""The pool's deadline arithmetic, backoff and slot handling, on a virtual clock."""

from __future__ import annotations

import random
import socket
from collections.abc import Awaitable, Callable
from typing import cast

import anyio
import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common.endpoint import Endpoint
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_common.pool import (
    ChannelPool,
    Deadline,
    NotReady,
    PoolConfig,
    RetryPolicy,
    SystemClock,
    backoff_interval,
    is_transient,
    retry_until_deadline,
)
from tests.fakes_clock import FakeChannel, FakeClock, ScriptedConnector, Step

ENDPOINT = Endpoint("127.0.0.1", 5)
REFUSED = ConnectionRefusedError("connection refused")


def attempt_with(connector: ScriptedConnector) -> Callable[[float], Awaitable[grpc.aio.Channel]]:
    return lambda timeout: connector("127.0.0.1:5", timeout)


def make_pool(clock: FakeClock, connector: ScriptedConnector, n: int, policy: RetryPolicy) -> ChannelPool:
    return ChannelPool(PoolConfig(ENDPOINT, connections=n, retry=policy), clock=clock, connector=connector)


async def test_a_slow_first_slot_leaves_only_the_rest_of_the_deadline_to_the_others() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock, [Step(takes=0.070)])
    pool = make_pool(clock, connector, 4, RetryPolicy(attempt_timeout=30.0))

    await pool.connect(Deadline.start(clock, 0.100))

    assert pool.size == 4
    assert connector.calls[0].timeout == pytest.approx(0.100)
    later = [call.timeout for call in connector.calls[1:]]
    assert len(later) == 3
    assert all(0 < timeout <= 0.030 + 1e-9 for timeout in later), later
    assert {call.target for call in connector.calls} == {"127.0.0.1:5"}
    await pool.close()


async def test_a_later_slot_that_needs_more_than_is_left_fails_the_pool_naming_it() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock, [Step(takes=0.070), Step(takes=0.001, error=REFUSED)])
    connector.then = Step(takes=0.050)
    pool = make_pool(clock, connector, 2, RetryPolicy(attempt_timeout=30.0, initial_interval=0.002))

    with pytest.raises(SidecarError) as info:
        await pool.connect(Deadline.start(clock, 0.100))

    error = info.value
    assert error.reason is FailureReason.CANNOT_CONNECT
    assert "engine 127.0.0.1:5 slot 2/2" in error.message
    assert "2 attempts" in error.message
    assert "startup deadline 0.1s" in error.message
    # The last error is the timeout of the second attempt, not the refusal before it.
    assert "not ready within" in error.message
    assert "refused" not in error.message
    assert all(call.timeout <= 0.030 + 1e-9 for call in connector.calls[1:])
    # Slot 1's channel does not leak, and the pool stays unusable.
    assert [channel.closed for channel in connector.channels] == [1]
    assert pool.size == 0
    with pytest.raises(SidecarError) as not_connected:
        pool.channel()
    assert not_connected.value.reason is FailureReason.ENGINE_SHUTDOWN


async def test_slot_one_failing_stops_before_the_others_are_tried() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock, then=Step(error=REFUSED))
    pool = make_pool(clock, connector, 3, RetryPolicy(initial_interval=0.01, max_interval=0.02))

    with pytest.raises(SidecarError) as info:
        await pool.connect(Deadline.start(clock, 0.2))

    assert "slot 1/3" in info.value.message
    assert "last error: ConnectionRefusedError: connection refused" in info.value.message
    # It used the deadline (less a final sliver too small for an attempt), and no more.
    assert 0.199 <= clock.now - 1000.0 <= 0.2 + 1e-9
    assert connector.channels == []
    assert f"gave up after {len(connector.calls)} attempts" in info.value.message


async def test_any_failing_slot_closes_every_channel_opened() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock, [Step(), Step()], then=Step(takes=1.0))
    pool = make_pool(clock, connector, 3, RetryPolicy())

    with pytest.raises(SidecarError) as info:
        await pool.connect(Deadline.start(clock, 0.5))

    assert "/3" in info.value.message
    assert len(connector.channels) == 2
    assert all(channel.closed == 1 for channel in connector.channels)


async def test_cancelling_connect_closes_the_channels_already_open() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock, [Step()], then=Step(forever=True))
    all_slots_tried = anyio.Event()

    async def watched(target: str, timeout: float) -> grpc.aio.Channel:
        if len(connector.calls) == 2:  # slot 1 is open and slot 2 hangs: this is slot 3
            all_slots_tried.set()
        return await connector(target, timeout)

    pool = ChannelPool(PoolConfig(ENDPOINT, connections=3), clock=clock, connector=watched)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(pool.connect, Deadline.start(clock, 100.0))
            await all_slots_tried.wait()
            group.cancel_scope.cancel()

    assert [channel.closed for channel in connector.channels] == [1]
    assert pool.size == 0


async def test_backoff_doubles_is_capped_and_never_sleeps_past_the_deadline() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock, then=Step(error=REFUSED))
    policy = RetryPolicy(attempt_timeout=1.0, max_interval=0.4, initial_interval=0.05)
    deadline = Deadline.start(clock, 2.0)

    with pytest.raises(SidecarError) as info:
        await retry_until_deadline(
            "engine x", attempt_with(connector), deadline, policy, rand=lambda: 0.999999
        )

    sleeps = clock.sleeps
    assert sleeps[:4] == pytest.approx([0.05, 0.1, 0.2, 0.4], rel=1e-5)
    assert all(pause <= 0.4 for pause in sleeps)
    assert sleeps[4:-1] == pytest.approx([0.4] * (len(sleeps) - 5), rel=1e-5)
    # The last pause is clamped to what was left, and nothing runs after the deadline.
    assert sleeps[-1] < 0.4
    assert sum(sleeps) == pytest.approx(2.0)
    assert deadline.remaining() == 0.0
    assert len(connector.calls) == len(sleeps)
    assert f"gave up after {len(sleeps)} attempts" in info.value.message
    assert "last error: ConnectionRefusedError: connection refused" in info.value.message


@pytest.mark.parametrize("rand", [0.0, 0.3, 0.999])
def test_jitter_stays_within_the_upper_half_of_the_capped_interval(rand: float) -> None:
    policy = RetryPolicy(max_interval=1.0, initial_interval=0.05)
    for failures, ceiling in [(1, 0.05), (2, 0.1), (3, 0.2), (5, 0.8), (6, 1.0), (500, 1.0)]:
        pause = backoff_interval(policy, failures, lambda: rand)
        assert ceiling / 2 <= pause <= ceiling


async def test_each_attempt_gets_the_smaller_of_its_timeout_and_what_is_left() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock, then=Step(takes=100.0))
    policy = RetryPolicy(attempt_timeout=3.0, initial_interval=0.05, max_interval=1.0)

    with pytest.raises(SidecarError) as info:
        await retry_until_deadline(
            "engine y", attempt_with(connector), Deadline.start(clock, 10.0), policy, rand=lambda: 0.0
        )

    # Pauses with rand=0 are half the ceiling: 0.025, 0.05, 0.1.
    timeouts = [call.timeout for call in connector.calls]
    assert timeouts == pytest.approx([3.0, 3.0, 3.0, 10.0 - 9.175])
    assert "last error: TimeoutError: not ready within 0.825s" in info.value.message


async def test_success_after_failures_returns_the_attempts_result() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock, [Step(error=REFUSED), Step(error=REFUSED)])

    channel = await retry_until_deadline(
        "engine z", attempt_with(connector), Deadline.start(clock, 5.0), RetryPolicy()
    )

    assert isinstance(channel, FakeChannel)
    assert len(connector.calls) == 3
    assert len(clock.sleeps) == 2


async def test_an_expired_deadline_makes_no_attempt() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock)
    deadline = Deadline.start(clock, 1.0)
    clock.advance(1.5)

    with pytest.raises(SidecarError) as info:
        await retry_until_deadline("engine e slot 1/1", attempt_with(connector), deadline, RetryPolicy())

    assert connector.calls == []
    assert "gave up after 0 attempts" in info.value.message
    assert info.value.message.endswith("; the startup deadline was exceeded")


async def test_an_attempt_ignoring_its_timeout_is_cut_in_real_time() -> None:
    async def stalls(timeout: float) -> None:
        await anyio.sleep_forever()

    policy = RetryPolicy(attempt_timeout=30.0)
    with pytest.raises(SidecarError) as info:
        await retry_until_deadline("engine h", stalls, Deadline.start(SystemClock(), 0.2), policy)

    assert info.value.reason is FailureReason.CANNOT_CONNECT
    assert "attempt timed out after" in info.value.message


async def test_channels_are_handed_out_round_robin_and_close_is_idempotent() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock)
    pool = make_pool(clock, connector, 3, RetryPolicy())
    await pool.connect(Deadline.start(clock, 1.0))

    picked = [pool.channel() for _ in range(7)]
    assert [channel.number for channel in picked] == [0, 1, 2, 0, 1, 2, 0]  # type: ignore[attr-defined]

    await pool.close()
    await pool.close()
    assert [channel.closed for channel in connector.channels] == [1, 1, 1]
    with pytest.raises(SidecarError) as info:
        pool.channel()
    assert info.value.reason is FailureReason.ENGINE_SHUTDOWN
    assert "closed" in info.value.message


async def test_channels_whose_connection_failed_are_passed_over_while_another_is_usable() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock)
    pool = make_pool(clock, connector, 3, RetryPolicy())
    await pool.connect(Deadline.start(clock, 1.0))
    dark = grpc.ChannelConnectivity.TRANSIENT_FAILURE
    connector.channels[1].state = dark

    picked = [pool.channel() for _ in range(4)]
    assert [channel.number for channel in picked] == [0, 2, 0, 2]  # type: ignore[attr-defined]

    # Every connection down: still round-robin (the call fails fast with UNAVAILABLE).
    for channel in connector.channels:
        channel.state = dark
    assert [pool.channel().number for _ in range(3)] == [0, 1, 2]  # type: ignore[attr-defined]
    await pool.close()


def test_a_pool_needs_at_least_one_connection() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ChannelPool(PoolConfig(ENDPOINT, connections=0))


async def test_no_channel_before_connect_and_no_connect_after_close() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock)
    pool = make_pool(clock, connector, 2, RetryPolicy())
    with pytest.raises(SidecarError, match="not connected") as before:
        pool.channel()
    assert before.value.reason is FailureReason.ENGINE_SHUTDOWN

    await pool.close()
    with pytest.raises(SidecarError, match="closed") as after:
        await pool.connect(Deadline.start(clock, 1.0))
    assert after.value.reason is FailureReason.ENGINE_SHUTDOWN
    assert connector.calls == []


async def test_connecting_twice_opens_no_more_channels() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock)
    pool = make_pool(clock, connector, 2, RetryPolicy())
    await pool.connect(Deadline.start(clock, 1.0))
    await pool.connect(Deadline.start(clock, 1.0))
    assert len(connector.channels) == 2
    assert pool.size == 2
    await pool.close()


async def test_closing_while_connecting_leaves_no_channel_open() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock)
    release = anyio.Event()

    async def slow_second_slot(target: str, timeout: float) -> grpc.aio.Channel:
        if connector.calls:  # slot 2 waits until close() has run
            await release.wait()
        return await connector(target, timeout)

    pool = ChannelPool(PoolConfig(ENDPOINT, connections=2), clock=clock, connector=slow_second_slot)

    async def close_then_release() -> None:
        await pool.close()
        release.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(close_then_release)
            with pytest.raises(SidecarError, match="closed") as info:
                await pool.connect(Deadline.start(clock, 10.0))

    assert info.value.reason is FailureReason.ENGINE_SHUTDOWN
    assert info.value.message == "the engine connection pool was closed"
    assert [channel.closed for channel in connector.channels] == [1, 1]
    assert pool.size == 0


@settings(deadline=None, max_examples=60)
@given(
    # Bounded so that no example needs more than a few hundred attempts (the test stays fast).
    deadline_secs=st.floats(min_value=0.01, max_value=5.0),
    initial=st.floats(min_value=0.01, max_value=1.0),
    cap=st.floats(min_value=0.05, max_value=5.0),
    attempt_timeout=st.floats(min_value=0.01, max_value=40.0),
    takes=st.floats(min_value=0.0, max_value=3.0),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_no_schedule_of_failures_outlives_the_deadline(
    deadline_secs: float, initial: float, cap: float, attempt_timeout: float, takes: float, seed: int
) -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock, then=Step(takes=takes, error=REFUSED))
    policy = RetryPolicy(attempt_timeout=attempt_timeout, max_interval=cap, initial_interval=initial)
    deadline = Deadline.start(clock, deadline_secs)
    rng = random.Random(seed)

    async def run() -> None:
        with pytest.raises(SidecarError) as info:
            await retry_until_deadline("e", attempt_with(connector), deadline, policy, rand=rng.random)
        assert info.value.reason is FailureReason.CANNOT_CONNECT

    anyio.run(run)
    assert clock.now - 1000.0 <= deadline_secs + 1e-9
    assert all(pause <= cap + 1e-12 for pause in clock.sleeps)
    assert all(call.timeout <= min(attempt_timeout, deadline_secs) + 1e-9 for call in connector.calls)


# --- what is retried: only what a starting engine produces ------------------------------------


def _rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "engine says so", None)


@pytest.mark.parametrize(
    "error",
    [
        ConnectionRefusedError("connection refused"),
        ConnectionResetError("connection reset by peer"),
        TimeoutError("not ready within 1s"),
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
        _rpc_error(grpc.StatusCode.UNAVAILABLE),
        _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED),
        NotReady("engine reports not healthy"),
        SidecarError(FailureReason.CANNOT_CONNECT, "GetModelInfo: connection reset (UNAVAILABLE)"),
        SidecarError(FailureReason.CONNECTION_TIMEOUT, "HealthCheck: no answer in 1s"),
    ],
    ids=lambda e: type(e).__name__ + (f"-{e.code().name}" if isinstance(e, grpc.aio.AioRpcError) else ""),
)
async def test_what_a_starting_engine_produces_is_retried_until_it_answers(error: Exception) -> None:
    clock = FakeClock()
    attempts = 0

    async def attempt(timeout: float) -> str:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise error
        return "up"

    result = await retry_until_deadline("engine s", attempt, Deadline.start(clock, 60.0), RetryPolicy())

    assert result == "up"
    assert attempts == 3
    assert len(clock.sleeps) == 2


@pytest.mark.parametrize(
    "bug",
    [
        TypeError("unsupported operand type(s) for +: 'int' and 'str'"),
        AttributeError("'NoneType' object has no attribute 'channel'"),
        KeyError("max_model_len"),
        ValueError("invalid literal for int() with base 10: 'x'"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_a_bug_ends_start_up_at_once_as_itself(bug: Exception) -> None:
    clock = FakeClock()
    attempts = 0

    async def attempt(timeout: float) -> None:
        nonlocal attempts
        attempts += 1
        raise bug

    with pytest.raises(type(bug)) as info:
        await retry_until_deadline("engine b", attempt, Deadline.start(clock, 1800.0), RetryPolicy())

    assert info.value is bug  # unchanged, traceback and all: not a CANNOT_CONNECT after 30 min
    assert attempts == 1
    assert clock.sleeps == []


async def test_a_definite_engine_answer_ends_start_up_at_once_typed() -> None:
    clock = FakeClock()
    attempts = 0

    async def attempt(timeout: float) -> None:
        nonlocal attempts
        attempts += 1
        raise _rpc_error(grpc.StatusCode.UNIMPLEMENTED)  # a gRPC server of another kind

    with pytest.raises(SidecarError) as info:
        await retry_until_deadline(
            "engine u (HealthCheck)", attempt, Deadline.start(clock, 60.0), RetryPolicy()
        )

    assert attempts == 1
    assert info.value.reason is FailureReason.UNKNOWN
    assert info.value.message == "engine u (HealthCheck): engine says so (UNIMPLEMENTED)"


async def test_a_typed_refusal_is_not_retried() -> None:
    clock = FakeClock()
    refusal = SidecarError(
        FailureReason.PROTOCOL_ERROR, "invalid sglang response: GET /health answered HTTP 404"
    )
    attempts = 0

    async def attempt(timeout: float) -> None:
        nonlocal attempts
        attempts += 1
        raise refusal

    with pytest.raises(SidecarError) as info:
        await retry_until_deadline("engine p", attempt, Deadline.start(clock, 60.0), RetryPolicy())

    assert info.value is refusal
    assert attempts == 1


async def test_a_bug_in_a_later_slot_fails_connect_as_itself_and_closes_every_channel() -> None:
    clock = FakeClock()
    bug = TypeError("'NoneType' object is not callable")
    connector = ScriptedConnector(clock, [Step(), Step(error=bug)], then=Step(takes=5.0))
    pool = make_pool(clock, connector, 3, RetryPolicy(attempt_timeout=10.0))

    with pytest.raises(TypeError) as info:
        await pool.connect(Deadline.start(clock, 1800.0))

    assert info.value is bug  # not wrapped in an ExceptionGroup by the slots' task group
    assert all(channel.closed == 1 for channel in connector.channels)
    assert pool.size == 0


async def test_the_give_up_message_counts_from_the_deadline_start_and_says_attempt_once() -> None:
    clock = FakeClock(now=1000.0)
    connector = ScriptedConnector(clock, then=Step(takes=1.0))

    with pytest.raises(SidecarError) as info:
        await retry_until_deadline(
            "engine e", attempt_with(connector), Deadline.start(clock, 0.1), RetryPolicy()
        )

    assert info.value.message == (
        "cannot connect to engine e: gave up after 1 attempt in 0.100s (startup deadline 0.1s, "
        "0.100s elapsed); last error: TimeoutError: not ready within 0.100s"
    )


def _rpc_error_saying(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)


@pytest.mark.parametrize(
    ("error", "described"),
    [
        (
            _rpc_error_saying(grpc.StatusCode.UNAVAILABLE, "engine warming up"),
            "UNAVAILABLE: engine warming up",
        ),
        (_rpc_error_saying(grpc.StatusCode.UNAVAILABLE, ""), "UNAVAILABLE: no details"),
        (ConnectionResetError(), "ConnectionResetError"),
        (REFUSED, "ConnectionRefusedError: connection refused"),
    ],
)
async def test_the_last_error_is_named_with_the_engines_own_words(error: Exception, described: str) -> None:
    clock = FakeClock()

    async def fails(timeout: float) -> None:
        clock.advance(0.6)
        raise error

    with pytest.raises(SidecarError) as info:
        await retry_until_deadline("engine e", fails, Deadline.start(clock, 1.0), RetryPolicy())

    assert info.value.message.endswith(f"; last error: {described}"), info.value.message


async def test_a_deadline_of_exactly_the_smallest_attempt_still_gets_its_attempt() -> None:
    clock = FakeClock(now=0.0)
    connector = ScriptedConnector(clock)

    await retry_until_deadline(
        "engine e", attempt_with(connector), Deadline.start(clock, 0.001), RetryPolicy()
    )

    assert [call.timeout for call in connector.calls] == [0.001]


def test_an_rpc_error_without_a_status_is_an_answer_not_a_transient_failure() -> None:
    assert not is_transient(grpc.RpcError())


async def test_a_pool_of_one_connection_serves_from_it() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock)
    pool = make_pool(clock, connector, 1, RetryPolicy())
    await pool.connect(Deadline.start(clock, 1.0))

    only = connector.channels[0]
    assert all(pool.channel() is cast(grpc.aio.Channel, only) for _ in range(2))
    await pool.close()


def test_the_pools_clock_is_the_one_given_or_the_systems() -> None:
    clock = FakeClock()
    assert ChannelPool(PoolConfig(ENDPOINT), clock=clock).clock is clock
    assert isinstance(ChannelPool(PoolConfig(ENDPOINT)).clock, SystemClock)


async def test_a_second_connect_while_the_first_runs_is_refused() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock, [Step(forever=True)])
    pool = make_pool(clock, connector, 1, RetryPolicy())
    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(pool.connect, Deadline.start(clock, 100.0))
            while not connector.calls:
                await anyio.lowlevel.checkpoint()
            with pytest.raises(RuntimeError) as info:
                await pool.connect(Deadline.start(clock, 100.0))
            assert str(info.value) == "ChannelPool.connect() is already running"
            group.cancel_scope.cancel()
    assert connector.channels == []


async def test_a_connect_that_failed_can_be_tried_again() -> None:
    clock = FakeClock()
    connector = ScriptedConnector(clock, [Step(takes=1.0)])
    pool = make_pool(clock, connector, 2, RetryPolicy())
    with pytest.raises(SidecarError):
        await pool.connect(Deadline.start(clock, 0.5))

    await pool.connect(Deadline.start(clock, 0.5))

    assert pool.size == 2
    await pool.close()


async def test_slot_one_answering_definitely_stops_the_pool_without_trying_the_others() -> None:
    clock = FakeClock()
    refusal = SidecarError(FailureReason.INVALID_ARGUMENT, "not an engine")
    connector = ScriptedConnector(clock, then=Step(error=refusal))
    pool = make_pool(clock, connector, 3, RetryPolicy())

    with pytest.raises(SidecarError) as info:
        await pool.connect(Deadline.start(clock, 60.0))

    assert info.value is refusal
    assert len(connector.calls) == 1


async def test_a_bug_in_one_slot_cancels_a_sibling_still_connecting() -> None:
    clock = FakeClock()
    bug = KeyError("slot")
    # Slot 1 opens, slot 2 hangs (only cancellation ends it), slot 3 is the bug.
    connector = ScriptedConnector(clock, [Step(), Step(forever=True), Step(error=bug)])
    pool = make_pool(clock, connector, 3, RetryPolicy(attempt_timeout=1000.0))

    with anyio.fail_after(5), pytest.raises(KeyError) as info:
        await pool.connect(Deadline.start(clock, 1800.0))

    assert info.value is bug
    assert [channel.closed for channel in connector.channels] == [1]


async def test_the_pools_refusals_say_whether_it_is_closed_or_not_yet_connected() -> None:
    clock = FakeClock()
    pool = make_pool(clock, ScriptedConnector(clock), 1, RetryPolicy())
    with pytest.raises(SidecarError) as before:
        pool.channel()
    assert before.value.message == "the engine connection pool is not connected"

    await pool.close()
    with pytest.raises(SidecarError) as after:
        pool.channel()
    assert after.value.message == "the engine connection pool is closed"
    with pytest.raises(SidecarError) as reconnect:
        await pool.connect(Deadline.start(clock, 1.0))
    assert reconnect.value.message == "the engine connection pool is closed"
