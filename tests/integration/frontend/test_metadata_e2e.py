"""Which weights made which tokens, and the routed experts, from a testkit SGLang engine through
its sidecar and the frontend (docs/metadata.md): ``weight_version``, ``weight_versions`` and
``routed_experts`` exactly what the engine answers directly for the same request, also when
the weights change mid-generation and when the generation migrates to an engine on newer
weights; refused by name where the worker's wire cannot carry them."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest

from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from tests.integration.frontend.fixtures import FrontendStack, frontend_over
from tests.sglang_fixtures import sglang_stack

pytestmark = pytest.mark.timeout(90)

PROMPT = [101, 202, 303, 404]
EXPERTS: dict[str, Any] = {
    "enable_return_routed_experts": True,
    "num_hidden_layers": 3,
    "num_experts_per_tok": 2,
    "num_experts": 16,
}


@asynccontextmanager
async def fleet(transport: str, *versions: str, **config: Any) -> AsyncIterator[FrontendStack]:
    """One sidecar per version (its engine launched at that version) behind one frontend."""
    async with AsyncExitStack() as stack:
        sidecars = [
            await stack.enter_async_context(
                sglang_stack(transport, weight_version=version, **EXPERTS, **config)  # type: ignore[arg-type]
            )
            for version in versions
        ]
        addresses = [f"127.0.0.1:{s.server.port}" for s in sidecars]
        async with frontend_over(addresses, sidecars, formats=(SGLANG, VLLM)) as fe:
            yield fe


def generate_body(rid: str, max_new: int, *, stream: bool, **fields: Any) -> dict[str, Any]:
    return {
        "rid": rid,
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
        "stream": stream,
        **fields,
    }


async def answer(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The final answer of ``/generate`` at ``url`` (a stream's last event: it is cumulative)."""
    async with http.post(url + "/generate", json=body) as response:
        assert response.status == 200, await response.text()
        if not body["stream"]:
            result: dict[str, Any] = await response.json()
            return result
        events = [
            json.loads(line[len(b"data: ") :])
            async for line in response.content
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]")
        ]
        assert all("weight_versions" not in e["meta_info"] for e in events[:-1])
        last: dict[str, Any] = events[-1]
        return last


def metadata(result: dict[str, Any]) -> dict[str, Any]:
    meta = result["meta_info"]
    return {
        "output_ids": result["output_ids"],
        "weight_version": meta["weight_version"],
        "weight_versions": meta.get("weight_versions"),
        "routed_experts": meta.get("routed_experts"),
    }


@pytest.mark.parametrize("stream", [False, True])
async def test_the_frontend_answers_what_the_engine_answers(stream: bool) -> None:
    async with fleet("http", "run-7") as fe:
        engine_url = fe.sidecars[0].engine.http_url
        fields = {"return_routed_experts": True, "routed_experts_start_len": 2}
        direct = await answer(fe.http, engine_url, generate_body("direct", 6, stream=stream, **fields))
        through = await answer(fe.http, fe.url, generate_body("through", 6, stream=stream, **fields))
        assert metadata(through) == metadata(direct)
        assert direct["meta_info"]["weight_versions"] == [{"version": "run-7", "start": 0, "end": 6}]
        # (prompt + output - 1 - start) positions of 3 layers x 2 experts, int32 each.
        assert len(base64.b64decode(direct["meta_info"]["routed_experts"])) == (4 + 6 - 1 - 2) * 3 * 2 * 4
        # Not asked: not answered.
        plain = await answer(fe.http, fe.url, generate_body("plain", 3, stream=stream))
        assert "routed_experts" not in plain["meta_info"]


class Reader:
    """One open SSE stream, read an event at a time."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.events: list[dict[str, Any]] = []

    async def next(self) -> bool:
        async for line in self.response.content:
            if line.startswith(b"data: [DONE]"):
                return False
            if line.startswith(b"data: "):
                self.events.append(json.loads(line[len(b"data: ") :]))
                return True
        return False

    async def rest(self) -> dict[str, Any]:
        while await self.next():
            pass
        return self.events[-1]


async def test_an_update_mid_generation_splits_the_spans_where_the_engine_does() -> None:
    async with fleet("http", "default", token_latency_ms=20) as fe:
        engine = fe.sidecars[0].engine
        fields = {"return_routed_experts": True}
        async with (
            fe.http.post(
                engine.http_url + "/generate", json=generate_body("direct", 10, stream=True, **fields)
            ) as a,
            fe.http.post(fe.url + "/generate", json=generate_body("through", 10, stream=True, **fields)) as b,
        ):
            direct, through = Reader(a), Reader(b)
            assert await direct.next()
            assert await through.next()
            await engine.pause_generation("in_place")
            made = {rid: engine.output_tokens(rid) for rid in engine.live_ids()}
            assert len(made) == 2
            before_direct = made.pop("direct")
            (before_through,) = made.values()
            engine.update_weight_version("step-1", abort_all_requests=False)
            engine.continue_generation()
            direct_last, through_last = await direct.rest(), await through.rest()
        for last, before in ((direct_last, before_direct), (through_last, before_through)):
            assert last["meta_info"]["weight_versions"] == [
                {"version": "default", "start": 0, "end": before},
                {"version": "step-1", "start": before, "end": 10},
            ]
            assert last["meta_info"]["weight_version"] == "step-1"
        # Each event says the label the engine gave it.
        assert through.events[0]["meta_info"]["weight_version"] == "default"
        assert through.events[-1]["meta_info"]["weight_version"] == "step-1"
        # The routing depends on the sequence only, not on the weights' label.
        assert through_last["output_ids"] == direct_last["output_ids"]
        assert through_last["meta_info"]["routed_experts"] == direct_last["meta_info"]["routed_experts"]


async def test_a_migrated_generation_answers_spans_over_its_whole_output_and_all_its_experts() -> None:
    async with fleet("http", "old", "new", token_latency_ms=15) as fe:
        fields = {"return_routed_experts": True, "routed_experts_start_len": 1}
        reference = await answer(
            fe.http, fe.sidecars[1].engine.http_url, generate_body("reference", 12, stream=False, **fields)
        )
        # Whichever engine the first attempt runs on (its first event says), it is stopped.
        async with fe.http.post(
            fe.url + "/generate", json=generate_body("moving", 12, stream=True, **fields)
        ) as r:
            reader = Reader(r)
            assert await reader.next()
            first = reader.events[0]["meta_info"]["weight_version"]
            runs_on = 0 if first == "old" else 1
            await fe.sidecars[runs_on].server.stop()
            last = await reader.rest()
        labels = [e["meta_info"]["weight_version"] for e in reader.events]
        moved_at = next(
            len(e["output_ids"]) for e in reversed(reader.events) if e["meta_info"]["weight_version"] == first
        )
        other = "new" if first == "old" else "old"
        assert labels[-1] == other
        assert 0 < moved_at < 12
        assert last["output_ids"] == reference["output_ids"]
        assert last["meta_info"]["weight_versions"] == [
            {"version": first, "start": 0, "end": moved_at},
            {"version": other, "start": moved_at, "end": 12},
        ]
        assert last["meta_info"]["weight_version"] == other
        # One attempt's experts, byte for byte: the continuation asked from the original start.
        assert last["meta_info"]["routed_experts"] == reference["meta_info"]["routed_experts"]


async def test_a_grpc_worker_carries_versions_and_refuses_routed_experts_by_name() -> None:
    async with fleet("grpc", "run-9") as fe:
        plain = await answer(fe.http, fe.url, generate_body("g1", 3, stream=False))
        assert plain["meta_info"]["weight_version"] == "run-9"
        assert plain["meta_info"]["weight_versions"] == [{"version": "run-9", "start": 0, "end": 3}]
        body = generate_body("g2", 3, stream=False, return_routed_experts=True)
        async with fe.http.post(fe.url + "/generate", json=body) as response:
            assert response.status == 400
            assert "return_routed_experts" in await response.text()


async def test_vllm_format_answers_the_spans_of_an_sglang_worker() -> None:
    async with fleet("http", "run-3") as fe:
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4, "ignore_eos": True}}
        async with fe.http.post(fe.url + "/inference/v1/generate", json=body) as response:
            assert response.status == 200
            choice = (await response.json())["choices"][0]
        assert choice["weight_versions"] == [{"version": "run-3", "start": 0, "end": 4}]


@pytest.mark.parametrize(("transport", "status"), [("http", 200), ("grpc", 400)])
async def test_custom_params_reach_an_http_worker_and_are_refused_by_name_over_grpc(
    transport: str, status: int
) -> None:
    async with fleet(transport, "default") as fe:
        body = generate_body("c1", 2, stream=False)
        body["sampling_params"]["custom_params"] = {"__sglang_reasoning_end_token_ids": [7]}
        async with fe.http.post(fe.url + "/generate", json=body) as response:
            assert response.status == status
            if status == 400:
                assert "custom_params" in await response.text()


@pytest.mark.parametrize(("transport", "status"), [("http", 200), ("grpc", 400)])
async def test_a_sampling_mask_request_reaches_an_http_worker_and_is_refused_by_name_over_grpc(
    transport: str, status: int
) -> None:
    async with fleet(transport, "default") as fe:
        body = generate_body("m1", 2, stream=False, return_sampling_mask=True)
        async with fe.http.post(fe.url + "/generate", json=body) as response:
            assert response.status == status
            if status == 400:
                assert "return_sampling_mask" in await response.text()
            else:
                # The testkit engine makes no masks: as SGLang, no mask keys without them.
                assert "output_token_sampling_mask" not in (await response.json())["meta_info"]
