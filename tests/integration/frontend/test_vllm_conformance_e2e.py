"""vLLM's /inference/v1/generate as a client of the real server sees it, end to end: an
aiohttp client -> Frontend (vLLM format) -> sidecar-vllm -> the testkit vLLM engine, all on
loopback. The expected bytes are vLLM 0.33's (its error handler, its streaming generator)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from testkit.faults import FaultKind, FaultPlan

from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.handler import HandlerConfig
from tests.integration.frontend.fixtures import FrontendStack, frontend_over
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(60)

GENERATE = "/inference/v1/generate"
PROMPT = [101, 202, 303, 404]


@asynccontextmanager
async def over_vllm(
    config: HandlerConfig | None = None, **engine_config: Any
) -> AsyncIterator[FrontendStack]:
    async with (
        vllm_stack(**engine_config) as sidecar,
        frontend_over(
            [f"127.0.0.1:{sidecar.server.port}"], [sidecar], formats=(VLLM, SGLANG), config=config
        ) as fe,
    ):
        yield fe


REFUSALS = [
    (
        {"logprobs": 21},
        "Requested sample logprobs of 21, which is greater than max allowed: 20 "
        "(parameter=logprobs, value=21)",
        "logprobs",
    ),
    (
        {"prompt_logprobs": 25},
        "Requested prompt logprobs of 25, which is greater than max allowed: 20 "
        "(parameter=prompt_logprobs, value=25)",
        "prompt_logprobs",
    ),
]


@pytest.mark.parametrize(("sampling", "words", "param"), REFUSALS)
async def test_an_engine_refusal_reaches_the_client_in_the_engines_words(
    sampling: dict[str, int], words: str, param: str
) -> None:
    async with over_vllm() as fe:
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3, **sampling}}
        async with fe.http.post(fe.url + GENERATE, json=body) as response:
            assert response.status == 400
            assert response.headers["Content-Type"] == "application/json"
            expected = {"error": {"message": words, "type": "BadRequestError", "param": param, "code": 400}}
            assert await response.read() == json.dumps(expected, separators=(",", ":")).encode()

        async with fe.http.post(fe.url + GENERATE, json={**body, "stream": True}) as response:
            assert response.status == 200
            raw = await response.read()
        # vLLM's error event: json.dumps with its default spacing, then [DONE].
        assert raw == b"data: " + json.dumps(expected).encode() + b"\n\ndata: [DONE]\n\n"


# vLLM's words for a LoRA adapter it cannot find (LoRAAdapterNotFoundError, a
# VLLMNotFoundError); its gRPC servicer ends the call with NOT_FOUND and these words. The
# vLLM wire this sidecar speaks carries no adapter, so the testkit engine is told to answer so.
LORA_NOT_FOUND = "Loading lora sql failed: No adapter found for /adapters/sql"


async def test_an_engine_not_found_is_vllms_404_in_the_engines_words() -> None:
    async with over_vllm() as fe:
        plan = FaultPlan(FaultKind.ERROR_AFTER, after=0, code="NOT_FOUND", message=LORA_NOT_FOUND)
        fe.sidecars[0].engine.faults.add("lora", plan)
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}, "request_id": "lora"}
        # vLLM's exception handler: create_error_response(VLLMNotFoundError) -> NotFoundError,
        # 404, param None, the exception's text.
        expected = {"error": {"message": LORA_NOT_FOUND, "type": "NotFoundError", "param": None, "code": 404}}
        async with fe.http.post(fe.url + GENERATE, json=body) as response:
            assert response.status == 404
            assert response.headers["Content-Type"] == "application/json"
            assert await response.read() == json.dumps(expected, separators=(",", ":")).encode()
        # Streamed: the generator's create_streaming_error_response event, then [DONE].
        async with fe.http.post(fe.url + GENERATE, json={**body, "stream": True}) as response:
            assert response.status == 200
            raw = await response.read()
        assert raw == b"data: " + json.dumps(expected).encode() + b"\n\ndata: [DONE]\n\n"
        # A refusal: asked once each, never retried elsewhere.
        assert len(fe.sidecars[0].engine.book.received) == 2


async def stream_of(fe: FrontendStack, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with fe.http.post(fe.url + GENERATE, json={**body, "stream": True}) as response:
        assert response.status == 200
        raw = await response.read()
    blocks = raw.split(b"\n\n")
    assert blocks[-2:] == [b"data: [DONE]", b""]
    return [json.loads(block.removeprefix(b"data: ")) for block in blocks[:-2]]


async def test_the_last_chunk_carries_the_last_token_and_the_finish() -> None:
    async with over_vllm() as fe:
        chunks = await stream_of(fe, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4}})
    choices = [c["choices"][0] for c in chunks]
    # As vLLM streams one token per engine step: four chunks, the fourth finishing.
    assert [len(c["token_ids"]) for c in choices] == [1, 1, 1, 1]
    assert [c["finish_reason"] for c in choices] == [None, None, None, "length"]


@pytest.mark.parametrize(("stops", "reported"), [([2], 2), ([], None)])
async def test_eos_is_the_stop_reason_when_the_caller_listed_it(
    stops: list[int], reported: int | None
) -> None:
    # The testkit's EOS rule: a prompt starting 99, k makes the k-th token the EOS (2).
    body = {"token_ids": [99, 3, 500], "sampling_params": {"max_tokens": 10, "stop_token_ids": stops}}
    async with over_vllm() as fe:
        async with fe.http.post(fe.url + GENERATE, json=body) as response:
            unary = await response.json()
        chunks = await stream_of(fe, body)
    (choice,) = unary["choices"]
    assert choice["token_ids"][-1] == 2
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", reported)
    last = chunks[-1]["choices"][0]
    assert (last["token_ids"], last["finish_reason"], last["stop_reason"]) == ([2], "stop", reported)


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "DELETE"])
@pytest.mark.parametrize("path", ["/nope", "/v1/completions", "/inference/v1/generate/x", "/"])
async def test_an_unknown_path_is_fastapis_404(method: str, path: str) -> None:
    async with over_vllm() as fe, fe.http.request(method, fe.url + path) as response:
        assert response.status == 404
        assert response.headers["Content-Type"] == "application/json"
        assert await response.read() == b'{"detail":"Not Found"}'


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/inference/v1/generate", "POST"),
        ("PUT", "/inference/v1/abort_requests", "POST"),
        ("POST", "/v1/models", "GET"),
        ("HEAD", "/health", "GET"),  # FastAPI routes do not answer HEAD for GET
        # SGLang's route takes POST and PUT; Starlette joins a set, in no fixed order: ours sorts.
        ("GET", "/generate", "POST, PUT"),
    ],
)
async def test_a_wrong_method_is_fastapis_405_with_allow(method: str, path: str, allow: str) -> None:
    async with over_vllm() as fe, fe.http.request(method, fe.url + path) as response:
        assert response.status == 405
        assert response.headers["Allow"] == allow
        if method != "HEAD":
            assert response.headers["Content-Type"] == "application/json"
            assert await response.read() == b'{"detail":"Method Not Allowed"}'


DEAD = {
    "error": {
        "message": "The server had an error while processing your request.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
# One worker and no migration: the failure reaches the client as it is.
ALONE = HandlerConfig(migration_limit=0, worker_wait=0.2)


@pytest.mark.parametrize(
    "plan",
    [
        FaultPlan(FaultKind.ERROR_AFTER, after=2),  # INTERNAL
        FaultPlan(FaultKind.ERROR_AFTER, after=2, code="DATA_LOSS", message="boom"),
        FaultPlan(FaultKind.ERROR_AFTER, after=2, code="UNAVAILABLE"),
        FaultPlan(FaultKind.CLOSE_AFTER, after=2),  # the stream ends without a terminal
        # Every token, then a terminal the sidecar cannot read.
        FaultPlan(FaultKind.MALFORMED_TERMINAL, variant="unknown_finish_reason"),
    ],
    ids=["internal", "data-loss", "unavailable", "closed", "malformed"],
)
async def test_an_engine_failing_mid_stream_is_vllms_500_event_never_an_empty_one(plan: FaultPlan) -> None:
    async with over_vllm(ALONE) as fe:
        fe.sidecars[0].engine.faults.add("dies", plan)
        body = {
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 9},
            "request_id": "dies",
            "stream": True,
        }
        async with fe.http.post(fe.url + GENERATE, json=body) as response:
            assert response.status == 200
            raw = await response.read()
    blocks = raw.split(b"\n\n")
    assert blocks[-2:] == [b"data: [DONE]", b""]
    # vLLM's EngineDeadError event: json.dumps spacing, its sentence and type.
    assert blocks[-3] == b"data: " + json.dumps(DEAD).encode()
    tokens = [
        t
        for block in blocks[:-3]
        for t in json.loads(block.removeprefix(b"data: "))["choices"][0]["token_ids"]
    ]
    assert len(tokens) == (9 if plan.kind is FaultKind.MALFORMED_TERMINAL else 2)


async def test_an_engine_gone_before_the_stream_is_vllms_500() -> None:
    async with over_vllm(ALONE) as fe:
        fe.sidecars[0].engine.faults.add("dies", FaultPlan(FaultKind.ERROR_AFTER, after=0))
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 9}, "request_id": "dies"}
        async with fe.http.post(fe.url + GENERATE, json=body) as response:
            assert response.status == 500
            assert await response.read() == json.dumps(DEAD, separators=(",", ":")).encode()


async def test_an_engine_process_dying_mid_stream_is_vllms_500_event() -> None:
    async with over_vllm(ALONE, token_latency_ms=50.0) as fe:
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 200}, "stream": True}
        async with fe.http.post(fe.url + GENERATE, json=body) as response:
            assert response.status == 200
            first = await response.content.readline()
            assert first.startswith(b"data: {")
            await fe.sidecars[0].engine.die()
            raw = first + await response.read()
    blocks = raw.split(b"\n\n")
    assert blocks[-2:] == [b"data: [DONE]", b""]
    assert blocks[-3] == b"data: " + json.dumps(DEAD).encode()


async def test_unsigned_32_bit_seeds_are_served_and_deterministic() -> None:
    async def tokens(fe: FrontendStack, seed: int) -> list[int]:
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "seed": seed}}
        async with fe.http.post(fe.url + GENERATE, json=body) as response:
            assert response.status == 200
            ids: list[int] = (await response.json())["choices"][0]["token_ids"]
            return ids

    async with over_vllm() as fe:
        big = await tokens(fe, 3_000_000_000)
        assert big == await tokens(fe, 3_000_000_000), "the same seed, the same sample"
        assert big == await tokens(fe, 3_000_000_000 - 2**32), "the same 32 bits"
        assert big != await tokens(fe, 3_000_000_001)

        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "seed": 2**32}}
        async with fe.http.post(fe.url + GENERATE, json=body) as response:
            assert response.status == 400
            error = (await response.json())["error"]
        assert error["param"] == "seed"
        assert error["message"] == (
            "sampling_options.seed: 4294967296 needs more than the engine's 32 bits "
            "(a seed from -2147483648 to 4294967295 is carried)"
        )


async def test_logprob_ranks_follow_the_engines_order() -> None:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 12, "logprobs": 3}}
    async with over_vllm() as fe, fe.http.post(fe.url + GENERATE, json=body) as response:
        assert response.status == 200
        content = (await response.json())["choices"][0]["logprobs"]["content"]
    assert len(content) == 12
    known = 0
    for entry in content:
        tops = entry["top_logprobs"]
        assert tops[0]["token_id"] == entry["token_id"]
        assert tops[0]["rank"] == entry["rank"]
        others = tops[1:]
        assert all(isinstance(t["rank"], int) for t in others), "the top k's ranks are their places"
        by_logprob = sorted(tops, key=lambda t: -t["logprob"])
        if entry["rank"] is None:
            # Last of the list: the k-th, or beyond the top k (the wire cannot say which).
            assert by_logprob[-1] is tops[0]
            assert [t["rank"] for t in others] == list(range(1, len(others) + 1))
        else:
            known += 1
            assert [t["rank"] for t in by_logprob] == list(range(1, len(tops) + 1))
    assert known > 0


async def test_prompt_logprob_ranks_are_their_places_in_the_top_k() -> None:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 2}}
    async with over_vllm() as fe, fe.http.post(fe.url + GENERATE, json=body) as response:
        assert response.status == 200
        positions = (await response.json())["prompt_logprobs"]
    assert positions[0] is None
    for token, position in zip(PROMPT[1:], positions[1:], strict=True):
        first, *others = position.items()
        assert first[0] == str(token), "the prompt's own token first"
        ranks = [candidate["rank"] for _, candidate in others]
        assert all(isinstance(rank, int) for rank in ranks)
        if first[1]["rank"] is not None:
            assert sorted([first[1]["rank"], *ranks]) == list(range(1, len(position) + 1))


@pytest.mark.parametrize(("method", "path"), [("POST", "/inference/v1/generate/"), ("GET", "/health/")])
async def test_a_known_path_with_a_trailing_slash_is_starlettes_307(method: str, path: str) -> None:
    async with (
        over_vllm() as fe,
        fe.http.request(method, fe.url + path + "?x=1", allow_redirects=False) as response,
    ):
        assert response.status == 307
        assert response.headers["Location"] == fe.url + path.rstrip("/") + "?x=1"
        assert await response.read() == b""
        assert "Content-Type" not in response.headers
