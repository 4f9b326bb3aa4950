"""An abort by id of a non-streaming request answers with the tokens made so far, as the real
servers do (SGLang's ``/abort_request`` and vLLM's ``abort_requests`` end an aborted request's
one answer with its output so far and an abort finish): a trainer that aborts its rollouts
resubmits from those tokens. The frontend has the sidecar abort the engine request rather than
cancelling the call, and the engine's answer comes through (vLLM's gRPC and SGLang's HTTP
wires; SGLang's gRPC wire ends an aborted stream without an answer). The tokens are exactly the prefix
of what the same request makes unaborted (the testkit's tokens depend on the prompt only)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.e2e_helpers import until
from tests.integration.frontend.test_formats_e2e import over

pytestmark = pytest.mark.timeout(90)

PROMPT = [11, 22, 33, 44]
BUDGET = 400
MADE_BEFORE_ABORT = 8


def _sglang(rid: str) -> tuple[str, dict[str, Any]]:
    return "/generate", {"rid": rid, "input_ids": PROMPT, "sampling_params": {"max_new_tokens": BUDGET}}


def _vllm(rid: str) -> tuple[str, dict[str, Any]]:
    body = {"request_id": rid, "token_ids": PROMPT, "sampling_params": {"max_tokens": BUDGET}}
    return "/inference/v1/generate", body


def _tokens_and_finish(fmt: str, answer: dict[str, Any]) -> tuple[list[int], str]:
    if fmt == "sglang":
        return answer["output_ids"], answer["meta_info"]["finish_reason"]["type"]
    (choice,) = answer["choices"]
    return choice["token_ids"], choice["finish_reason"]


async def _abort(fe: Any, fmt: str, rid: str) -> None:
    body: dict[str, Any]
    if fmt == "sglang":
        path, body = "/abort_request", {"rid": rid}
    else:
        path, body = "/inference/v1/abort_requests", {"request_ids": [rid]}
    async with fe.http.post(fe.url + path, json=body) as response:
        assert response.status == 200


# Not SGLang's gRPC wire: its Abort closes the request's stream with no answer (the Rust
# server's framing), so the tokens so far are not on that wire (docs/frontend.md).
@pytest.mark.parametrize("worker", ["vllm", "sglang-http"])
@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
async def test_an_aborted_non_streaming_request_answers_with_its_tokens_so_far(fmt: str, worker: str) -> None:
    build = _sglang if fmt == "sglang" else _vllm
    async with over(worker, token_latency_ms=20.0) as fe:
        book = fe.sidecars[0].engine.book
        path, body = build("job")
        pending = asyncio.ensure_future(fe.http.post(fe.url + path, json=body))

        def made() -> int:
            running = [r for r in book.running_ids() if r.endswith("-job")]
            held = book.held_tokens(running[0]) if running else None
            return 0 if held is None else held - len(PROMPT)

        await until(lambda: made() >= MADE_BEFORE_ABORT, "the engine made some tokens", secs=30.0)
        await _abort(fe, fmt, "job")
        async with await pending as response:
            assert response.status == 200
            aborted = json.loads(await response.read())
        tokens, finish = _tokens_and_finish(fmt, aborted)
        assert finish == "abort"
        assert len(tokens) >= MADE_BEFORE_ABORT
        assert len(tokens) < BUDGET

        # The same request, unaborted, starts with exactly those tokens.
        path, body = build("whole")
        body["sampling_params"] = {**body["sampling_params"], **{_budget_key(fmt): len(tokens)}}
        async with fe.http.post(fe.url + path, json=body) as response:
            whole, _ = _tokens_and_finish(fmt, json.loads(await response.read()))
        assert whole == tokens
        await until(lambda: fe.sidecars[0].server.inflight == 0, "the sidecar is idle")
        assert [p for p in book.aborts if p.endswith("-job")], "the engine request was aborted"


def _budget_key(fmt: str) -> str:
    return "max_new_tokens" if fmt == "sglang" else "max_tokens"
