"""Both real format plugins through the frontend over real sidecars: SGLang's /generate and
vLLM's /inference/v1/generate -> Frontend -> sidecar-vllm / sidecar-sglang (gRPC and HTTP
transports) -> testkit engines, with aiohttp as the client. The formats' own laws (fold,
round trip, refusals) are the plugins' unit tests; here: that they hold over the wire."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
from testkit.faults import FaultKind, FaultPlan

from sidecar_frontend.formats.base import Format
from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.sglang import SglangFormat
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.handler import HandlerConfig
from tests.e2e_helpers import until
from tests.integration.frontend.fixtures import FrontendStack, frontend_over, sse_events
from tests.sglang_fixtures import sglang_stack
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(60)

PROMPT = [101, 202, 303, 404]
FORMATS = (SGLANG, VLLM)


@asynccontextmanager
async def over(
    engine: str,
    config: HandlerConfig | None = None,
    formats: Sequence[Format] = FORMATS,
    **engine_config: Any,
) -> AsyncIterator[FrontendStack]:
    """The frontend (both formats) over one sidecar: ``vllm``, ``sglang-grpc`` or ``sglang-http``."""
    if engine == "vllm":
        stack_cm: Any = vllm_stack(**engine_config)
    else:
        stack_cm = sglang_stack(engine.removeprefix("sglang-"), **engine_config)  # type: ignore[arg-type]
    async with (
        stack_cm as sidecar,
        frontend_over([f"127.0.0.1:{sidecar.server.port}"], [sidecar], formats=formats, config=config) as fe,
    ):
        yield fe


async def events_of(fe: FrontendStack, path: str, body: dict[str, Any]) -> list[str]:
    async with fe.http.post(fe.url + path, json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        return await sse_events(response)


ENGINES = ["vllm", "sglang-grpc", "sglang-http"]


@pytest.mark.parametrize("engine", ENGINES)
async def test_sglang_unary_equals_the_last_cumulative_stream_event(engine: str) -> None:
    async with over(engine) as fe:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
        async with fe.http.post(fe.url + "/generate", json=body) as response:
            assert response.status == 200
            unary = await response.json()
        events = await events_of(fe, "/generate", {**body, "stream": True})
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert len(unary["output_ids"]) == 5
        assert last["output_ids"] == unary["output_ids"], "cumulative: the last event holds everything"
        assert unary["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
        assert last["meta_info"]["finish_reason"] == unary["meta_info"]["finish_reason"]
        assert "text" not in unary, "no tokenizer, no text key"


async def test_sglang_incremental_streaming_sends_only_new_tokens() -> None:
    incremental = SglangFormat(incremental_streaming_output=True)
    async with over("vllm", formats=(incremental, VLLM)) as fe:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}, "stream": True}
        events = [json.loads(e) for e in (await events_of(fe, "/generate", body))[:-1]]
        assert sum(len(e["output_ids"]) for e in events) == 6


@pytest.mark.parametrize("engine", ["vllm", "sglang-grpc"])
async def test_vllm_unary_and_stream_with_usage_agree(engine: str) -> None:
    async with over(engine) as fe:
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4}}
        async with fe.http.post(fe.url + "/inference/v1/generate", json=body) as response:
            assert response.status == 200
            unary = await response.json()
        assert unary["request_id"].startswith("generate-tokens-")
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        events = await events_of(fe, "/inference/v1/generate", stream_body)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        streamed = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
        assert streamed == unary["choices"][0]["token_ids"]
        # vLLM drops the null fields in the usage chunk only.
        assert chunks[-1]["usage"] == {k: v for k, v in unary["usage"].items() if v is not None}


async def test_sglang_batch_runs_each_prompt_in_order() -> None:
    async with over("vllm") as fe:
        prompts = [PROMPT, [7, 8, 9]]
        body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 3}}
        async with fe.http.post(fe.url + "/generate", json=body) as response:
            batch = await response.json()
        singles = []
        for prompt in prompts:
            one = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}}
            async with fe.http.post(fe.url + "/generate", json=one) as response:
                singles.append(await response.json())
        assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles]


async def test_sglang_abort_request_by_rid_ends_the_stream_with_an_abort_finish() -> None:
    async with over("vllm", token_latency_ms=40.0) as fe:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300}, "stream": True, "rid": "job"}
        async with fe.http.post(fe.url + "/generate", json=body) as response:
            assert (await response.content.readline()).startswith(b"data: ")
            async with fe.http.post(fe.url + "/abort_request", json={"rid": "job"}) as abort:
                assert abort.status == 200
                assert await abort.read() == b""
            events = await sse_events(response)
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        engine = fe.sidecars[0].engine
        await until(lambda: fe.sidecars[0].server.inflight == 0, "the sidecar is idle")
        assert len([p for p in engine.book.aborts if p.endswith("-job")]) == 1


async def test_vllm_abort_requests_by_the_clients_id() -> None:
    async with over("vllm", token_latency_ms=40.0) as fe:
        body = {
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 300},
            "stream": True,
            "request_id": "v1",
        }
        async with fe.http.post(fe.url + "/inference/v1/generate", json=body) as response:
            assert (await response.content.readline()).startswith(b"data: ")
            async with fe.http.post(
                fe.url + "/inference/v1/abort_requests", json={"request_ids": ["v1"]}
            ) as a:
                assert a.status == 200
            events = await sse_events(response)
        assert events[-1] == "[DONE]"
        finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e).get("choices", [])]
        assert finishes[-1] == "abort"


async def test_a_text_prompt_is_refused_in_sglangs_shape_and_reaches_no_worker() -> None:
    async with over("vllm") as fe:
        async with fe.http.post(fe.url + "/generate", json={"text": "hello"}) as response:
            assert response.status == 400
            assert "error" in await response.json()
        assert fe.sidecars[0].engine.book.received == []


async def test_a_fault_after_the_first_token_is_the_formats_error() -> None:
    async with over("vllm") as fe:
        fe.sidecars[0].engine.faults.add(
            "late", FaultPlan(FaultKind.ERROR_AFTER, after=2, code="UNAVAILABLE")
        )
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 9}, "stream": True, "rid": "late"}
        events = await events_of(fe, "/generate", body)
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(last["output_ids"]) == 2


async def test_workers_of_two_models_are_both_served_and_a_request_runs_on_the_model_it_names() -> None:
    async with vllm_stack() as first, vllm_stack(served_model_name="another-model") as other:
        addresses = [f"127.0.0.1:{first.server.port}", f"127.0.0.1:{other.server.port}"]
        async with frontend_over(addresses, [first, other], formats=FORMATS) as fe:
            assert sorted(fe.workers.models()) == ["another-model", "testkit-model"]
            sampling = {"max_new_tokens": 2}
            for model, sidecar in (("another-model", other), ("testkit-model", first)):
                before = len(sidecar.engine.book.received)
                body = {"input_ids": PROMPT, "sampling_params": sampling, "model": model}
                async with fe.http.post(fe.url + "/generate", json=body) as response:
                    assert response.status == 200
                vllm_body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}, "model": model}
                async with fe.http.post(fe.url + "/inference/v1/generate", json=vllm_body) as response:
                    assert response.status == 200
                    assert (await response.json())["model"] == model
                assert len(sidecar.engine.book.received) == before + 2
            async with fe.http.get(fe.url + "/v1/models") as response:
                cards = (await response.json())["data"]
                assert [card["id"] for card in cards] == ["another-model", "testkit-model"]


def _escaped_model_key(body: dict[str, Any]) -> bytes:
    text = json.dumps(body)
    assert text.count('"model"') == 1
    return text.replace('"model"', '"mod\\u0065l"').encode()


async def test_a_request_runs_on_the_model_its_body_names_however_the_json_spells_the_key() -> None:
    # The format parses the body once and the model is read from that parse: a key written
    # with a JSON escape is the same key ("mod\u0065l" is "model"), as the real servers read it.
    async with vllm_stack() as first, vllm_stack(served_model_name="another-model") as other:
        addresses = [f"127.0.0.1:{first.server.port}", f"127.0.0.1:{other.server.port}"]
        async with frontend_over(addresses, [first, other], formats=FORMATS) as fe:
            # The model a request that names none would run on is not the one named.
            stacks = {"testkit-model": first, "another-model": other}
            model = next(name for name in stacks if name != fe.workers.default_model())
            named, unnamed = stacks[model], stacks[fe.workers.default_model() or ""]
            headers = {"Content-Type": "application/json"}
            sglang_body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "model": model}
            async with fe.http.post(
                fe.url + "/generate", data=_escaped_model_key(sglang_body), headers=headers
            ) as response:
                assert response.status == 200
            vllm_body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}, "model": model}
            async with fe.http.post(
                fe.url + "/inference/v1/generate", data=_escaped_model_key(vllm_body), headers=headers
            ) as response:
                assert response.status == 200
                assert (await response.json())["model"] == model
            assert len(named.engine.book.received) == 2
            assert unnamed.engine.book.received == []


async def test_a_model_no_worker_serves_is_404_in_each_formats_shape_and_reaches_no_worker() -> None:
    async with vllm_stack() as first, vllm_stack(served_model_name="another-model") as other:
        addresses = [f"127.0.0.1:{first.server.port}", f"127.0.0.1:{other.server.port}"]
        async with frontend_over(addresses, [first, other], formats=FORMATS) as fe:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "model": "nobody"}
            async with fe.http.post(fe.url + "/generate", json=body) as response:
                assert response.status == 404
                assert await response.json() == {
                    "object": "error",
                    "message": "The model `nobody` does not exist. "
                    "Served models: another-model, testkit-model.",
                    "type": "404",
                    "param": None,
                    "code": 404,
                }
            vllm_body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}, "model": "nobody"}
            async with fe.http.post(fe.url + "/inference/v1/generate", json=vllm_body) as response:
                assert response.status == 404
                assert await response.json() == {
                    "error": {
                        "message": "The model `nobody` does not exist. "
                        "Valid aliases: another-model, testkit-model.",
                        "type": "NotFoundError",
                        "param": "model",
                        "code": 404,
                    }
                }
            # The body's own faults come first, as vLLM checks the model after the body.
            bad_body = {"token_ids": [], "sampling_params": {"max_tokens": 2}, "model": "nobody"}
            async with fe.http.post(fe.url + "/inference/v1/generate", json=bad_body) as response:
                assert response.status == 400
            assert first.engine.book.received == other.engine.book.received == []
            reason = {"outcome": "invalid", "reason": "MODEL_NOT_FOUND"}
            for fmt in ("sglang", "vllm"):
                labels = {"format": fmt, **reason}
                assert fe.metrics.registry.get_sample_value("frontend_requests_total", labels) == 1
