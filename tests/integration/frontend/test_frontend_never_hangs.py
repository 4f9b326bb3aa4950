"""Whatever fails inside the frontend's request path, the response ends and the request is not
recorded ``ok``: an output the format cannot encode (the worker's fault, reported), a format
whose stream end raises, a bug below the exchange (a routing watch that raises). A probe format
(plugin.py) with those faults built in, over real sidecars and a hostile worker."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from typing import Any

import anyio
import pytest
import structlog.testing
from prometheus_client import CollectorRegistry

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.base import FormatContext, GenerateBody, GenerateCall, HttpReply, Route
from sidecar_frontend.misbehaviour import Misbehaviour, MisbehaviourReporter
from sidecar_frontend.placement import Observe
from sidecar_frontend.workers import Worker
from tests.hostile_worker import Kind, hostile_worker
from tests.integration.frontend.fixtures import FrontendStack, frontend_over, two_workers
from tests.integration.frontend.plugin import ProbeEncoder, ProbeFormat
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(90)

CLIENT_BOUND = 60.0


@dataclass
class StrictEncoder(ProbeEncoder):
    """A probe encoder that trusts an output's parallel lists (as a format reading logprobs
    per token does), and optionally fails at the stream's end."""

    close_raises: bool = False

    def on_output(self, index: int, output: sidecar_pb2.LLMEngineOutput, now: float) -> bytes:
        if output.log_probs and len(output.log_probs) != len(output.token_ids):
            raise IndexError("log_probs and token_ids differ in length")
        return super().on_output(index, output, now)

    def close(self) -> bytes:
        if self.close_raises:
            raise RuntimeError("a bug at the stream's end")
        return super().close()


class StrictFormat(ProbeFormat):
    name = "strict"

    def parse_generate(
        self, route: Route, body: GenerateBody, headers: Mapping[str, str], ctx: FormatContext
    ) -> GenerateCall | HttpReply:
        parsed = super().parse_generate(route, body, headers, ctx)
        if isinstance(parsed, HttpReply):
            return parsed
        assert isinstance(body.data, dict)
        return replace(parsed, options=(parsed.options, bool(body.data.get("close_raises"))))

    def new_encoder(self, call: GenerateCall, started_at: float) -> StrictEncoder:
        assert isinstance(call.options, tuple)
        options, close_raises = call.options
        base = super().new_encoder(replace(call, options=options), started_at)
        return StrictEncoder(base.stream, base.fatal, base.count, close_raises=close_raises)


def requests(fe: FrontendStack, outcome: str) -> float:
    return sum(
        sample.value
        for metric in fe.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "frontend_requests_total" and sample.labels.get("outcome") == outcome
    )


@asynccontextmanager
async def strict_frontend(**hostile: Any) -> AsyncIterator[tuple[FrontendStack, Any, CollectorRegistry]]:
    async with vllm_stack() as honest:
        info = await honest.stub.GetModelInfo(sidecar_pb2.GetModelInfoRequest())
        async with hostile_worker(info, **hostile) as worker:
            addresses = [f"127.0.0.1:{honest.server.port}", worker.address]
            async with frontend_over(addresses, [honest], formats=(StrictFormat(),)) as fe:
                # The test's own reporter (no ejection): the hostile worker stays in routing.
                registry = CollectorRegistry()
                fe.frontend.runner.misbehaviour = MisbehaviourReporter(registry)
                yield fe, worker, registry


async def post_stream(fe: FrontendStack, body: dict[str, Any]) -> tuple[int, list[str], bool]:
    """The status, every data payload, and whether the response ended (read to its end)."""
    events: list[str] = []
    with anyio.move_on_after(CLIENT_BOUND) as bound:
        async with fe.http.post(fe.url + "/t/generate", json=body) as response:
            async for line in response.content:
                text = line.decode().rstrip("\r\n")
                if text.startswith("data: "):
                    events.append(text[len("data: ") :])
            return response.status, events, True
    assert not bound.cancelled_caught, "the response did not end"
    return 0, events, False


async def test_an_output_the_format_cannot_encode_ends_the_request_with_its_error_and_is_reported() -> None:
    async with strict_frontend(kinds=[Kind.LOGPROBS_MISMATCH], honest_outputs=1) as (fe, worker, registry):
        with structlog.testing.capture_logs() as logs:
            answers = [
                await post_stream(fe, {"ids": [5, 6, 7, index], "max": 4, "rid": f"m{index}", "stream": True})
                for index in range(8)
            ]
        hostile = [i for i in range(8) if f"m{i}" in worker.generate_ids]
        assert hostile, "no request landed on the hostile worker"
        for index, (status, events, ended) in enumerate(answers):
            assert status == 200
            assert ended
            assert events[-1] == "[DONE]"
            errors = [json.loads(e) for e in events[:-1] if "error" in json.loads(e)]
            if index in hostile:
                assert [e["error"] for e in errors] == ["PROTOCOL_ERROR"]
            else:
                assert errors == []
        value = registry.get_sample_value(
            "frontend_worker_misbehaviour_total", {"kind": Misbehaviour.UNENCODABLE_OUTPUT.value}
        )
        assert value == len(hostile)
        reported = [
            e for e in logs if e.get("kind") == "unencodable_output" and e.get("worker") == worker.address
        ]
        assert len(reported) == 1
        assert requests(fe, "error") == len(hostile)
        assert requests(fe, "ok") == 8 - len(hostile)


async def test_a_format_that_raises_at_the_streams_end_still_ends_the_response() -> None:
    async with strict_frontend() as (fe, _, _):
        with structlog.testing.capture_logs() as logs:
            status, events, ended = await post_stream(
                fe, {"ids": [5, 6, 7], "max": 3, "rid": "c", "stream": True, "close_raises": True}
            )
        assert status == 200
        assert ended
        assert [json.loads(e)["finish"] for e in events][-1] is not None  # every output came
        assert requests(fe, "error") == 1
        assert requests(fe, "ok") == 0
        assert [e["event"] for e in logs if e["log_level"] == "error"] == [
            "request failed in the frontend: stream ended"
        ]


class RaisingWatch:
    """A routing policy's call watch with a bug: it raises on the first output it is shown."""

    @contextmanager
    def watch(self, worker: Worker, request: sidecar_pb2.PreprocessedRequest) -> Iterator[Observe]:
        def observe(output: sidecar_pb2.LLMEngineOutput) -> None:
            raise KeyError("a bug in the routing policy")

        yield observe


@pytest.mark.parametrize("stream", [True, False])
async def test_a_bug_below_the_exchange_fails_the_request_and_ends_the_response(stream: bool) -> None:
    async with strict_frontend() as (fe, _, _):
        fe.frontend.runner.watch = RaisingWatch()
        with structlog.testing.capture_logs() as logs:
            if stream:
                status, events, ended = await post_stream(
                    fe, {"ids": [5, 6, 7], "max": 3, "rid": "b", "stream": True}
                )
                assert ended
                assert events[-1] == "[DONE]"
                assert json.loads(events[0])["error"] == "UNKNOWN"
            else:
                with anyio.fail_after(CLIENT_BOUND):
                    response = await fe.http.post(
                        fe.url + "/t/generate", json={"ids": [5, 6, 7], "max": 3, "rid": "b"}
                    )
                    body = await response.json()
                status = response.status
                assert body["outputs"][0]["error"] == "UNKNOWN"
        assert status == 200
        failed = [e for e in logs if e["event"] == "sub-request failed in the frontend"]
        assert len(failed) == 1
        assert failed[0]["exc_info"] is not None
        assert requests(fe, "error") == 1
        assert requests(fe, "ok") == 0


async def test_a_call_whose_connection_closes_under_it_moves_to_another_worker() -> None:
    """grpc.aio ends a call whose channel closed with a bare CancelledError in the calling task,
    which nobody cancelled (sidecar_common.rpc.cancel_is_ours): a broken call, migrated as a
    connection failure, never taken for the request's own cancellation."""
    async with two_workers("vllm", formats=(StrictFormat(),)) as fe:
        body = {"ids": [5, 6, 7], "max": 12, "rid": "cut", "stream": True}
        tokens: list[int] = []
        with anyio.fail_after(CLIENT_BOUND):
            async with fe.http.post(fe.url + "/t/generate", json=body) as response:
                async for line in response.content:
                    text = line.decode().rstrip("\r\n")
                    if not text.startswith("data: ") or text == "data: [DONE]":
                        continue
                    event = json.loads(text[len("data: ") :])
                    assert "error" not in event, event
                    tokens.extend(event["ids"])
                    if len(tokens) == 2:
                        running = [
                            index
                            for index, sidecar in enumerate(fe.sidecars)
                            if any(r.endswith("-cut") for r in sidecar.engine.book.running_ids())
                        ]
                        worker = fe.workers.get(fe.address(running[0]))
                        assert worker is not None
                        await worker.pool.close()
        assert len(tokens) == 12
        assert requests(fe, "ok") == 1
        value = fe.metrics.registry.get_sample_value(
            "frontend_migrations_total", {"format": "strict", "outcome": "migrated"}
        )
        assert value == 1
