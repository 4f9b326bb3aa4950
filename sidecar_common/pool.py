"""Channel pool to the engine: N independent HTTP/2 connections, one shared startup
deadline, per-attempt timeouts and capped exponential backoff (docs/common.md).

The clock and the connector are injectable so the deadline arithmetic is testable without
sockets and without real sleeping: backoff sleeps go through ``Deadline.clock``. Each attempt
is additionally bounded in real time (anyio) so a peer that accepts TCP and never answers
cannot stall start-up, whatever the connector does with its timeout.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

import anyio
import grpc
import structlog
import tenacity

from sidecar_common.errors import FailureReason, SidecarError, from_rpc_error
from sidecar_common.message_size import GRPC_MAX_MESSAGE_BYTES

# The settings are plain data apart from this module (no grpc there, for the command lines);
# re-exported here, where the pool that reads them is.
from sidecar_common.pool_settings import PoolConfig, RetryPolicy
from sidecar_common.retry import Backoff

__all__ = [
    "CHANNEL_OPTIONS",
    "ChannelPool",
    "Clock",
    "Connector",
    "Deadline",
    "NotReady",
    "PoolConfig",
    "ReportSchedule",
    "RetryPolicy",
    "SystemClock",
    "backoff_interval",
    "connect_channel",
    "is_transient",
    "retry_until_deadline",
]

T = TypeVar("T")

_log = structlog.get_logger(__name__)


class Clock(Protocol):
    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


@dataclass(frozen=True)
class Deadline:
    """Fixed once, before the first attempt; shared by every slot, the health wait and the
    discovery calls."""

    clock: Clock
    started_at: float
    seconds: float

    @classmethod
    def start(cls, clock: Clock, seconds: float) -> Deadline:
        return cls(clock, clock.monotonic(), seconds)

    def remaining(self) -> float:
        return max(0.0, self.started_at + self.seconds - self.clock.monotonic())

    def elapsed(self) -> float:
        return self.clock.monotonic() - self.started_at


CHANNEL_OPTIONS: Final[Sequence[tuple[str, Any]]] = (
    # Without a private subchannel pool, every channel to one target shares one TCP
    # connection and the pool would multiplex N "channels" over a single HTTP/2 session.
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
    # gRPC servers by default strike pings that arrive less than 5 minutes apart while they
    # send no data (and GOAWAY after two strikes, killing in-flight calls), so probe no more
    # often than that, and only while calls are open.
    ("grpc.keepalive_time_ms", 300_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 0),
    # BDP probing grows each stream's receive window without bound, so an engine streaming
    # to a frontend that reads slowly would pile the generation up in this process. With it
    # off the window stays at HTTP/2's default and the relay's bounded buffer paces the engine.
    ("grpc.http2.bdp_probe", 0),
    # A fixed window instead, 4x HTTP/2's 64 KiB: SGLang's cumulative streaming restates the
    # whole output (and its logprobs) in every message, ~140 KiB at 2,048 tokens. Messages
    # larger than the window stall mid-message for a WINDOW_UPDATE round trip, which made the
    # hop's CPU per token grow with the output length (bench/sglang_growth.py: +16 % from 256
    # to 2,048 tokens with 64 KiB, +7 % with this). Still bounded: at most this much per
    # stream waits in grpc for a slow frontend.
    ("grpc.http2.lookahead_bytes", 256 * 1024),
    # Read such messages in a few large reads rather than many 8 KiB ones (one per endpoint,
    # not per stream).
    ("grpc.experimental.tcp_min_read_chunk_size", 256 * 1024),
    # After an engine restart, grpc's reconnect backoff grows to 120 s by default: a channel
    # could stay dark for minutes after health is back. Cap it at a second.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)

_DARK: Final = frozenset({grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN})

# (target "host:port", attempt timeout in seconds) -> a channel that is READY.
Connector = Callable[[str, float], Awaitable[grpc.aio.Channel]]


async def connect_channel(
    target: str, timeout: float, *, credentials: grpc.ChannelCredentials | None = None
) -> grpc.aio.Channel:
    """The default connector: one channel with its own TCP connection (plaintext, or TLS with
    ``credentials``), READY within ``timeout`` or closed. A refused or reset connection (or a
    failed TLS handshake) fails the attempt at once (the pool's backoff decides when to try
    again, not grpc's internal reconnect timer)."""
    channel = (
        grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        if credentials is None
        else grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
    )
    state = grpc.ChannelConnectivity.IDLE
    try:
        with anyio.move_on_after(timeout):
            state = channel.get_state(try_to_connect=True)
            while state is not grpc.ChannelConnectivity.READY:
                if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                    raise ConnectionError(
                        f"connection to {target} failed (refused, reset, or not speaking HTTP/2)"
                    )
                if state is grpc.ChannelConnectivity.SHUTDOWN:
                    raise ConnectionError(f"channel to {target} was shut down")
                await channel.wait_for_state_change(state)
                state = channel.get_state(try_to_connect=True)
            return channel
        # Stuck in CONNECTING usually means TCP is accepted but nothing answers HTTP/2.
        raise TimeoutError(f"{target} was not ready within {timeout:.3f}s (channel {state.name})")
    except BaseException:
        with anyio.CancelScope(shield=True):
            await channel.close(None)
        raise


def backoff_interval(policy: RetryPolicy, failures: int, rand: Callable[[], float]) -> float:
    """The pause after the ``failures``-th failed attempt, before the deadline clamp: the
    project's one :class:`~sidecar_common.retry.Backoff` from ``initial_interval`` up to
    ``max_interval``, so N slots failing together do not retry in lockstep."""
    return Backoff(policy.initial_interval, policy.max_interval).pause(failures, rand)


# A sliver of deadline left after a clamped pause is not worth an attempt whose only
# possible outcome is a timeout that would hide the previous, more telling error.
_MIN_ATTEMPT_SECS: Final = 0.001
_ENFORCEMENT_GRACE_SECS: Final = 0.05


class NotReady(Exception):
    """The engine answered but is not ready yet (a not-serving health status, an HTTP 5xx):
    retried within the start-up deadline."""


# What an engine that is still starting (or restarting) answers over gRPC.
_TRANSIENT_CODES: Final = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_TRANSIENT_REASONS: Final = frozenset({FailureReason.CANNOT_CONNECT, FailureReason.CONNECTION_TIMEOUT})


def is_transient(error: BaseException) -> bool:
    """Worth another attempt: what an engine that is still starting produces (connection
    refused or reset and other socket errors, timeouts, UNAVAILABLE, DEADLINE_EXCEEDED, a
    not-ready answer). Anything else is an answer (a server of another kind) or a bug in
    the sidecar, and retrying it for the whole deadline would only hide it."""
    if isinstance(error, OSError | NotReady | _AttemptTimedOut):
        return True  # OSError covers ConnectionError, TimeoutError and name resolution
    if isinstance(error, grpc.RpcError):
        code = getattr(error, "code", None)
        return callable(code) and code() in _TRANSIENT_CODES
    if isinstance(error, SidecarError):
        return error.reason in _TRANSIENT_REASONS
    return False


class _AttemptTimedOut(Exception):
    def __init__(self, timeout: float) -> None:
        super().__init__(f"attempt timed out after {timeout:.3f}s")


class _DeadlineReached(Exception):
    """Raised instead of an attempt when nothing of the deadline is left."""


class _BackoffUntilDeadline(tenacity.wait.wait_base):
    def __init__(self, policy: RetryPolicy, deadline: Deadline, rand: Callable[[], float]) -> None:
        self._policy = policy
        self._deadline = deadline
        self._rand = rand

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        pause = backoff_interval(self._policy, retry_state.attempt_number, self._rand)
        return min(pause, self._deadline.remaining())


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details() or 'no details'}"
    if isinstance(error, SidecarError):
        return f"{error.reason.value}: {error.message}"
    if isinstance(error, _AttemptTimedOut):
        return str(error)
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# While an engine does not answer, the wait is said at once, then after 2 s, 4 s... never more
# than 30 s apart: an operator sees where it dials and why it fails within seconds, and a
# model that loads for ten minutes costs about twenty lines, not one per attempt.
_FIRST_REPORT_SECS: Final = 2.0
_MAX_REPORT_SECS: Final = 30.0
# An attempt running longer than this is reported as hanging rather than by the last failure.
_HANGING_SECS: Final = 1.0


@dataclass
class ReportSchedule:
    """When a wait that keeps failing is reported: the first time at once, then after
    ``first`` seconds, the interval doubling up to ``cap``. Pure: the caller passes the time."""

    first: float = _FIRST_REPORT_SECS
    cap: float = _MAX_REPORT_SECS
    _next_at: float | None = None
    _interval: float = 0.0

    def due(self, now: float) -> float | None:
        """None when no report is due at ``now``; else the interval to the next one (the
        report is then considered made)."""
        if self._next_at is None:
            self._interval = self.first
        elif now >= self._next_at:
            self._interval = min(self._interval * 2, self.cap)
        else:
            return None
        self._next_at = now + self._interval
        return self._interval

    def wait(self, now: float) -> float:
        """Seconds until the next report may be due (``first`` before any)."""
        return self.first if self._next_at is None else max(0.0, self._next_at - now)


class _WaitReporter:
    """Says, at the ReportSchedule's pace, where a retry loop dials and why it has not
    succeeded yet: after a failed attempt, and while an attempt hangs (a peer that accepts the
    connection and never answers would otherwise be silent for the whole attempt timeout)."""

    def __init__(self, what: str, deadline: Deadline, peer: str = "engine") -> None:
        self._what = what
        self._peer = peer
        self._deadline = deadline
        self._schedule = ReportSchedule()
        self._last_error: str | None = None

    def failed(self, error: BaseException, attempts: int) -> None:
        self._last_error = _describe(error)
        self._report(attempts, error=self._last_error)

    def watch(self, attempts: int) -> Callable[[], None]:
        """Report the attempt now starting while it hangs; returns what stops that (call it
        when the attempt ends). A timer on the event loop, not a task: a task group around the
        attempt would add a checkpoint after it succeeded, where a cancellation could drop
        what it opened (a channel nobody would close)."""
        clock = self._deadline.clock
        started_at = clock.monotonic()
        loop = asyncio.get_running_loop()

        timers: list[asyncio.TimerHandle] = []

        def fire() -> None:
            running = clock.monotonic() - started_at
            if running >= _HANGING_SECS or self._last_error is None:
                self._report(attempts, error=f"no answer yet (attempt running for {running:.1f}s)")
            else:
                # Attempts that fail quickly: the last failure says why.
                self._report(attempts - 1, error=self._last_error)
            # Loop time, not the injectable clock: a test clock standing still must not spin.
            timers[0] = loop.call_later(self._schedule.wait(clock.monotonic()), fire)

        timers.append(loop.call_later(self._schedule.wait(started_at), fire))

        def stop() -> None:
            timers[0].cancel()

        return stop

    def _report(self, attempts: int, *, error: str) -> None:
        deadline = self._deadline
        interval = self._schedule.due(deadline.clock.monotonic())
        if interval is None:
            return
        _log.warning(
            f"waiting for {self._peer}",
            dialling=self._what,
            error=error,
            attempts=attempts,
            waited_secs=round(deadline.elapsed(), 3),
            deadline_left_secs=round(deadline.remaining(), 3),
            next_report_secs=interval,
        )


async def retry_until_deadline(
    what: str,
    attempt: Callable[[float], Awaitable[T]],
    deadline: Deadline,
    policy: RetryPolicy,
    *,
    rand: Callable[[], float] = random.random,
    transient: Callable[[BaseException], bool] = is_transient,
    peer: str = "engine",
) -> T:
    """Call ``attempt(timeout)`` until it returns, each bounded by min(attempt_timeout,
    remaining); back off with jitter between attempts, capped, never past the deadline.
    On failure raise SidecarError(CANNOT_CONNECT) naming ``what``, the deadline, the
    attempts, the time spent and the last underlying error.

    Only ``transient`` failures are retried (:func:`is_transient`, which a transport
    extends with its own connection errors). Any other failure ends at once: an engine
    call's status as its typed error, a SidecarError as it is, and anything else (a bug:
    TypeError, KeyError...) raised unchanged so that it surfaces with its traceback.
    ``rand`` (uniform in [0, 1)) drives the jitter; tests fix it.
    """
    clock = deadline.clock
    began = clock.monotonic()
    attempts = 0
    last: Exception | None = None
    reporter = _WaitReporter(what, deadline, peer)

    async def one_attempt() -> T:
        nonlocal attempts, last
        timeout = min(policy.attempt_timeout, deadline.remaining())
        if timeout < _MIN_ATTEMPT_SECS:
            raise _DeadlineReached
        attempts += 1
        try:
            # The attempt is told its timeout and should honour it with its own, more telling
            # error; this bound (a hair later, so the attempt's error wins) catches one that
            # does not.
            stop_watching = reporter.watch(attempts)
            try:
                with anyio.move_on_after(timeout + _ENFORCEMENT_GRACE_SECS):
                    return await attempt(timeout)
            finally:
                stop_watching()
            raise _AttemptTimedOut(timeout)
        except Exception as error:
            last = error
            if transient(error):
                reporter.failed(error, attempts)
            raise

    # No stop condition: the deadline ends the loop, since once it has passed the backoff
    # waits 0 and the next attempt raises _DeadlineReached, which is never retried.
    retrying = tenacity.AsyncRetrying(
        sleep=clock.sleep,
        wait=_BackoffUntilDeadline(policy, deadline, rand),
        retry=tenacity.retry_if_exception(lambda e: not isinstance(e, _DeadlineReached) and transient(e)),
    )
    try:
        return await retrying(one_attempt)
    except _DeadlineReached:
        pass
    except grpc.RpcError as error:
        # A definite answer (UNIMPLEMENTED from a server of another kind...): typed, at once.
        raise from_rpc_error(what, error) from None
    cause = f"last error: {_describe(last)}" if last is not None else "the startup deadline was exceeded"
    raise SidecarError(
        FailureReason.CANNOT_CONNECT,
        f"cannot connect to {what}: gave up after {attempts} attempt{'' if attempts == 1 else 's'} "
        f"in {clock.monotonic() - began:.3f}s (startup deadline {deadline.seconds:g}s, "
        f"{deadline.elapsed():.3f}s elapsed); {cause}",
    ) from last


class ChannelPool:
    """N channels to the engine, each its own TCP connection; calls pick one round-robin."""

    def __init__(
        self,
        config: PoolConfig,
        *,
        clock: Clock | None = None,
        connector: Connector | None = None,
    ) -> None:
        if config.connections < 1:
            raise ValueError(f"connections must be at least 1, got {config.connections}")
        self._config = config
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._connector: Connector = connector if connector is not None else connect_channel
        self._channels: list[grpc.aio.Channel] = []
        self._next = 0
        self._closed = False
        self._connecting = False

    @property
    def config(self) -> PoolConfig:
        return self._config

    @property
    def clock(self) -> Clock:
        """The pool's clock; ``Deadline.start(pool.clock, ...)`` for the shared deadline."""
        return self._clock

    @property
    def size(self) -> int:
        """How many channels are open: ``config.connections`` once connected, else 0."""
        return len(self._channels)

    async def connect(self, deadline: Deadline) -> None:
        """Slot 1 first, then the rest concurrently, all within ``deadline``."""
        if self._closed:
            raise SidecarError(
                FailureReason.ENGINE_SHUTDOWN, f"the {self._config.peer} connection pool is closed"
            )
        if self._channels:
            return
        n = self._config.connections
        opened: list[grpc.aio.Channel | None] = [None] * n
        failure: Exception | None = None

        async def open_slot(index: int, scope: anyio.CancelScope | None) -> None:
            nonlocal failure
            target = self._config.endpoint.target
            try:
                opened[index] = await retry_until_deadline(
                    f"{self._config.peer} {target} slot {index + 1}/{n}",
                    lambda timeout: self._connector(target, timeout),
                    deadline,
                    self._config.retry,
                    peer=self._config.peer,
                )
            except Exception as error:
                # The first failure (typed, or a bug raised as it is) is the one reported,
                # unwrapped from the task group; it also stops the sibling slots.
                if failure is None:
                    failure = error
                if scope is not None:
                    scope.cancel()

        if self._connecting:
            raise RuntimeError("ChannelPool.connect() is already running")
        self._connecting = True
        try:
            await open_slot(0, None)
            if failure is None and n > 1:
                async with anyio.create_task_group() as group:
                    for index in range(1, n):
                        group.start_soon(open_slot, index, group.cancel_scope)
        finally:
            self._connecting = False
            if failure is not None or self._closed or any(channel is None for channel in opened):
                await _close_all([channel for channel in opened if channel is not None])
        if failure is not None:
            raise failure
        if self._closed:
            # close() ran while the slots were connecting (shutdown during start-up).
            raise SidecarError(
                FailureReason.ENGINE_SHUTDOWN, f"the {self._config.peer} connection pool was closed"
            )
        self._channels = [channel for channel in opened if channel is not None]

    def channel(self) -> grpc.aio.Channel:
        """The next channel, round-robin, passing over channels whose connection has failed
        (still in reconnect backoff) while another one is usable: after an engine restart the
        first reconnected channel serves every call until the others are back."""
        channels = self._channels
        if not channels:
            state = "closed" if self._closed else "not connected"
            raise SidecarError(
                FailureReason.ENGINE_SHUTDOWN, f"the {self._config.peer} connection pool is {state}"
            )
        count = len(channels)
        first = self._next
        for step in range(count):
            index = (first + step) % count
            if channels[index].get_state(try_to_connect=False) not in _DARK:
                self._next = (index + 1) % count
                return channels[index]
        # Every connection is down: the call fails fast with the engine's UNAVAILABLE.
        self._next = (first + 1) % count
        return channels[first]

    async def close(self, grace: float | None = None) -> None:
        """Close every channel; later calls do nothing. In-flight calls are cancelled, at
        once, or with ``grace`` once they end or ``grace`` seconds have passed (no new call
        starts on a closing channel). Cancelling the wait cancels the calls at once."""
        self._closed = True
        channels, self._channels = self._channels, []
        try:
            if grace:
                async with anyio.create_task_group() as group:
                    for channel in channels:
                        group.start_soon(channel.close, grace)
        finally:
            await _close_all(channels)


async def _close_all(channels: Sequence[grpc.aio.Channel]) -> None:
    # Shielded: closing must finish even when the caller is being cancelled, or the
    # channels' sockets and polling tasks would outlive their owner.
    with anyio.CancelScope(shield=True):
        for channel in channels:
            await channel.close(None)
