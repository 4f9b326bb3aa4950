"""A busy vLLM worker (admission control) over the vLLM format, end to end.

vLLM refuses a request it has no room for (QueueOverflowError past --max-num-queued-reqs,
MaxQueuedTokensError past --max-num-queued-tokens) with a 503 in the exception's words; over
smg's servicer the refusal is gRPC UNAVAILABLE with that text, which the vLLM sidecar types
OVERLOADED. The frontend then tries another serving worker (nothing was delivered) and waits
for none: with no other worker the client gets vLLM's 503 at once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest
from testkit.faults import FaultKind, FaultPlan
from testkit.vllm_engine import MAX_QUEUED_TOKENS_MESSAGE, QUEUE_OVERFLOW_MESSAGE

from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.handler import HandlerConfig
from tests.integration.frontend.fixtures import FrontendStack, frontend_over, sse_events
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(60)

PATH = "/inference/v1/generate"
PROMPT = [101, 202, 303, 404]
# A worker_wait no test outlives: a request that waited for a worker would fail the test.
NEVER = HandlerConfig(worker_wait=3600.0)


def busy_body(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "Service Unavailable", "param": None, "code": 503}}


@asynccontextmanager
async def fleet(*engines: dict[str, Any]) -> AsyncIterator[FrontendStack]:
    """The frontend (vLLM's format) over one vLLM sidecar per engine config."""
    async with AsyncExitStack() as stack:
        sidecars = [await stack.enter_async_context(vllm_stack(**config)) for config in engines]
        addresses = [f"127.0.0.1:{s.server.port}" for s in sidecars]
        yield await stack.enter_async_context(
            frontend_over(addresses, sidecars, formats=(VLLM,), config=NEVER)
        )


async def post(fe: FrontendStack, rid: str, stream: bool = False) -> tuple[int, Any]:
    body = {"request_id": rid, "token_ids": PROMPT, "sampling_params": {"max_tokens": 3}, "stream": stream}
    with anyio.fail_after(30):
        async with fe.http.post(fe.url + PATH, json=body) as response:
            if stream:
                return response.status, await sse_events(response)
            return response.status, json.loads(await response.read())


def asked(fe: FrontendStack, index: int, rid: str) -> int:
    return sum(1 for got, _ in fe.sidecars[index].engine.book.received if got.endswith(f"-{rid}"))


@pytest.mark.parametrize(
    ("limit", "words"),
    [
        ({"max_num_queued_reqs": 0}, QUEUE_OVERFLOW_MESSAGE),
        ({"max_num_queued_tokens": 0}, MAX_QUEUED_TOKENS_MESSAGE),
    ],
)
async def test_one_busy_worker_answers_vllms_503_in_its_own_words_at_once(
    limit: dict[str, int], words: str
) -> None:
    async with fleet(limit) as fe:
        status, body = await post(fe, "busy")
        assert (status, body) == (503, busy_body(words))
        assert asked(fe, 0, "busy") == 1
        retries = fe.metrics.registry.get_sample_value("frontend_retries_total", {"format": "vllm"})
        assert not retries  # no other worker to try, none waited for


@pytest.mark.parametrize("second", [False, True])
async def test_a_streamed_request_refused_busy_is_the_same_503_and_no_stream(second: bool) -> None:
    # vLLM checks admission before it starts a stream: the same 503 JSON, never a 200. The
    # frontend holds a vLLM stream's 200 until its first bytes; with a free second worker the
    # stream is served there, from its first chunk on.
    async with fleet({"max_num_queued_reqs": 0}, *([{}] if second else [])) as fe:
        async with fe.http.post(
            fe.url + PATH,
            json={
                "request_id": "s",
                "token_ids": PROMPT,
                "sampling_params": {"max_tokens": 3},
                "stream": True,
            },
        ) as response:
            if not second:
                assert response.status == 503
                assert response.headers["Content-Type"] == "application/json"
                assert json.loads(await response.read()) == busy_body(QUEUE_OVERFLOW_MESSAGE)
                return
            assert response.status == 200
            events = await sse_events(response)
        assert [len(json.loads(e)["choices"][0]["token_ids"]) for e in events[:-1]] == [1, 1, 1]
        assert events[-1] == "[DONE]"


async def test_with_a_second_free_worker_the_request_is_served_there() -> None:
    async with fleet({"max_num_queued_reqs": 0}, {}) as fe:
        for n in range(4):  # whichever worker is picked first, the free one serves it
            status, body = await post(fe, f"r{n}")
            assert status == 200, body
            assert len(body["choices"][0]["token_ids"]) == 3
            assert asked(fe, 0, f"r{n}") <= 1
            assert asked(fe, 1, f"r{n}") == 1


async def test_a_held_stream_starts_with_its_first_chunk_not_at_its_end() -> None:
    # The 200 goes out with the first bytes: a stream whose engine then hangs has its status
    # and first chunk in the client's hands while it is still open.
    async with fleet({}) as fe:
        fe.sidecars[0].engine.faults.add("hangs", FaultPlan(FaultKind.HANG, after=1))
        body = {
            "request_id": "hangs",
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 9},
            "stream": True,
        }
        with anyio.fail_after(30):
            async with fe.http.post(fe.url + PATH, json=body) as response:
                assert response.status == 200
                first = await response.content.readline()
        assert len(json.loads(first.decode().removeprefix("data: "))["choices"][0]["token_ids"]) == 1
