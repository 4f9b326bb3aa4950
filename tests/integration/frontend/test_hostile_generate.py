"""A worker is not trusted (issue 26), the Generate path: a hostile worker (tests/hostile_worker.py)
and two honest sidecars behind one frontend, many requests at once.

Whatever the hostile worker sends, the frontend stays up, every request ends (each client call
is bounded, and the bound is asserted never to be the way it ended), a request the hostile
worker took fails over to an honest one while no token of it was delivered and otherwise ends
with the format's error, no request that failed is recorded ``ok``, and the misbehaviour is
logged once with the worker's address and counted."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import structlog.testing
from prometheus_client import CollectorRegistry

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.misbehaviour import Misbehaviour, MisbehaviourReporter
from tests.hostile_worker import HostileWorker, Kind, hostile_worker
from tests.integration.frontend.fixtures import FrontendStack, frontend_over
from tests.vllm_fixtures import vllm_stack

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow(25)]

REQUESTS = 60  # as many streams as the issue ran across one hostile and two honest workers
MAX_TOKENS = 4
# Each client call's bound: far past what any request here takes, so reaching it is a hang.
CLIENT_BOUND = 60.0


@dataclass
class Fleet:
    fe: FrontendStack
    hostile: HostileWorker
    reporter: MisbehaviourReporter
    registry: CollectorRegistry

    def misbehaviour(self, kind: Misbehaviour) -> float:
        value = self.registry.get_sample_value("frontend_worker_misbehaviour_total", {"kind": kind.value})
        return 0.0 if value is None else value

    def requests(self, outcome: str) -> float:
        total = 0.0
        for metric in self.fe.metrics.registry.collect():
            for sample in metric.samples:
                if sample.name == "frontend_requests_total" and sample.labels.get("outcome") == outcome:
                    total += sample.value
        return total


@asynccontextmanager
async def fleet(**hostile_options: Any) -> AsyncIterator[Fleet]:
    async with vllm_stack() as first, vllm_stack() as second:
        info = await first.stub.GetModelInfo(sidecar_pb2.GetModelInfoRequest())
        assert info.vocab_size > 0
        async with hostile_worker(info, **hostile_options) as hostile:
            addresses = [f"127.0.0.1:{first.server.port}", f"127.0.0.1:{second.server.port}", hostile.address]
            async with frontend_over(addresses, [first, second], formats=(VLLM, SGLANG)) as fe:
                # A reporter of the test's own in place of the worker set's: nothing ejects
                # the hostile worker, so many requests land on it (and its counts are here).
                registry = CollectorRegistry()
                reporter = MisbehaviourReporter(registry)
                fe.frontend.runner.misbehaviour = reporter
                yield Fleet(fe, hostile, reporter, registry)


@dataclass(frozen=True)
class Answer:
    rid: str
    status: int
    tokens: list[int]
    finished: bool  # the choice's finish_reason came
    error: bool  # the format's error came
    done: bool  # streaming: the stream's [DONE] came


async def ask(fe: FrontendStack, rid: str, *, stream: bool, fmt: str = "vllm") -> Answer:
    if fmt == "sglang":
        return await ask_sglang(fe, rid, stream=stream)
    body = {
        "token_ids": [11, 12, 13, len(rid)],
        "request_id": rid,
        "stream": stream,
        "sampling_params": {"max_tokens": MAX_TOKENS},
    }
    with anyio.move_on_after(CLIENT_BOUND) as bound:
        async with fe.http.post(fe.url + "/inference/v1/generate", json=body) as response:
            if not stream:
                data = await response.json()
                choices = data.get("choices") or []
                return Answer(
                    rid,
                    response.status,
                    [t for c in choices for t in c.get("token_ids") or ()],
                    any(c.get("finish_reason") for c in choices),
                    "error" in data or response.status != 200,
                    True,
                )
            tokens: list[int] = []
            finished = error = done = False
            async for line in response.content:
                text = line.decode().rstrip("\r\n")
                if not text.startswith("data: "):
                    continue
                if text == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(text[len("data: ") :])
                if "error" in event:
                    error = True
                for choice in event.get("choices", ()):
                    tokens.extend(choice.get("token_ids") or ())
                    finished = finished or choice.get("finish_reason") not in (None, "abort")
            return Answer(rid, response.status, tokens, finished, error, done)
    assert not bound.cancelled_caught, f"request {rid} did not end within {CLIENT_BOUND}s"
    raise AssertionError("unreachable")


async def ask_sglang(fe: FrontendStack, rid: str, *, stream: bool) -> Answer:
    body = {
        "input_ids": [11, 12, 13, len(rid)],
        "rid": rid,
        "stream": stream,
        "sampling_params": {"max_new_tokens": MAX_TOKENS},
    }
    with anyio.move_on_after(CLIENT_BOUND) as bound:
        async with fe.http.post(fe.url + "/generate", json=body) as response:
            if not stream:
                data = await response.json()
                if response.status != 200:
                    return Answer(rid, response.status, [], False, True, True)
                finish = data["meta_info"]["finish_reason"]
                kind = finish.get("type") if isinstance(finish, dict) else None
                return Answer(rid, 200, data["output_ids"], kind in ("length", "stop"), kind == "abort", True)
            tokens: list[int] = []
            finished = error = done = False
            async for line in response.content:
                text = line.decode().rstrip("\r\n")
                if not text.startswith("data: "):
                    continue
                if text == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(text[len("data: ") :])
                if "error" in event:
                    error = True
                    continue
                tokens = list(event["output_ids"])  # cumulative
                finish = event["meta_info"].get("finish_reason")
                kind = finish.get("type") if isinstance(finish, dict) else None
                finished = finished or kind in ("length", "stop")
                error = error or kind == "abort"
            return Answer(rid, response.status, tokens, finished, error, done)
    assert not bound.cancelled_caught, f"request {rid} did not end within {CLIENT_BOUND}s"
    raise AssertionError("unreachable")


async def ask_many(fleet: Fleet, *, stream: bool, prefix: str, fmt: str = "vllm") -> list[Answer]:
    answers: list[Answer] = []

    async def one(index: int) -> None:
        answers.append(await ask(fleet.fe, f"{prefix}-{index}", stream=stream, fmt=fmt))

    async with anyio.create_task_group() as group:
        for index in range(REQUESTS):
            group.start_soon(one, index)
    return answers


def landed_on_hostile(fleet: Fleet, answer: Answer) -> bool:
    return any(rid.endswith(answer.rid) for rid in fleet.hostile.generate_ids)


def complete(answer: Answer) -> bool:
    return answer.status == 200 and answer.finished and not answer.error and len(answer.tokens) == MAX_TOKENS


def logged(logs: Sequence[Mapping[str, Any]], fleet: Fleet, kind: Misbehaviour) -> list[Mapping[str, Any]]:
    return [
        entry
        for entry in logs
        if entry.get("worker") == fleet.hostile.address
        and entry.get("kind") == kind.value
        and entry.get("log_level") == "error"
    ]


# (hostile mode, the misbehaviour the frontend reports, honest outputs before it)
BEFORE_ANY_TOKEN = [
    (Kind.OUTPUT_GARBAGE, Misbehaviour.UNDECODABLE_OUTPUT),
    (Kind.TEXT_GARBAGE, Misbehaviour.UNDECODABLE_OUTPUT),
    (Kind.ERROR_DETAILS_GARBAGE, Misbehaviour.UNDECODABLE_STATUS),
    (Kind.ERROR_INFO_GARBAGE, Misbehaviour.UNDECODABLE_STATUS),
    (Kind.OUT_OF_VOCAB, Misbehaviour.OUT_OF_VOCAB),
    (Kind.LENGTH_NO_TOKENS, Misbehaviour.EMPTY_LENGTH),
    (Kind.BAD_INDEX, Misbehaviour.BAD_INDEX),
]
FORMATS = [("vllm", True), ("vllm", False), ("sglang", True), ("sglang", False)]
FORMAT_IDS = ["vllm-stream", "vllm-unary", "sglang-stream", "sglang-unary"]


@pytest.mark.parametrize(("fmt", "stream"), FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize(("kind", "reported"), BEFORE_ANY_TOKEN, ids=[k.value for k, _ in BEFORE_ANY_TOKEN])
async def test_a_misbehaving_worker_before_any_token_costs_no_request(
    kind: Kind, reported: Misbehaviour, fmt: str, stream: bool
) -> None:
    async with fleet(kinds=[kind]) as f:
        with structlog.testing.capture_logs() as logs:
            answers = await ask_many(f, stream=stream, prefix=f"{kind.value}-{stream}", fmt=fmt)
        hostile = [a for a in answers if landed_on_hostile(f, a)]
        assert hostile, "no request landed on the hostile worker"
        # Every request, on the hostile worker or not, got its whole answer: the hostile
        # worker's were run again on an honest one.
        assert all(complete(a) for a in answers), [a for a in answers if not complete(a)]
        assert all(a.done for a in answers)
        assert f.hostile.misbehaved[kind] == len(hostile)
        assert f.misbehaviour(reported) == len(hostile)
        assert len(logged(logs, f, reported)) == 1  # once per worker and kind, however many
        assert f.requests("ok") == REQUESTS


AFTER_TOKENS = [
    (Kind.OUTPUT_GARBAGE, Misbehaviour.UNDECODABLE_OUTPUT),
    (Kind.TEXT_GARBAGE, Misbehaviour.UNDECODABLE_OUTPUT),
    (Kind.ERROR_DETAILS_GARBAGE, Misbehaviour.UNDECODABLE_STATUS),
    (Kind.ERROR_INFO_GARBAGE, Misbehaviour.UNDECODABLE_STATUS),
    (Kind.OUT_OF_VOCAB, Misbehaviour.OUT_OF_VOCAB),
]


@pytest.mark.parametrize(("fmt", "stream"), FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize(("kind", "reported"), AFTER_TOKENS, ids=[k.value for k, _ in AFTER_TOKENS])
async def test_a_misbehaving_worker_after_tokens_ends_its_requests_with_the_formats_error(
    kind: Kind, reported: Misbehaviour, fmt: str, stream: bool
) -> None:
    async with fleet(kinds=[kind], honest_outputs=2) as f:
        with structlog.testing.capture_logs() as logs:
            answers = await ask_many(f, stream=stream, prefix=kind.value, fmt=fmt)
        hostile = [a for a in answers if landed_on_hostile(f, a)]
        assert hostile, "no request landed on the hostile worker"
        for answer in answers:
            if answer in hostile:
                # The format's error, and the response's end; streamed, after the two tokens
                # it delivered.
                assert answer.error
                assert not answer.finished
                assert answer.done
                if stream:
                    assert answer.status == 200
                    assert len(answer.tokens) == 2
                else:
                    assert answer.status >= 500
            else:
                assert complete(answer), answer
                assert answer.done
        assert f.misbehaviour(reported) == len(hostile)
        assert len(logged(logs, f, reported)) == 1
        assert f.requests("ok") == REQUESTS - len(hostile)
        assert f.requests("error") == len(hostile)


@pytest.mark.parametrize(("fmt", "stream"), FORMATS, ids=FORMAT_IDS)
async def test_the_final_output_ends_the_response_though_the_worker_keeps_its_stream_open(
    fmt: str, stream: bool
) -> None:
    async with fleet(kinds=[Kind.FINAL_THEN_OPEN]) as f:
        f.fe.frontend.runner.end_grace = 0.2  # only how long each such response waits
        answers = await ask_many(f, stream=stream, prefix=f"open-{stream}", fmt=fmt)
        hostile = [a for a in answers if landed_on_hostile(f, a)]
        assert hostile, "no request landed on the hostile worker"
        assert all(complete(a) and a.done for a in answers), [a for a in answers if not complete(a)]
        assert f.requests("ok") == REQUESTS
        # The frontend left those calls: none is still open on the hostile worker.
        await f.hostile.wait_idle()


async def test_an_output_after_the_final_one_is_reported_and_changes_no_answer() -> None:
    async with fleet(kinds=[Kind.OUTPUT_AFTER_FINAL]) as f:
        with structlog.testing.capture_logs() as logs:
            answers = await ask_many(f, stream=True, prefix="after-final")
        hostile = [a for a in answers if landed_on_hostile(f, a)]
        assert hostile, "no request landed on the hostile worker"
        assert all(complete(a) and a.done for a in answers), [a for a in answers if not complete(a)]
        assert f.misbehaviour(Misbehaviour.OUTPUT_AFTER_FINAL) == len(hostile)
        assert len(logged(logs, f, Misbehaviour.OUTPUT_AFTER_FINAL)) == 1
        assert f.requests("ok") == REQUESTS


async def test_a_misbehaving_generate_takes_the_worker_out_of_routing_through_the_sets_reporter() -> None:
    """The runner reports to the worker set's reporter (handler.py wires it), whose ejection
    takes the worker out of routing as soon as its Generate call misbehaved: by the time the
    request that landed there has its answer (from an honest worker)."""
    async with vllm_stack() as first, vllm_stack() as second:
        info = await first.stub.GetModelInfo(sidecar_pb2.GetModelInfoRequest())
        async with hostile_worker(info, kinds=[Kind.OUT_OF_VOCAB]) as hostile:
            addresses = [f"127.0.0.1:{first.server.port}", f"127.0.0.1:{second.server.port}", hostile.address]
            async with frontend_over(addresses, [first, second], formats=(VLLM,)) as fe:
                worker = fe.workers.get(hostile.address)
                assert worker is not None
                for index in range(50):
                    answer = await ask(fe, f"eject-{index}", stream=True)
                    assert complete(answer), answer
                    if hostile.calls["Generate"]:
                        break
                assert hostile.misbehaved[Kind.OUT_OF_VOCAB] == 1
                assert worker.ejected_until is not None
