"""A finished request's objects are freed when it ends, not left for the cyclic collector.

Under load every reference cycle a request leaves behind is work for the collector's passes,
which stop the frontend's event loop, and so every stream on it: ``bench.overload`` saw young
passes of 24-54 ms collecting 6,000-13,000 objects, which put an urgent request's first token
past its target. The cycle then was the admission pass holding the exchange's bound
``preempt`` after release. With the collector off, a request served to the end (unary or
streamed, either format) or left by its client mid-stream must leave no exchange and no
admission pass alive; so must one of several sub-requests (SGLang's ``n``: a task each) that
its client left or that timed out, whose tasks anyio would otherwise end cancelled, keeping
each task's stack in a cycle.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, nullcontext
from typing import Any

import aiohttp
import anyio
import pytest

from sidecar_frontend.admission.gate import Pass
from sidecar_frontend.admission.state import AdmissionSettings
from sidecar_frontend.config import AdmissionConfig
from sidecar_frontend.exchange import Exchange
from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.handler import HandlerConfig
from tests.integration.frontend.fixtures import FrontendStack, frontend_over
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(120)

PROMPT = [101, 202, 303, 404]
SETTINGS = AdmissionSettings(max_queue_depth=64, max_queue_wait=60.0, headroom=0.0)


def vllm_body(stream: bool, max_tokens: int = 4) -> tuple[str, dict[str, Any]]:
    return "/inference/v1/generate", {
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True},
        "stream": stream,
    }


def sglang_body(stream: bool, max_tokens: int = 4) -> tuple[str, dict[str, Any]]:
    return "/generate", {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True},
        "stream": stream,
    }


def live_request_objects() -> list[object]:
    return [o for o in gc.get_objects() if isinstance(o, Exchange | Pass)]


@contextmanager
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def none_left(fe: FrontendStack) -> None:
    """Wait (bounded) until the frontend holds no request and no exchange or pass is alive."""
    with anyio.move_on_after(30):
        while fe.frontend.inflight_ids() or live_request_objects():  # noqa: ASYNC110
            await anyio.sleep(0.02)
    left = live_request_objects()
    referrers = [type(r).__name__ for o in left[:1] for r in gc.get_referrers(o)]
    assert left == [], f"alive after the requests ended: {left[:4]}; the first is held by {referrers}"


async def serve(fe: FrontendStack, path: str, body: dict[str, Any]) -> None:
    with anyio.fail_after(60):
        async with fe.http.post(fe.url + path, json=body) as response:
            assert response.status == 200, await response.text()
            await response.read()


async def leave_after_first_event(fe: FrontendStack, path: str, body: dict[str, Any]) -> None:
    with anyio.fail_after(60):
        response = await fe.http.post(fe.url + path, json=body)
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: "):
                break
        response.close()  # the connection goes with it: the frontend sees its client leave


@asynccontextmanager
async def fleet(request_timeout: float = 3600.0) -> AsyncIterator[FrontendStack]:
    async with (
        vllm_stack(max_num_seqs=4, token_latency_ms=5.0) as sidecar,
        frontend_over(
            [f"127.0.0.1:{sidecar.server.port}"],
            [sidecar],
            formats=(SGLANG, VLLM),
            config=HandlerConfig(worker_wait=60.0, request_timeout=request_timeout),
            # Preemption on (never reached here: one request at a time), so that every request's
            # admission holds the exchange's preempt callback, as in bench.overload.
            admission=AdmissionConfig(settings=SETTINGS, preempt_after=30.0),
        ) as fe,
    ):
        yield fe


@pytest.mark.parametrize("body", [vllm_body, sglang_body], ids=["vllm", "sglang"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_a_served_request_leaves_no_cycle(body: Any, stream: bool) -> None:
    async with fleet() as fe:
        path, payload = body(stream)
        await serve(fe, path, payload)  # first use: imports and caches, before counting
        with collector_off():
            for _ in range(3):
                await serve(fe, path, payload)
            await none_left(fe)


def two_samples(stream: bool, max_tokens: int) -> tuple[str, dict[str, Any]]:
    path, payload = sglang_body(stream=stream, max_tokens=max_tokens)
    payload["sampling_params"]["n"] = 2  # SGLang runs each sample as a request of its own
    return path, payload


# One sub-request (run in the handler's task), and two (SGLang's n: a task each).
@pytest.mark.parametrize("body", [vllm_body, two_samples], ids=["one-sub-request", "two-sub-requests"])
async def test_a_request_its_client_left_mid_stream_leaves_no_cycle(body: Any) -> None:
    async with fleet() as fe:
        path, payload = body(stream=True, max_tokens=2000)
        # A session of its own, so that closing a response really closes its connection.
        async with aiohttp.ClientSession() as http:
            leaving = dataclasses.replace(fe, http=http)
            await leave_after_first_event(leaving, path, payload)
            with collector_off():
                for _ in range(3):
                    await leave_after_first_event(leaving, path, payload)
                await none_left(fe)


async def leave_while_in_flight(fe: FrontendStack, path: str, body: dict[str, Any]) -> None:
    """Send a non-streaming request and close its connection once the frontend runs it."""
    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(serve, fe, path, body)
            while not fe.frontend.inflight_ids():  # noqa: ASYNC110
                await anyio.sleep(0.005)
            group.cancel_scope.cancel()  # the client's connection goes with its request


async def test_a_non_streaming_request_of_several_sub_requests_its_client_left_leaves_no_cycle() -> None:
    async with fleet() as fe:
        path, payload = two_samples(stream=False, max_tokens=2000)
        async with aiohttp.ClientSession() as http:
            leaving = dataclasses.replace(fe, http=http)
            await leave_while_in_flight(leaving, path, payload)
            await none_left(fe)
            with collector_off():
                for _ in range(3):
                    await leave_while_in_flight(leaving, path, payload)
                    await none_left(fe)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_a_request_of_several_sub_requests_that_timed_out_leaves_no_cycle(stream: bool) -> None:
    async with fleet(request_timeout=0.3) as fe:
        path, payload = two_samples(stream=stream, max_tokens=2000)  # 10 s of tokens
        timed_out = 503 if not stream else 200  # SGLang's answer; a stream's failure is its last event
        for attempt in range(4):
            with anyio.fail_after(60), collector_off() if attempt else nullcontext():
                async with fe.http.post(fe.url + path, json=payload) as response:
                    assert response.status == timed_out, await response.text()
                    body = await response.text()
                    assert "timed out" in body, body
                if attempt:
                    await none_left(fe)
