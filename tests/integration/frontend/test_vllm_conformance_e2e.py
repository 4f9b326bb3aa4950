"""vLLM's /inference/v1/generate as a client of the real server sees it, end to end: an
aiohttp client -> Frontend (vLLM format) -> sidecar-vllm -> the testkit vLLM engine, all on
loopback. The expected bytes are vLLM 0.33's (its error handler, its streaming generator)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from tests.integration.frontend.fixtures import FrontendStack, frontend_over
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(60)

GENERATE = "/inference/v1/generate"
PROMPT = [101, 202, 303, 404]


@asynccontextmanager
async def over_vllm(**engine_config: Any) -> AsyncIterator[FrontendStack]:
    async with (
        vllm_stack(**engine_config) as sidecar,
        frontend_over([f"127.0.0.1:{sidecar.server.port}"], [sidecar], formats=(VLLM, SGLANG)) as fe,
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
