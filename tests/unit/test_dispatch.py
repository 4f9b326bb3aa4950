"""Private ids, the stream-shape tracker, CANCELLED terminals and the registry."""

from __future__ import annotations

import asyncio
import time

import anyio
import anyio.lowlevel
import pytest
import structlog
import structlog.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_server.dispatch import (
    PRIVATE_ID_HEAD_LEN,
    CancelCause,
    ChoiceTracker,
    Generation,
    PrivateIds,
    Registry,
    choice_count,
    make_private_id,
    run_to_completion,
)
from sidecar_server.engine import GenerateCall
from sidecar_server.metrics import Metrics
from sidecar_server.relay import RelayConfig, _gather_turns, relay
from tests.fake_engine import HANG, FakeEngine, Gate, terminal, tokens

Out = sidecar_pb2.LLMEngineOutput


@settings(deadline=None)
@given(st.lists(st.text(), min_size=2, max_size=30))
def test_private_ids_are_unique_and_prefix_free_whatever_the_public_ids(public_ids: list[str]) -> None:
    gen = PrivateIds()
    ids = [gen.next(p) for p in public_ids]
    assert len(set(ids)) == len(ids)
    for a in ids:
        for b in ids:
            assert a == b or not b.startswith(a)


@given(st.text(), st.integers(0, (1 << 48) - 1))
def test_private_id_shape(public_id: str, counter: int) -> None:
    pid = make_private_id("0123abcd", counter, public_id)
    assert len(pid) <= PRIVATE_ID_HEAD_LEN + 1 + 64
    assert pid[PRIVATE_ID_HEAD_LEN] == "-"
    assert pid.isascii()
    assert not any(c.isspace() for c in pid)


def test_private_id_keeps_a_readable_public_tail() -> None:
    assert make_private_id("0123abcd", 5, "req-1").endswith("000000000005-req-1")
    assert make_private_id("0123abcd", 5, "a/b c").endswith("-a_b_c")


def test_choice_count() -> None:
    req = sidecar_pb2.PreprocessedRequest()
    assert choice_count(req) == 1
    req.sampling_options.n = 3
    assert choice_count(req) == 3


def test_tracker_completes_after_every_terminal() -> None:
    tracker = ChoiceTracker("fake", 2)
    tracker.observe(Out(index=1))
    assert not tracker.saw_token_or_terminal
    tracker.observe(Out(index=1, token_ids=[1], finish_reason=sidecar_pb2.EOS))
    assert tracker.saw_token_or_terminal
    assert not tracker.complete
    tracker.observe(Out(index=0, finish_reason=sidecar_pb2.LENGTH))
    assert tracker.complete


@pytest.mark.parametrize(
    ("chunks", "what"),
    [
        ([Out(index=2)], "choice index 2 with n=2"),
        ([Out(index=0, finish_reason=sidecar_pb2.EOS), Out(index=0)], "chunk after the terminal of choice 0"),
    ],
)
def test_tracker_refuses_malformed_streams(chunks: list[Out], what: str) -> None:
    tracker = ChoiceTracker("fake", 2)
    for c in chunks[:-1]:
        tracker.observe(c)
    with pytest.raises(SidecarError) as info:
        tracker.observe(chunks[-1])
    assert info.value.reason is FailureReason.PROTOCOL_ERROR
    assert info.value.message == f"invalid fake response: {what}"


def test_cancelled_terminals_count_what_was_delivered() -> None:
    tracker = ChoiceTracker("fake", 3)
    for out in (
        Out(index=0, token_ids=[1, 2]),
        Out(index=1, token_ids=[5], finish_reason=sidecar_pb2.EOS),
        Out(index=0, token_ids=[3]),
        Out(index=2, token_ids=[8, 9]),
    ):
        tracker.observe(out)
    # The last chunk arrived but was never written: only what was written counts.
    for out in (
        Out(index=0, token_ids=[1, 2]),
        Out(index=1, token_ids=[5], finish_reason=sidecar_pb2.EOS),
        Out(index=0, token_ids=[3]),
    ):
        tracker.delivered(out)
    assert tracker.completion_tokens == 4
    terms = tracker.cancelled_terminals(prompt_tokens=4)
    assert [(t.index, t.finish_reason) for t in terms] == [
        (0, sidecar_pb2.CANCELLED),
        (2, sidecar_pb2.CANCELLED),
    ]
    assert terms[0].completion_usage == sidecar_pb2.CompletionUsage(
        prompt_tokens=4, completion_tokens=3, total_tokens=7
    )
    assert terms[1].completion_usage.completion_tokens == 0


def test_every_terminal_arrived_is_not_every_terminal_delivered() -> None:
    # Arrived: the engine request is over (never abort). Delivered: the call ends OK.
    tracker = ChoiceTracker("fake", 2)
    first = Out(index=0, token_ids=[1], finish_reason=sidecar_pb2.EOS)
    second = Out(index=1, finish_reason=sidecar_pb2.LENGTH)
    tracker.observe(first)
    tracker.observe(second)
    assert tracker.complete
    assert not tracker.delivered_all
    tracker.delivered(first)
    assert not tracker.delivered_all
    tracker.delivered(second)
    assert tracker.delivered_all
    assert tracker.last_finish_reason() == "LENGTH"
    assert tracker.cancelled_terminals(prompt_tokens=1) == []


async def test_registry_abort_public_cancels_only_that_id() -> None:
    reg = Registry()
    a1, a2, b = reg.register("a"), reg.register("a"), reg.register("b")
    assert reg.inflight == 3
    assert await reg.abort_public("a", grace=5.0) == 2
    assert await reg.abort_public("nobody", grace=5.0) == 0
    assert a1.scope.cancel_called
    assert a2.scope.cancel_called
    assert a1.cause is CancelCause.ABORT_RPC
    assert not b.scope.cancel_called
    assert reg.cancel_all() == 3
    # The first cause wins: an aborted request stays "aborted" during a drain.
    assert a1.cause is CancelCause.ABORT_RPC
    assert b.cause is CancelCause.DRAIN


async def test_an_abort_of_a_generation_that_wants_one_answer_asks_the_engine_and_sets_a_deadline() -> None:
    """The engine's answer to its abort carries the tokens made so far; the relay is left to
    deliver it, and is cancelled only if it has not ended by the grace."""
    reg = Registry()
    answering, streaming = reg.register("a"), reg.register("a")
    engine_aborts: list[str] = []

    async def abort_on_engine() -> None:
        engine_aborts.append(answering.private_id)

    answering.answer_on_abort = abort_on_engine
    before = anyio.current_time()
    assert await reg.abort_public("a", grace=5.0) == 2
    assert engine_aborts == [answering.private_id]
    assert not answering.scope.cancel_called
    assert answering.cause is CancelCause.ABORT_RPC
    assert before + 5.0 <= answering.scope.deadline <= anyio.current_time() + 5.0
    assert streaming.scope.cancel_called
    assert streaming.scope.deadline == float("inf")


async def test_registry_wait_idle() -> None:
    reg = Registry()
    assert await reg.wait_idle(0.01)
    entry = reg.register("x")
    assert not await reg.wait_idle(0.01)
    async with anyio.create_task_group() as tg:

        async def later() -> None:
            await anyio.sleep(0.01)
            reg.unregister(entry)

        tg.start_soon(later)
        assert await reg.wait_idle(5)
    assert reg.inflight == 0


async def test_registry_wait_idle_works_for_every_drain_not_only_the_first() -> None:
    reg = Registry()
    for round_ in range(3):
        entry = reg.register(f"r{round_}")
        async with anyio.create_task_group() as tg:
            waited = anyio.Event()

            async def wait(result: list[bool], done: anyio.Event = waited) -> None:
                result.append(await reg.wait_idle(5))
                done.set()

            result: list[bool] = []
            tg.start_soon(wait, result)
            await anyio.wait_all_tasks_blocked()
            reg.unregister(entry)
            await waited.wait()
        assert result == [True], f"drain {round_ + 1}"


# --- relay: the coalescing writer and its backpressure, driven without gRPC ---------------


def _generation(engine: FakeEngine, request_id: str = "r") -> Generation:
    req = sidecar_pb2.PreprocessedRequest(request_id=request_id, token_ids=[1])
    return Generation(engine, GenerateCall(req, PrivateIds("0123abcd").next(request_id)))


async def test_relay_merges_what_queued_while_the_frontend_was_busy() -> None:
    engine = FakeEngine(scripts={"r": [tokens(i) for i in range(20)] + [terminal(20)]})
    gen = _generation(engine)
    release = anyio.Event()
    sent: list[Out] = []

    async def slow_write(out: Out) -> None:
        sent.append(out)
        if len(sent) == 1:
            # The frontend is busy until the engine has produced ten more chunks.
            await engine.wait_for("yield", 11)
            release.set()

    metrics = Metrics("fake")
    await relay(gen, slow_write, RelayConfig(capacity=32), metrics=metrics)
    assert release.is_set()
    assert [t for o in sent for t in o.token_ids] == list(range(21))
    assert sent[-1].finish_reason == sidecar_pb2.EOS
    assert len(sent) < 12
    assert list(sent[1].token_ids) == list(range(1, len(sent[1].token_ids) + 1))
    assert len(sent[1].token_ids) >= 10
    merges = metrics.registry.get_sample_value("sidecar_coalesced_merges_total", {"engine": "fake"})
    assert merges == 21 - len(sent)
    assert engine.aborts == []


async def test_relay_stops_reading_the_engine_when_the_frontend_does_not_drain() -> None:
    engine = FakeEngine(scripts={"r": [tokens(i) for i in range(1000)] + [terminal(1000)]})
    gen = _generation(engine)
    stuck = anyio.Event()

    async def stuck_write(out: Out) -> None:
        stuck.set()
        await anyio.sleep_forever()

    capacity = 8
    with anyio.move_on_after(0.3):
        await relay(gen, stuck_write, RelayConfig(capacity=capacity))
    assert stuck.is_set()
    yielded = sum(1 for kind, _ in engine.events if kind == "yield")
    # One chunk in the writer's hands, a full buffer, and one the pump holds while blocked.
    assert yielded <= capacity + 2
    # The frontend went away: the unfinished generation is aborted once, then closed.
    assert engine.aborts == [gen.private_id]
    assert engine.events[-2:] == [("abort", gen.private_id), ("closed", gen.private_id)]


async def test_relay_raises_the_engine_error_after_the_prefix() -> None:
    boom = SidecarError(FailureReason.OVERLOADED, "Generate: busy (RESOURCE_EXHAUSTED)")
    engine = FakeEngine(scripts={"r": [tokens(1), tokens(2), boom]})
    gen = _generation(engine)
    sent: list[int] = []

    async def write(out: Out) -> None:
        sent.extend(out.token_ids)

    with pytest.raises(SidecarError) as info:
        await relay(gen, write, RelayConfig())
    assert info.value is boom
    assert sent == [1, 2]
    assert engine.aborts == [gen.private_id]


async def test_abort_once_is_bounded_and_happens_once() -> None:
    engine = FakeEngine(abort_hangs=True)
    gen = _generation(engine)
    gen = Generation(engine, gen.call, abort_timeout=0.05)
    await gen.abort_once()
    await gen.abort_once()
    assert gen.aborted
    assert engine.aborts == [gen.private_id]


async def test_a_completed_generation_is_never_aborted() -> None:
    engine = FakeEngine()
    gen = _generation(engine)
    async for out in gen.stream():
        gen.tracker.observe(out)
    await gen.abort_once()
    assert engine.aborts == []


@pytest.mark.parametrize("loaded", [False, True])
async def test_relay_merges_only_under_load(loaded: bool) -> None:
    engine = FakeEngine(scripts={"r": [tokens(i) for i in range(40)] + [terminal(40)]})
    gen = _generation(engine)
    sent: list[Out] = []

    async def write(out: Out) -> None:
        sent.append(out)

    await relay(gen, write, RelayConfig(), under_load=lambda: loaded)
    assert [t for o in sent for t in o.token_ids] == list(range(41))
    if loaded:
        assert len(sent) < 41
    else:
        # Idle: each chunk goes out as it comes, never held back for company.
        assert len(sent) == 41


async def test_relay_under_load_keeps_gathering_while_chunks_keep_coming_but_bounded() -> None:
    # The fake engine yields one chunk per loop turn: a burst the writer should ride, but
    # never past max_busy_turns per message, nor past a full buffer.
    engine = FakeEngine(scripts={"r": [tokens(i) for i in range(60)] + [terminal(60)]})
    gen = _generation(engine)
    sent: list[Out] = []

    async def write(out: Out) -> None:
        sent.append(out)

    config = RelayConfig(capacity=32, busy_turns=1, max_busy_turns=5, patience=2)
    await relay(gen, write, config, under_load=lambda: True)
    assert [t for o in sent for t in o.token_ids] == list(range(61))
    assert sent[-1].finish_reason == sidecar_pb2.EOS
    assert sum(o.finish_reason != sidecar_pb2.UNSPECIFIED for o in sent) == 1
    # Merged well beyond one chunk per message, yet each message gathered at most what
    # arrived during its bounded turns (one chunk per turn, plus the one that woke it).
    assert len(sent) <= 61 // 3
    assert max(len(o.token_ids) for o in sent) <= config.max_busy_turns + 2


async def test_relay_when_idle_sends_each_chunk_without_gathering_turns() -> None:
    # Not under load and no backlog: the writer takes the buffer as soon as it wakes.
    engine = FakeEngine(scripts={"r": [tokens(i) for i in range(10)] + [terminal(10)]})
    gen = _generation(engine)
    sent: list[Out] = []

    async def write(out: Out) -> None:
        sent.append(out)

    config = RelayConfig(busy_turns=8, max_busy_turns=8, patience=8)
    await relay(gen, write, config, under_load=lambda: False)
    assert len(sent) == 11


class _ScriptedBuffer:
    """What the writer's gathering reads of the relay buffer: how many chunks are queued, read
    once before the first loop turn and once after each (the script's last value repeats),
    and whether it is full (from ``full_after`` turns on)."""

    def __init__(self, lengths: list[int], full_after: int | None = None) -> None:
        self.lengths = lengths
        self.reads = 0
        self.full_after = full_after

    def __len__(self) -> int:
        value = self.lengths[min(self.reads, len(self.lengths) - 1)]
        self.reads += 1
        return value

    @property
    def full(self) -> bool:
        return self.full_after is not None and self.reads - 1 >= self.full_after


@pytest.mark.parametrize(
    ("least", "most", "patience", "lengths", "full_after", "turns"),
    [
        pytest.param(2, 10, 2, [1], None, 2, id="idle-buffer-waits-least-and-patience"),
        pytest.param(1, 10, 2, [1, 2, 3, 4], None, 5, id="waits-while-chunks-keep-coming"),
        pytest.param(1, 4, 2, list(range(1, 20)), None, 4, id="never-more-than-most"),
        pytest.param(5, 10, 1, [1], None, 5, id="always-at-least-least"),
        pytest.param(5, 10, 1, list(range(1, 20)), 2, 2, id="a-full-buffer-ends-it"),
        pytest.param(1, 10, 2, [1, 1, 2, 2, 2], None, 4, id="a-new-chunk-resets-patience"),
    ],
)
async def test_the_writer_gathers_loop_turns_by_its_rule(
    least: int, most: int, patience: int, lengths: list[int], full_after: int | None, turns: int
) -> None:
    buffer = _ScriptedBuffer(lengths, full_after)
    await _gather_turns(buffer, least, most, patience)  # type: ignore[arg-type]
    assert buffer.reads - 1 == turns


async def test_a_cancel_during_a_cleanup_waits_for_it_then_is_raised() -> None:
    started, release = anyio.Event(), anyio.Event()
    finished: list[bool] = []

    async def cleanup() -> None:
        started.set()
        await release.wait()
        finished.append(True)

    outer = asyncio.ensure_future(run_to_completion(cleanup()))
    await started.wait()
    outer.cancel()
    await anyio.wait_all_tasks_blocked()
    assert not outer.done(), "the cancel must wait for the cleanup"
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert finished == [True]


async def test_a_cancel_landing_as_the_cleanup_finishes_is_not_swallowed() -> None:
    outer: asyncio.Future[None] | None = None

    async def cleanup_that_is_cancelled_at_its_end() -> None:
        await anyio.lowlevel.checkpoint()
        assert outer is not None
        outer.cancel()  # grpc cancelling the handler just as the cleanup returns

    outer = asyncio.ensure_future(run_to_completion(cleanup_that_is_cancelled_at_its_end()))
    with pytest.raises(asyncio.CancelledError):
        await outer


@pytest.mark.parametrize(
    ("engine", "outcome", "logged"),
    [
        (FakeEngine(), "ok", []),
        (
            FakeEngine(abort_error=ConnectionResetError("reset")),
            "failed",
            [("engine abort failed", {"error": "ConnectionResetError('reset')"})],
        ),
        (FakeEngine(abort_hangs=True), "timed_out", [("engine abort timed out", {"timeout": 0.05})]),
    ],
    ids=["ok", "failed", "timed_out"],
)
async def test_how_an_engine_abort_ended_is_kept_and_logged(
    engine: FakeEngine, outcome: str, logged: list[tuple[str, dict[str, object]]]
) -> None:
    with structlog.testing.capture_logs() as logs:
        gen = Generation(engine, _generation(engine).call, abort_timeout=0.05)
        await gen.abort_once()
    assert gen.abort_outcome == outcome
    warnings = [
        (entry["event"], {k: v for k, v in entry.items() if k in ("error", "timeout")})
        for entry in logs
        if entry["log_level"] == "warning"
    ]
    assert warnings == logged
    assert all(entry["private_id"] == gen.private_id for entry in logs)
    assert all(entry["public_id"] == "r" for entry in logs)


class _Stream:
    """An engine stream with one chunk; its close raises, hangs, or it has none."""

    def __init__(self, close: str) -> None:
        self.close = close
        self.chunks = [terminal(1)]

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Out:
        if not self.chunks:
            raise StopAsyncIteration
        return self.chunks.pop()

    def __getattr__(self, name: str) -> object:
        if name != "aclose" or self.close == "none":
            raise AttributeError(name)

        async def aclose() -> None:
            if self.close == "raises":
                raise ConnectionResetError("reset")
            await anyio.sleep_forever()

        return aclose


@pytest.mark.parametrize("close", ["none", "raises", "hangs"])
async def test_closing_the_engine_stream_is_bounded_and_never_raises(close: str) -> None:
    engine = FakeEngine()
    setattr(engine, "generate", lambda call: _Stream(close))  # noqa: B010 - an instance attribute
    gen = Generation(engine, _generation(engine).call, abort_timeout=0.05)
    assert [out async for out in gen.stream()] == [terminal(1)]
    with structlog.testing.capture_logs() as logs, anyio.fail_after(5):
        await gen.close_stream()
    failed = [entry for entry in logs if entry["event"] == "engine stream close failed"]
    assert [entry["error"] for entry in failed] == (
        ["ConnectionResetError('reset')"] if close == "raises" else []
    )


async def test_an_engine_adapter_bug_is_logged_with_its_traceback_counted_and_typed() -> None:
    bug = KeyError("meta_info")
    engine = FakeEngine(scripts={"r": [tokens(1), bug]})
    metrics = Metrics("fake")
    sent: list[Out] = []

    async def write(out: Out) -> None:
        sent.append(out)

    with structlog.testing.capture_logs() as logs:
        gen = _generation(engine)
        with pytest.raises(SidecarError) as info:
            await relay(gen, write, RelayConfig(), metrics=metrics)
    assert info.value.reason is FailureReason.UNKNOWN
    assert info.value.message == "fake generate: KeyError: 'meta_info'"
    errors = [entry for entry in logs if entry["log_level"] == "error"]
    assert errors == [
        {
            "event": "internal error",
            "log_level": "error",
            "where": "engine_generate",
            "private_id": gen.private_id,
            "error": "KeyError('meta_info')",
            "exc_info": bug,
        }
    ]
    counted = metrics.registry.get_sample_value(
        "sidecar_internal_errors_total", {"engine": "fake", "where": "engine_generate"}
    )
    assert counted == 1
    assert engine.aborts == [gen.private_id]


async def test_a_frontend_that_stopped_reading_is_logged_once_and_marks_the_call_stalled() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1), HANG]})
    gen = _generation(engine)
    writing = anyio.Event()

    async def stuck_write(out: Out) -> None:
        writing.set()
        await anyio.sleep_forever()

    with structlog.testing.capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            tg.start_soon(relay, gen, stuck_write, RelayConfig(drain_grace=0.01))
            await writing.wait()
            tg.cancel_scope.cancel()
    assert gen.tracker.stalled
    cut = [entry for entry in logs if entry["event"] == "write to the frontend cut: it stopped reading"]
    assert cut == [
        {
            "event": "write to the frontend cut: it stopped reading",
            "log_level": "warning",
            "private_id": gen.private_id,
            "grace": 0.01,
        }
    ]


async def test_latency_metrics_count_from_the_requests_arrival_once_per_message() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1), tokens(2), terminal(3)]})
    metrics = Metrics("fake")

    async def write(out: Out) -> None:
        return None

    arrived = time.monotonic() - 30.0  # the request waited 30 s before its relay began
    await relay(_generation(engine), write, RelayConfig(), metrics=metrics, started_at=arrived)

    def sample(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"engine": "fake"})

    assert sample("sidecar_time_to_first_token_seconds_count") == 1
    assert 30.0 <= (sample("sidecar_time_to_first_token_seconds_sum") or 0.0) < 60.0
    assert sample("sidecar_inter_chunk_latency_seconds_count") == 2
    assert 0.0 <= (sample("sidecar_inter_chunk_latency_seconds_sum") or -1.0) < 30.0


async def test_protocol_errors_of_the_stream_name_the_engine() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1, index=3)]})
    gen = _generation(engine)

    async def write(out: Out) -> None:
        return None

    with pytest.raises(SidecarError) as info:
        await relay(gen, write, RelayConfig())
    assert info.value.reason is FailureReason.PROTOCOL_ERROR
    assert info.value.message == "invalid fake response: choice index 3 with n=1"


async def test_the_abort_of_a_generation_the_frontend_left_is_counted_by_outcome() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1), HANG]})
    metrics = Metrics("fake")
    gen = _generation(engine)

    async def write(out: Out) -> None:
        raise ConnectionResetError("the frontend went away")

    with pytest.raises(ConnectionResetError, match=r"^the frontend went away$"):
        await relay(gen, write, RelayConfig(), metrics=metrics)
    assert engine.aborts == [gen.private_id]
    counted = metrics.registry.get_sample_value(
        "sidecar_engine_aborts_total", {"engine": "fake", "outcome": "ok"}
    )
    assert counted == 1


async def test_an_engine_failure_after_every_terminal_was_delivered_is_logged_not_reported() -> None:
    late = anyio.Event()
    failure = SidecarError(FailureReason.ENGINE_SHUTDOWN, "stream reset after the terminal")
    engine = FakeEngine(scripts={"r": [terminal(1), Gate(late), failure]})
    gen = _generation(engine)

    async def write(out: Out) -> None:
        late.set()  # the engine fails only once the terminal is out

    with structlog.testing.capture_logs() as logs:
        await relay(gen, write, RelayConfig(drain_grace=10.0))
    failed = [
        entry for entry in logs if entry["event"] == "engine stream failed after every terminal was delivered"
    ]
    assert failed == [
        {
            "event": "engine stream failed after every terminal was delivered",
            "log_level": "warning",
            "private_id": gen.private_id,
            "error": "stream reset after the terminal",
        }
    ]
    assert engine.aborts == []


async def test_a_stop_while_a_finished_engine_stream_winds_down_ends_the_relay_at_once() -> None:
    engine = FakeEngine(scripts={"r": [terminal(1), HANG]})  # the stream never ends by itself
    gen = _generation(engine)
    written = anyio.Event()
    sent: list[Out] = []

    async def write(out: Out) -> None:
        sent.append(out)
        written.set()

    with anyio.fail_after(5):  # drain_grace is 60 s: only the stop can end it this soon
        async with anyio.create_task_group() as tg:
            tg.start_soon(relay, gen, write, RelayConfig(drain_grace=60.0))
            await written.wait()
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    assert [out.finish_reason for out in sent] == [sidecar_pb2.EOS]
    assert engine.aborts == []


@pytest.mark.parametrize(
    ("nonce", "counter"),
    [("0123abc", 0), ("0123abcd0", 0), ("0123abcd", -1), ("0123abcd", 1 << 48), ("0123abcd", 1 << 49)],
)
def test_a_private_id_outside_its_fixed_width_head_is_refused(nonce: str, counter: int) -> None:
    with pytest.raises(ValueError, match=r"^nonce must be 8 hex chars and counter fit in 12 hex digits$"):
        make_private_id(nonce, counter, "r")


def test_the_largest_counter_still_fits_the_head() -> None:
    assert make_private_id("0123abcd", (1 << 48) - 1, "r") == "0123abcdffffffffffff-r"


def test_a_given_nonce_is_the_head_of_every_private_id() -> None:
    ids = PrivateIds("0123abcd")
    assert [ids.next("r"), ids.next("r")] == ["0123abcd000000000000-r", "0123abcd000000000001-r"]


def test_an_explicit_zero_n_still_means_one_choice() -> None:
    req = sidecar_pb2.PreprocessedRequest(token_ids=[1])
    req.sampling_options.n = 0
    assert choice_count(req) == 1


def test_a_call_that_sent_no_terminal_reports_unspecified_as_its_finish() -> None:
    assert ChoiceTracker("fake", 1).last_finish_reason() == "UNSPECIFIED"
