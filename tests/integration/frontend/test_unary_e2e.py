"""A non-streaming HTTP request is one answer all the way down: the frontend asks its sidecar
for one answer (``OutputOptions.unary``), the sidecar asks the engine for one (``stream``
false, seen at the testkit engine), the frontend is handed exactly one output per choice,
and the HTTP response is byte for byte what it was when the worker streamed and the
frontend joined the stream (the sidecar made to stream here, as an older one does). Over
every kind of worker: vLLM, SGLang over gRPC and over HTTP (both of SGLang's streaming modes).
"""

from __future__ import annotations

import json
import types
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.exchange import Exchange
from sidecar_frontend.formats.base import Format
from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from tests.integration.frontend.fixtures import FrontendStack, frontend_over
from tests.sglang_fixtures import sglang_stack
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(60)

PROMPT = [101, 202, 303, 404]
# Frozen for both runs: a vLLM reply's `created` is the arrival's wall-clock second.
WALL = 1_760_000_000.25


@asynccontextmanager
async def over(worker: str, fmt: Format, **engine_config: Any) -> AsyncIterator[tuple[FrontendStack, Any]]:
    """The frontend over one sidecar: ``vllm``, ``sglang-grpc`` or ``sglang-http``."""
    if worker == "vllm":
        stack_cm: Any = vllm_stack(**engine_config)
    else:
        stack_cm = sglang_stack(worker.removeprefix("sglang-"), **engine_config)  # type: ignore[arg-type]
    async with (
        stack_cm as sidecar,
        frontend_over([f"127.0.0.1:{sidecar.server.port}"], [sidecar], formats=(fmt,)) as fe,
    ):
        yield fe, sidecar


def engine_streamed(sidecar: Any, rid: str) -> list[bool]:
    """Whether the engine was asked to stream, for each request of ``rid`` it received."""
    asked: list[bool] = []
    for private_id, message in sidecar.engine.book.received:
        if not private_id.endswith("-" + rid):
            continue
        if isinstance(message, dict):  # SGLang's HTTP body
            asked.append(bool(message.get("stream", False)))
        else:  # vLLM's GenerateRequest, SGLang's gRPC GenerateRequest (stream optional there)
            asked.append(bool(message.stream))
    return asked


class Delivered:
    """Every output the frontend handed its encoder, by sub-request id."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[sidecar_pb2.LLMEngineOutput]] = {}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        deliver = Exchange.deliver
        outputs = self.outputs

        async def counted(exchange: Exchange, index: int, output: sidecar_pb2.LLMEngineOutput) -> None:
            outputs.setdefault(exchange.call.requests[index].request_id, []).append(output)
            await deliver(exchange, index, output)

        monkeypatch.setattr(Exchange, "deliver", counted)


async def post(fe: FrontendStack, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with fe.http.post(fe.url + path, json=body) as response:
        return response.status, await response.read()


def as_streamed_before(monkeypatch: pytest.MonkeyPatch, worker: str) -> None:
    """The sidecar streams whatever the caller asks, as one older than the field does."""
    if worker == "vllm":
        monkeypatch.setattr("sidecar_vllm.convert.asks_one_answer", lambda request, mode: False)
    else:
        monkeypatch.setattr("sidecar_sglang.convert_request.asks_one_answer", lambda request, mode: False)


def without_clocks(body: bytes) -> str:
    """An SGLang reply with its two timings (which differ between any two runs) blanked, keys
    in their order."""

    def blank(item: Any) -> Any:
        meta = item["meta_info"]
        for key in ("e2e_latency", "response_sent_to_client_ts"):
            assert key in meta
            meta[key] = None
        return item

    answer = json.loads(body)
    return json.dumps([blank(a) for a in answer] if isinstance(answer, list) else blank(answer))


CASES = [
    # (worker, format, engine config, path, body, sub-request ids, choices per sub-request)
    pytest.param(
        "vllm",
        VLLM,
        {"chunk_tokens": 1},
        "/inference/v1/generate",
        {
            "token_ids": PROMPT,
            "request_id": "one",
            "sampling_params": {
                "max_tokens": 20,
                "n": 2,
                "seed": 11,
                "logprobs": 2,
                "prompt_logprobs": 1,
                "stop_token_ids": [140],
            },
        },
        ["generate-tokens-one"],
        2,
        id="vllm-format-on-vllm",
    ),
    pytest.param(
        "vllm",
        SGLANG,
        {"chunk_tokens": 2},
        "/generate",
        {
            "input_ids": PROMPT,
            "rid": "one",
            "sampling_params": {"max_new_tokens": 20, "sampling_seed": 5},
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
        ["one"],
        1,
        id="sglang-format-on-vllm",
    ),
    *(
        pytest.param(
            worker,
            SGLANG,
            {"chunk_tokens": 1, "incremental": incremental},
            "/generate",
            {
                "input_ids": [PROMPT, [505, 606, 707]],
                "rid": ["one", "two"],
                "sampling_params": {"max_new_tokens": 20, "sampling_seed": 5, "stop_token_ids": [140]},
                "return_logprob": True,
                "logprob_start_len": 0,
                "top_logprobs_num": 2,
            },
            ["one", "two"],
            1,
            id=f"{worker}{'-incremental' if incremental else ''}",
        )
        for worker in ("sglang-grpc", "sglang-http")
        for incremental in (False, True)
    ),
]


@pytest.mark.parametrize(("worker", "fmt", "engine_config", "path", "body", "rids", "choices"), CASES)
async def test_a_non_streaming_request_is_one_engine_answer_and_the_same_reply(
    monkeypatch: pytest.MonkeyPatch,
    worker: str,
    fmt: Format,
    engine_config: dict[str, Any],
    path: str,
    body: dict[str, Any],
    rids: list[str],
    choices: int,
) -> None:
    monkeypatch.setattr("sidecar_frontend.handler.time", types.SimpleNamespace(time=lambda: WALL))
    delivered = Delivered()
    delivered.install(monkeypatch)
    async with over(worker, fmt, **engine_config) as (fe, sidecar):
        # Once first, so that both runs below find the prompt in the engine's prefix cache.
        status, _ = await post(fe, path, {**body, "stream": True})
        assert status == 200
        delivered.outputs.clear()
        status, answer = await post(fe, path, {**body, "stream": False})
        assert status == 200
        for rid in rids:
            assert engine_streamed(sidecar, rid) == [True, False], "the engine was asked for one answer"
            outputs = delivered.outputs[rid]
            assert sorted(out.index for out in outputs) == list(range(choices)), "one output per choice"
            assert all(out.finish_reason != sidecar_pb2.UNSPECIFIED for out in outputs)
            assert sum(len(out.token_ids) for out in outputs) > choices  # a real answer, not a stub

        delivered.outputs.clear()
        as_streamed_before(monkeypatch, worker)
        status, joined = await post(fe, path, {**body, "stream": False})
        assert status == 200
        for rid in rids:
            assert engine_streamed(sidecar, rid) == [True, False, True], "the engine streamed this time"

    if fmt is VLLM:
        assert answer == joined
    else:
        assert without_clocks(answer) == without_clocks(joined)


async def test_the_reply_to_a_streamed_request_is_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    # A streamed request leaves the field unset: the engine streams as before.
    delivered = Delivered()
    delivered.install(monkeypatch)
    async with over("vllm", VLLM, chunk_tokens=1) as (fe, sidecar):
        body = {"token_ids": PROMPT, "request_id": "s", "sampling_params": {"max_tokens": 8}, "stream": True}
        status, _ = await post(fe, "/inference/v1/generate", body)
        assert status == 200
        assert engine_streamed(sidecar, "generate-tokens-s") == [True]
        outputs = delivered.outputs["generate-tokens-s"]
        assert not any(out.finish_reason for out in outputs[:-1])
        assert outputs[-1].finish_reason != sidecar_pb2.UNSPECIFIED
