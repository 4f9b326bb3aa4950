"""Routed experts of a disaggregated (prefill -> decode) request through the frontend, over
testkit SGLang engines in prefill and decode mode behind their HTTP sidecars
(docs/metadata.md, "Across prefill -> decode"). The law: the client gets, byte for byte, the
routed experts one aggregated engine answers for the same request, whatever the start. The
testkit's decode engine answers zero rows for the prompt it never ran, as SGLang's does, so an
answer that took the decode's rows for the prompt would differ."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web
from testkit.routed_experts import ExpertsShape, decode_routed_experts

from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.handler import Frontend, HandlerConfig
from sidecar_frontend.metrics import Metrics
from sidecar_frontend.workers import WorkerSet
from tests.e2e_helpers import until
from tests.integration.frontend.fixtures import FAST_WORKERS, FrontendStack
from tests.sglang_fixtures import sglang_stack

pytestmark = pytest.mark.timeout(90)

PROMPT = [101, 202, 303, 404, 505, 606]
SHAPE = ExpertsShape(num_layers=3, top_k=2, num_experts=16)
EXPERTS: dict[str, Any] = {
    "enable_return_routed_experts": True,
    "num_hidden_layers": SHAPE.num_layers,
    "num_experts_per_tok": SHAPE.top_k,
    "num_experts": SHAPE.num_experts,
}


@asynccontextmanager
async def fleet(*roles: tuple[str, dict[str, Any]]) -> AsyncIterator[FrontendStack]:
    """One SGLang HTTP sidecar per role (agg, prefill or decode; its engine's config) behind
    one frontend."""
    async with AsyncExitStack() as stack:
        sidecars = [
            await stack.enter_async_context(sglang_stack("http", mode=role, **config))  # type: ignore[arg-type]
            for role, config in roles
        ]
        workers = await stack.enter_async_context(WorkerSet(FAST_WORKERS, rand=random.Random(3)))
        for (role, _), s in zip(roles, sidecars, strict=True):
            workers.add_worker(f"127.0.0.1:{s.server.port}", role)
        with anyio.fail_after(20):
            for role in {role for role, _ in roles}:
                await workers.wait_serving(sum(1 for r, _ in roles if r == role), role)
        metrics = Metrics()
        frontend = Frontend((SGLANG, VLLM), workers, HandlerConfig(), metrics=metrics, rand=random.Random(5))
        runner = web.AppRunner(frontend.build_app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        http = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)))
        yield FrontendStack(
            frontend, workers, metrics, f"http://127.0.0.1:{runner.addresses[0][1]}", http, sidecars
        )


def body(rid: str, max_new: int, *, stream: bool, **fields: Any) -> dict[str, Any]:
    return {
        "rid": rid,
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
        "stream": stream,
        **fields,
    }


async def answer(http: aiohttp.ClientSession, url: str, request: dict[str, Any]) -> dict[str, Any]:
    """The final answer of ``/generate`` at ``url`` (a stream's last event: it is cumulative)."""
    async with http.post(url + "/generate", json=request) as response:
        assert response.status == 200, await response.text()
        if not request["stream"]:
            result: dict[str, Any] = await response.json()
            return result
        last: dict[str, Any] = {}
        events = [
            json.loads(line[len(b"data: ") :])
            async for line in response.content
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]")
        ]
    last.update(events[-1])
    return last


def bodies(side: Any) -> list[dict[str, Any]]:
    """The /generate bodies the engine behind an HTTP sidecar received."""
    found = side.engine.book.requests()
    assert all(isinstance(m, dict) for m in found)
    return list(found)


CASES = [
    # (max_new_tokens, routed_experts_start_len or None: not sent)
    (7, None),
    (7, 2),
    (5, len(PROMPT)),  # the prefill answers no rows
    (1, 3),  # the decode answers no rows: its one token is the last
]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_disaggregated_request_answers_the_routed_experts_of_an_aggregated_one(stream: bool) -> None:
    requests = []
    for n, (max_new, start) in enumerate(CASES):
        fields: dict[str, Any] = {"return_routed_experts": True}
        if start is not None:
            fields["routed_experts_start_len"] = start
        requests.append((f"r{n}", max_new, start or 0, fields))
    async with fleet(("agg", EXPERTS)) as agg:
        expected = {
            rid: await answer(agg.http, agg.url, body(rid, m, stream=stream, **f))
            for rid, m, _, f in requests
        }
    async with fleet(("prefill", EXPERTS), ("decode", EXPERTS)) as fe:
        for rid, max_new, start, fields in requests:
            want = expected[rid]
            got = await answer(fe.http, fe.url, body(rid, max_new, stream=stream, **fields))
            assert got["output_ids"] == want["output_ids"]
            assert got["meta_info"]["routed_experts"] == want["meta_info"]["routed_experts"], (rid, start)
            rows = decode_routed_experts(got["meta_info"]["routed_experts"], SHAPE)
            assert len(rows) == len(PROMPT) + max_new - 1 - start
        prefill, decode = fe.sidecars
        # The decode leg was asked from the prompt's end: it never ran the prompt.
        starts = {b.get("routed_experts_start_len") for b in bodies(decode)}
        assert starts == {len(PROMPT)}
        await until(lambda: decode.server.inflight == 0 and prefill.server.inflight == 0, "idle")


async def test_the_decode_engines_own_rows_for_the_prompt_are_not_the_routing() -> None:
    """What makes the join needed: asked from the start, the decode engine answers zeros for
    the prompt positions (SGLang's zeroed capture buffer), not the prompt's routing."""
    async with fleet(("prefill", EXPERTS), ("decode", EXPERTS)) as fe:
        _prefill, decode = fe.sidecars
        direct = await answer(
            fe.http,
            decode.engine.http_url,
            body(
                "d1",
                4,
                stream=False,
                return_routed_experts=True,
                bootstrap_host="127.0.0.1",
                bootstrap_room=1,
            ),
        )
        rows = decode_routed_experts(direct["meta_info"]["routed_experts"], SHAPE)
        assert len(rows) == len(PROMPT) + 4 - 1
        zero = [[0] * SHAPE.top_k for _ in range(SHAPE.num_layers)]
        assert rows[: len(PROMPT)] == [zero] * len(PROMPT)
        assert all(row != zero for row in rows[len(PROMPT) :])


async def test_a_prefill_engine_without_routed_experts_leaves_the_answer_without_them() -> None:
    plain = {k: v for k, v in EXPERTS.items() if k != "enable_return_routed_experts"}
    async with fleet(("prefill", plain), ("decode", EXPERTS)) as fe:
        got = await answer(fe.http, fe.url, body("p1", 5, stream=False, return_routed_experts=True))
        assert len(got["output_ids"]) == 5
        assert "routed_experts" not in got["meta_info"]


async def test_not_asked_not_answered_and_the_decode_keeps_the_clients_request() -> None:
    async with fleet(("prefill", EXPERTS), ("decode", EXPERTS)) as fe:
        got = await answer(fe.http, fe.url, body("n1", 4, stream=False))
        assert "routed_experts" not in got["meta_info"]
        _prefill, decode = fe.sidecars
        [sent] = bodies(decode)
        assert "return_routed_experts" not in sent
        assert "routed_experts_start_len" not in sent


async def test_a_disaggregated_generation_that_migrates_answers_all_its_experts() -> None:
    """The decode worker stops mid-stream: the continuation is prefilled again with the tokens
    delivered (from the original start) and decoded elsewhere; the client still gets one
    aggregated engine's rows."""
    fields = {"return_routed_experts": True, "routed_experts_start_len": 2}
    async with fleet(("agg", EXPERTS)) as agg:
        reference = await answer(agg.http, agg.url, body("m", 12, stream=False, **fields))
    slow = {**EXPERTS, "token_latency_ms": 15.0}
    async with fleet(("prefill", slow), ("decode", slow), ("decode", slow)) as fe:
        async with fe.http.post(fe.url + "/generate", json=body("m", 12, stream=True, **fields)) as response:
            assert response.status == 200
            events = []
            async for line in response.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    events.append(json.loads(line[len(b"data: ") :]))
                    if len(events) == 1:
                        [running] = [s for s in fe.sidecars[1:] if s.engine.book.running_ids()]
                        await running.server.stop()
        last = events[-1]
        assert last["output_ids"] == reference["output_ids"]
        assert last["meta_info"]["routed_experts"] == reference["meta_info"]["routed_experts"]
        prefill = fe.sidecars[0]
        # Prefilled twice: the continuation's prompt holds the tokens delivered before.
        prompts = [len(b["input_ids"]) for b in bodies(prefill)]
        assert len(prompts) == 2
        assert prompts[0] == len(PROMPT) < prompts[1] < len(PROMPT) + 12
        # Each decode worker ran one leg, asked from the end of that leg's prompt.
        legs = [bodies(s) for s in fe.sidecars[1:]]
        assert sorted(b["routed_experts_start_len"] for leg in legs for b in leg) == prompts
