"""The hostile worker (tests/hostile_worker.py) puts on the wire what each of its modes says:
read here as raw bytes over a plain grpc.aio channel, then decoded (or not) by the protobuf
classes a frontend uses."""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import grpc
import pytest
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2

from sidecar_common.api import sidecar_pb2
from tests.hostile_worker import DEFAULT_VOCAB, HostileWorker, Kind, hostile_worker, parse_kinds

pytestmark = pytest.mark.timeout(60)

_WORKER = "/sidecar.v1.Worker/"


class Raw:
    """Calls that hand back each reply's bytes as they came."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    async def unary(self, method: str, request: Any, timeout: float = 10.0) -> bytes:
        call = self.channel.unary_unary(method, request_serializer=_serialize, response_deserializer=None)
        reply = await call(request, timeout=timeout)
        assert isinstance(reply, bytes)
        return reply

    def stream(self, method: str, request: Any) -> Any:
        call = self.channel.unary_stream(method, request_serializer=_serialize, response_deserializer=None)
        return call(request, timeout=30.0)

    async def load(self) -> bytes:
        return await self.unary(_WORKER + "GetLoad", sidecar_pb2.GetLoadRequest())

    def generate(self, request: sidecar_pb2.PreprocessedRequest | None = None) -> Any:
        return self.stream(_WORKER + "Generate", request or _request())


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


def _request(max_tokens: int | None = None) -> sidecar_pb2.PreprocessedRequest:
    request = sidecar_pb2.PreprocessedRequest(request_id="r", model="hostile-model", token_ids=[5, 6, 7])
    if max_tokens is not None:
        request.stop_conditions.max_tokens = max_tokens
    return request


@asynccontextmanager
async def raw_worker(**options: Any) -> AsyncIterator[tuple[HostileWorker, Raw]]:
    async with hostile_worker(**options) as worker, grpc.aio.insecure_channel(worker.address) as channel:
        yield worker, Raw(channel)


async def _replies(call: Any, count: int) -> list[bytes]:
    replies = []
    with anyio.fail_after(30):
        async for reply in call:
            replies.append(reply)
            if len(replies) == count:
                break
    return replies


async def _outputs(call: Any) -> list[sidecar_pb2.LLMEngineOutput]:
    with anyio.fail_after(30):
        return [sidecar_pb2.LLMEngineOutput.FromString(reply) async for reply in call]


async def test_honest_it_answers_every_rpc_as_a_sidecar_would() -> None:
    async with raw_worker() as (_, raw):
        info = sidecar_pb2.ModelInfo.FromString(
            await raw.unary(_WORKER + "GetModelInfo", sidecar_pb2.GetModelInfoRequest())
        )
        assert (info.served_model_name, info.vocab_size) == ("hostile-model", DEFAULT_VOCAB)
        load = sidecar_pb2.LoadReport.FromString(await raw.load())
        assert load.kv_cache.subscribed
        assert load.ranks[0].kv_usage == pytest.approx(0.1)
        (watch,) = await _replies(
            raw.stream(
                "/grpc.health.v1.Health/Watch", health_pb2.HealthCheckRequest(service="sidecar.v1.Worker")
            ),
            1,
        )
        assert (
            health_pb2.HealthCheckResponse.FromString(watch).status == health_pb2.HealthCheckResponse.SERVING
        )
        (first,) = await _replies(raw.stream(_WORKER + "WatchKvCache", sidecar_pb2.WatchKvCacheRequest()), 1)
        snapshot = sidecar_pb2.KvCacheUpdate.FromString(first).snapshot
        assert snapshot.last_chunk
        assert len(snapshot.keys) == len(snapshot.parents) == 3

        outputs = await _outputs(raw.generate())
        assert [o.finish_reason for o in outputs] == [0, 0, 0, sidecar_pb2.EOS]
        assert all(len(o.token_ids) == 1 and 0 <= o.token_ids[0] < DEFAULT_VOCAB for o in outputs)
        again = await _outputs(raw.generate())
        assert [o.token_ids for o in again] == [o.token_ids for o in outputs]  # deterministic

        limited = await _outputs(raw.generate(_request(max_tokens=2)))
        assert [o.finish_reason for o in limited] == [0, sidecar_pb2.LENGTH]
        assert limited[-1].completion_usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("kind", "method", "message"),
    [
        (Kind.MODEL_INFO_GARBAGE, "GetModelInfo", sidecar_pb2.GetModelInfoRequest()),
        (Kind.LOAD_GARBAGE, "GetLoad", sidecar_pb2.GetLoadRequest()),
    ],
)
async def test_a_garbage_unary_reply_does_not_decode(kind: Kind, method: str, message: Any) -> None:
    async with raw_worker(kinds=[kind]) as (worker, raw):
        reply = await raw.unary(_WORKER + method, message)
        reply_type = sidecar_pb2.ModelInfo if method == "GetModelInfo" else sidecar_pb2.LoadReport
        with pytest.raises(DecodeError):
            reply_type.FromString(reply)
        assert worker.misbehaved[kind] == 1


@pytest.mark.parametrize("kind", [Kind.OUTPUT_GARBAGE, Kind.TEXT_GARBAGE])
async def test_a_garbage_output_does_not_decode_and_comes_after_the_honest_outputs_asked_for(
    kind: Kind,
) -> None:
    async with raw_worker(kinds=[kind], honest_outputs=2) as (_, raw):
        call = raw.generate()
        first, second, bad = await _replies(call, 3)
        call.cancel()
        assert len(sidecar_pb2.LLMEngineOutput.FromString(first).token_ids) == 1
        assert sidecar_pb2.LLMEngineOutput.FromString(second).finish_reason == 0
        with pytest.raises(DecodeError):
            sidecar_pb2.LLMEngineOutput.FromString(bad)
        if kind is Kind.TEXT_GARBAGE:
            # It is the text alone that does not decode: the rest is a well-formed output.
            fixed = sidecar_pb2.LLMEngineOutput.FromString(bad[: -len(b"\x12\x02\xff\xfe")])
            assert len(fixed.token_ids) == 1


async def _generate_error(raw: Raw) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _outputs(raw.generate())
    return caught.value


def _details(error: grpc.aio.AioRpcError) -> bytes:
    metadata: Any = error.trailing_metadata() or ()
    (details,) = [value for key, value in metadata if key == "grpc-status-details-bin"]
    assert isinstance(details, bytes)
    return details


async def test_error_details_garbage_ends_the_call_with_status_details_that_do_not_decode() -> None:
    async with raw_worker(kinds=[Kind.ERROR_DETAILS_GARBAGE]) as (_, raw):
        error = await _generate_error(raw)
        assert error.code() is grpc.StatusCode.UNAVAILABLE
        with pytest.raises(DecodeError):
            status_pb2.Status.FromString(_details(error))


async def test_error_info_garbage_sends_a_status_whose_error_info_does_not_decode() -> None:
    async with raw_worker(kinds=[Kind.ERROR_INFO_GARBAGE]) as (_, raw):
        error = await _generate_error(raw)
        status = status_pb2.Status.FromString(_details(error))
        assert (status.code, status.message) == (grpc.StatusCode.UNAVAILABLE.value[0], "engine went away")
        (detail,) = status.details
        assert detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)
        with pytest.raises(DecodeError):
            detail.Unpack(error_details_pb2.ErrorInfo())


async def test_final_then_open_sends_the_terminal_and_keeps_the_stream_open() -> None:
    async with raw_worker(kinds=[Kind.FINAL_THEN_OPEN]) as (worker, raw):
        call = raw.generate()
        replies = await _replies(call, 4)
        assert sidecar_pb2.LLMEngineOutput.FromString(replies[-1]).finish_reason == sidecar_pb2.EOS
        await worker.wait_misbehaved(Kind.FINAL_THEN_OPEN)
        # The handler is past its terminal and still running: the stream has not ended.
        assert worker.inflight == 1
        assert not call.done()
        call.cancel()


async def test_out_of_vocab_and_length_without_tokens() -> None:
    async with raw_worker(kinds=[Kind.OUT_OF_VOCAB]) as (worker, raw):
        call = raw.generate()
        (bad,) = await _replies(call, 1)
        call.cancel()
        assert all(t >= DEFAULT_VOCAB for t in sidecar_pb2.LLMEngineOutput.FromString(bad).token_ids)
        worker.misbehave(Kind.LENGTH_NO_TOKENS)
        (only,) = await _outputs(raw.generate(_request(max_tokens=5)))
        assert only.finish_reason == sidecar_pb2.LENGTH
        assert not only.token_ids


async def test_after_counts_honest_calls_first() -> None:
    async with raw_worker(kinds=[Kind.LENGTH_NO_TOKENS], after=1) as (_, raw):
        assert len(await _outputs(raw.generate())) == 4
        assert len(await _outputs(raw.generate())) == 1


@pytest.mark.parametrize(
    ("kind", "check"),
    [
        # -1 in a uint32 field decodes as its low 32 bits.
        (Kind.LOAD_NEGATIVE, lambda r: r.inflight_requests == 2**32 - 1 and r.ranks[0].kv_usage == -1.0),
        (Kind.LOAD_NAN, lambda r: math.isnan(r.ranks[0].kv_usage)),
        (Kind.LOAD_HUGE, lambda r: r.ranks[0].kv_usage == 2.0**63 and r.kv_cache.blocks == 2**63),
    ],
)
async def test_absurd_loads_decode_to_absurd_values(
    kind: Kind, check: Callable[[sidecar_pb2.LoadReport], bool]
) -> None:
    async with raw_worker(kinds=[kind]) as (_, raw):
        assert check(sidecar_pb2.LoadReport.FromString(await raw.load()))


async def test_a_hung_load_never_answers() -> None:
    async with raw_worker(kinds=[Kind.LOAD_HANG]) as (worker, raw):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await raw.unary(_WORKER + "GetLoad", sidecar_pb2.GetLoadRequest(), timeout=0.5)
        assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert worker.misbehaved[Kind.LOAD_HANG] == 1


@pytest.mark.parametrize(
    ("kind", "block_size"), [(Kind.KV_HUGE_ZERO_BLOCK, 0), (Kind.KV_HUGE_MAX_BLOCK, 2**32 - 1)]
)
async def test_a_huge_snapshot_comes_in_chunks_with_the_absurd_block_size(
    kind: Kind, block_size: int
) -> None:
    async with raw_worker(kinds=[kind], huge_keys=150_000) as (_, raw):
        call = raw.stream(_WORKER + "WatchKvCache", sidecar_pb2.WatchKvCacheRequest())
        chunks = [sidecar_pb2.KvCacheUpdate.FromString(r).snapshot for r in await _replies(call, 3)]
        call.cancel()
        assert sum(len(c.keys) for c in chunks) == 150_000
        assert [c.last_chunk for c in chunks] == [False, False, True]
        assert {c.block_size for c in chunks} == {block_size}


async def test_kv_gap_follows_every_snapshot_with_a_gap() -> None:
    async with raw_worker(kinds=[Kind.KV_GAP]) as (_, raw):
        for _ in range(2):  # a reconnect gets the same
            call = raw.stream(_WORKER + "WatchKvCache", sidecar_pb2.WatchKvCacheRequest())
            first, second = (sidecar_pb2.KvCacheUpdate.FromString(r) for r in await _replies(call, 2))
            call.cancel()
            assert second.delta.sequence == first.snapshot.sequence + 2


async def test_kv_garbage_does_not_decode() -> None:
    async with raw_worker(kinds=[Kind.KV_GARBAGE]) as (_, raw):
        call = raw.stream(_WORKER + "WatchKvCache", sidecar_pb2.WatchKvCacheRequest())
        (bad,) = await _replies(call, 1)
        call.cancel()
        with pytest.raises(DecodeError):
            sidecar_pb2.KvCacheUpdate.FromString(bad)


async def test_switched_at_run_time_a_health_watch_turns_to_garbage_and_back() -> None:
    async with raw_worker() as (worker, raw):
        call = raw.stream(
            "/grpc.health.v1.Health/Watch", health_pb2.HealthCheckRequest(service="sidecar.v1.Worker")
        )
        replies = call.__aiter__()

        async def next_reply() -> bytes:
            with anyio.fail_after(30):
                reply: bytes = await replies.__anext__()
            return reply

        assert health_pb2.HealthCheckResponse.FromString(await next_reply()).status == 1
        worker.misbehave(Kind.HEALTH_GARBAGE)
        with pytest.raises(DecodeError):
            health_pb2.HealthCheckResponse.FromString(await next_reply())
        worker.behave()
        assert health_pb2.HealthCheckResponse.FromString(await next_reply()).status == 1
        call.cancel()


def test_kinds_parse_from_their_names_and_an_unknown_one_is_refused() -> None:
    assert parse_kinds("load-nan, kv-gap\n") == {Kind.LOAD_NAN, Kind.KV_GAP}
    assert parse_kinds("") == frozenset()
    with pytest.raises(ValueError, match="unknown misbehaviour 'nope'"):
        parse_kinds("nope")


async def _poll(attempt: Callable[[], Awaitable[bool]], what: str) -> None:
    # A subprocess has no event to wait on: ask again, bounded.
    with anyio.fail_after(30):
        while not await attempt():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    assert what


async def test_as_a_subprocess_it_follows_its_control_file(tmp_path: Path) -> None:
    control = tmp_path / "kinds"
    control.write_text("")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.hostile_worker",
        "--listen",
        "127.0.0.1:0",
        "--control",
        str(control),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        with anyio.fail_after(30):
            line = (await process.stdout.readline()).decode()
        assert line.startswith("listening on 127.0.0.1:"), line
        address = line.split()[-1]
        async with grpc.aio.insecure_channel(address) as channel:
            raw = Raw(channel)
            assert sidecar_pb2.LoadReport.FromString(await raw.load()).ranks[0].kv_usage == pytest.approx(0.1)
            control.write_text("load-nan")

            async def nan() -> bool:
                return math.isnan(sidecar_pb2.LoadReport.FromString(await raw.load()).ranks[0].kv_usage)

            await _poll(nan, "GetLoad answers NaN once the control file says load-nan")
    finally:
        process.terminate()
        with anyio.fail_after(30):
            await process.wait()


async def test_bad_index_and_mismatched_logprobs_come_after_the_honest_outputs() -> None:
    async with raw_worker(kinds=[Kind.BAD_INDEX], honest_outputs=1) as (worker, raw):
        call = raw.generate()
        first, bad = (sidecar_pb2.LLMEngineOutput.FromString(r) for r in await _replies(call, 2))
        call.cancel()
        assert first.index == 0
        assert bad.index == 1  # the request has one choice
        worker.misbehave(Kind.LOGPROBS_MISMATCH)
        call = raw.generate()
        _, bad = (sidecar_pb2.LLMEngineOutput.FromString(r) for r in await _replies(call, 2))
        call.cancel()
        assert len(bad.token_ids) == 1
        assert len(bad.log_probs) == 3


async def test_output_after_final_sends_one_more_output_after_the_terminal_then_ends() -> None:
    async with raw_worker(kinds=[Kind.OUTPUT_AFTER_FINAL]) as (_, raw):
        outputs = await _outputs(raw.generate())
        assert [o.finish_reason for o in outputs] == [0, 0, 0, sidecar_pb2.EOS, 0]
        assert len(outputs[-1].token_ids) == 1


async def test_a_cache_stream_ends_when_its_modes_change_and_the_next_one_misbehaves() -> None:
    async with raw_worker() as (worker, raw):
        call = raw.stream(_WORKER + "WatchKvCache", sidecar_pb2.WatchKvCacheRequest())
        replies = call.__aiter__()
        with anyio.fail_after(30):
            first = sidecar_pb2.KvCacheUpdate.FromString(await replies.__anext__())
        assert first.snapshot.last_chunk
        worker.misbehave(Kind.KV_GARBAGE)
        with anyio.fail_after(30):
            rest = [reply async for reply in replies]
        assert rest == []  # ended, as a restarting sidecar's stream would
        (bad,) = await _replies(raw.stream(_WORKER + "WatchKvCache", sidecar_pb2.WatchKvCacheRequest()), 1)
        with pytest.raises(DecodeError):
            sidecar_pb2.KvCacheUpdate.FromString(bad)
