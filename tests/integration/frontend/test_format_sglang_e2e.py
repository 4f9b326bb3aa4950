"""SGLang's /generate through the frontend over each kind of worker, for what a client of the
real SGLang server relies on: a request with no new tokens (scoring a prompt), engine aborts
that keep their status, input logprobs from the first event that has them, logit_bias.

What the real server answers was read from SGLang 0.5.23's code (scheduler, tokenizer manager,
HTTP server); each test says which part."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from testkit.faults import FaultKind, FaultPlan
from testkit.generator import SamplingSpec, generate, prompt_logprobs
from testkit.sglang_core import CHOSEN_WIDTH, chosen_row

from sidecar_frontend.formats.base import Format
from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.sglang import SglangFormat
from sidecar_frontend.handler import HandlerConfig
from tests.integration.frontend.fixtures import FrontendStack, frontend_over, sse_events
from tests.sglang_fixtures import sglang_stack
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(60)

PROMPT = [101, 202, 303, 404]
SGLANG_WORKERS = ["sglang-grpc", "sglang-http"]


@asynccontextmanager
async def over(
    worker: str, config: HandlerConfig | None = None, fmt: Format = SGLANG, **engine_config: Any
) -> AsyncIterator[tuple[FrontendStack, Any]]:
    """The frontend (SGLang's format) over one sidecar: ``vllm``, ``sglang-grpc`` or ``sglang-http``."""
    if worker == "vllm":
        stack_cm: Any = vllm_stack(**engine_config)
    else:
        stack_cm = sglang_stack(worker.removeprefix("sglang-"), **engine_config)  # type: ignore[arg-type]
    async with (
        stack_cm as sidecar,
        frontend_over([f"127.0.0.1:{sidecar.server.port}"], [sidecar], formats=(fmt,), config=config) as fe,
    ):
        yield fe, sidecar


async def post(fe: FrontendStack, body: dict[str, Any]) -> tuple[int, Any]:
    async with fe.http.post(fe.url + "/generate", json=body) as response:
        if body.get("stream"):
            return response.status, await sse_events(response)
        return response.status, await response.json()


def scored_prompt(sidecar: Any, top: int) -> tuple[list[Any], list[Any]]:
    """The input logprobs SGLang writes for PROMPT from position 0: the first has no logprob."""
    rows = prompt_logprobs(PROMPT, top, sidecar.engine.model)
    tokens = [
        [None if row is None else row.logprob, tok, None] for row, tok in zip(rows, PROMPT, strict=True)
    ]
    tokens[0][0] = None
    tops = [None if row is None else [[v, t, None] for t, v in row.top[:top]] for row in rows]
    return tokens, tops


def without_clocks(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k not in ("e2e_latency", "response_sent_to_client_ts")}


# ------------------------------------------------------------------ max_new_tokens: 0


@pytest.mark.parametrize("worker", SGLANG_WORKERS)
@pytest.mark.parametrize("stream", [False, True])
async def test_max_new_tokens_0_scores_the_prompt(worker: str, stream: bool) -> None:
    # SGLang's scheduler runs a prefill-only request: the one sampled token is cut by
    # FINISH_LENGTH(length=0), so output_ids is [] and no output logprob is sent; the input
    # logprobs are there (logprob_start_len 0, the first without a logprob).
    async with over(worker) as (fe, sidecar):
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "stream": stream,
        }
        status, answer = await post(fe, body)
        assert status == 200
        if stream:
            assert answer[-1] == "[DONE]"
            [event] = answer[:-1]
            answer = json.loads(event)
        tokens, tops = scored_prompt(sidecar, 2)
        assert answer["output_ids"] == []
        assert without_clocks(answer["meta_info"]) == {
            "id": answer["meta_info"]["id"],
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": len(PROMPT),
            "weight_version": "default",
            "num_retractions": 0,
            "input_token_logprobs": tokens,
            "output_token_logprobs": [],
            "output_token_logprobs_length": 0,
            "input_top_logprobs": [None, *tops[1:]],
            "output_top_logprobs": [],
            "reasoning_tokens": 0,
            "completion_tokens": 0,
            "cached_tokens": 0,
            # SGLang's finished output: one empty span of the version in force.
            "weight_versions": [{"version": "default", "start": 0, "end": 0}],
            "cached_tokens_details": None,
            "dp_rank": None,
        }
        assert len(sidecar.engine.book.received) == 1


async def test_max_new_tokens_0_on_a_vllm_worker_is_refused_in_vllms_words() -> None:
    async with over("vllm") as (fe, sidecar):
        status, answer = await post(fe, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}})
        assert status == 400
        assert answer == {
            "error": {"message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"}
        }
        assert sidecar.engine.book.received == []


# ------------------------------------------------------------------ input logprobs in streams


@pytest.mark.parametrize("worker", SGLANG_WORKERS)
@pytest.mark.parametrize("incremental", [False, True])
async def test_a_stream_has_the_input_logprobs_from_its_first_event(worker: str, incremental: bool) -> None:
    # SGLang's tokenizer manager adds the prompt's logprobs to every event once prefill is done,
    # the first event included (incremental streaming cuts only the output lists).
    fmt = SglangFormat(incremental_streaming_output=incremental)
    async with over(worker, fmt=fmt, incremental=incremental, token_latency_ms=20) as (fe, sidecar):
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 4},
            "return_logprob": True,
            "logprob_start_len": 0,
            "stream": True,
        }
        status, events = await post(fe, body)
        assert status == 200
        metas = [json.loads(e)["meta_info"] for e in events[:-1]]
        # Tokens 20 ms apart keep the outputs apart (queued ones may travel as one); the first
        # event is what matters.
        assert len(metas) >= 2
        tokens, _ = scored_prompt(sidecar, 0)
        assert [m["input_token_logprobs"] for m in metas] == [tokens] * len(metas)


# ------------------------------------------------------------ engine aborts keep their status


@pytest.mark.parametrize("worker", SGLANG_WORKERS)
@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_abort_with_503_stays_503(worker: str, stream: bool) -> None:
    # SGLang's scheduler aborts with 503 when its queue is full (--max-queued-requests). Unary:
    # the tokenizer manager raises HTTPException(503) -> ErrorResponse; stream: the final chunk
    # carries the abort finish reason with its status.
    # One worker, still serving: SGLang's answer reaches the client at once, whatever the
    # frontend's worker_wait (one no test outlives: waiting for another worker fails the test).
    config = HandlerConfig(worker_wait=3600.0)
    async with over(worker, config, max_running_requests=1, max_queued_requests=0) as (fe, sidecar):
        sidecar.engine.faults.add("busy", FaultPlan(FaultKind.HANG, after=1))
        async with fe.http.post(
            fe.url + "/generate",
            json={
                "input_ids": PROMPT,
                "rid": "busy",
                "sampling_params": {"max_new_tokens": 9},
                "stream": True,
            },
        ) as held:
            await held.content.readline()
            status, answer = await post(fe, {"input_ids": PROMPT, "stream": stream})
            if not stream:
                assert status == 503
                assert answer == {
                    "object": "error",
                    "message": "The request queue is full.",
                    "type": "503",
                    "param": None,
                    "code": 503,
                }
            else:
                assert status == 200
                assert answer[-1] == "[DONE]"
                [event] = answer[:-1]
                finish = json.loads(event)["meta_info"]["finish_reason"]
                assert finish == {
                    "type": "abort",
                    "message": "The request queue is full.",
                    "status_code": 503,
                    "err_type": None,
                }


# ------------------------------------------------- the same refusal over both SGLang transports

LORA_OFF = (
    "LoRA adapter 'sql' was requested, but LoRA is not enabled. Please launch the server with "
    "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
)


@pytest.mark.parametrize("worker", SGLANG_WORKERS)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_lora_adapter_while_lora_is_off_is_the_same_400_over_both_transports(
    worker: str, stream: bool
) -> None:
    # SGLang's HTTP server: the tokenizer manager's ValueError -> 400 {"error": {"message"}};
    # streamed, HTTP 200 with one error event, then [DONE].
    async with over(worker) as (fe, sidecar):
        body = {"input_ids": PROMPT, "lora_path": "sql", "stream": stream}
        status, answer = await post(fe, body)
        if not stream:
            assert (status, answer) == (400, {"error": {"message": LORA_OFF}})
        else:
            assert status == 200
            assert [json.loads(e) for e in answer[:-1]] == [
                {
                    "error": {
                        "message": LORA_OFF,
                        "type": "invalid_request_error",
                        "code": 400,
                        "retryable": False,
                    }
                }
            ]
            assert answer[-1] == "[DONE]"
        assert sidecar.engine.book.received == []


@pytest.mark.parametrize("stream", [False, True])
async def test_an_adapter_sglang_never_loaded_is_its_400_over_http(stream: bool) -> None:
    # SGLang's tokenizer manager (_resolve_lora_path) raises a ValueError for a name not in its
    # lora_ref_cache; the HTTP server answers it as any refusal. (Over SGLang's gRPC wire the
    # same refusal is INTERNAL: docs/frontend-sglang.md, "Where we differ".)
    async with over("sglang-http", lora_paths=("sql",)) as (fe, _):
        words = "Got LoRA adapter that has never been loaded: chat\nAll loaded adapters: dict_keys(['sql'])."
        status, answer = await post(fe, {"input_ids": PROMPT, "lora_path": "chat", "stream": stream})
        if not stream:
            assert (status, answer) == (400, {"error": {"message": words}})
        else:
            assert status == 200
            assert [json.loads(e) for e in answer[:-1]] == [
                {
                    "error": {
                        "message": words,
                        "type": "invalid_request_error",
                        "code": 400,
                        "retryable": False,
                    }
                }
            ]
            assert answer[-1] == "[DONE]"
        status, answer = await post(fe, {"input_ids": PROMPT, "lora_path": "sql"})
        assert status == 200, answer


# ------------------------------------------------------------------ token_ids_logprob


def chosen(row: Any, ids: tuple[int, ...]) -> Any:
    return None if row is None else chosen_row(row, ids)


@pytest.mark.parametrize("max_new", [3, 0])
async def test_token_ids_logprob_over_an_sglang_http_worker(max_new: int) -> None:
    # SGLang's tokenizer manager adds input_token_ids_logprobs (from logprob_start_len, the
    # first null) and output_token_ids_logprobs (one row per output token; a prompt-only
    # request has one for the position after the prompt).
    async with over("sglang-http") as (fe, sidecar):
        ids = (7, 5, 7)
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": max_new},
            "return_logprob": True,
            "logprob_start_len": 1,
            "token_ids_logprob": list(ids),
        }
        status, answer = await post(fe, body)
        assert status == 200
        model = sidecar.engine.model
        wide = SamplingSpec(max_tokens=max(max_new, 1), logprobs=CHOSEN_WIDTH)
        generated = generate(model, PROMPT, wide, 0)
        meta = answer["meta_info"]
        assert answer["output_ids"] == [t.token_id for t in generated][:max_new]
        rows = [chosen(t.logprobs, ids) for t in generated]
        assert meta["output_token_ids_logprobs"] == rows[: max(max_new, 1)]
        prompt_rows = prompt_logprobs(PROMPT, CHOSEN_WIDTH, model)
        assert meta["input_token_ids_logprobs"] == [None, *(chosen(r, ids) for r in prompt_rows[2:])]
        assert (
            list(meta).index("output_token_ids_logprobs")
            == list(meta).index("output_token_logprobs_length") + 2
        )


@pytest.mark.parametrize("worker", ["sglang-grpc", "vllm"])
async def test_token_ids_logprob_over_a_worker_whose_wire_cannot_carry_it_is_refused_by_name(
    worker: str,
) -> None:
    async with over(worker) as (fe, sidecar):
        body = {"input_ids": PROMPT, "return_logprob": True, "token_ids_logprob": [7]}
        status, answer = await post(fe, body)
        assert status == 400
        assert answer["error"]["message"].startswith("output_options.token_ids_logprob: "), answer
        assert sidecar.engine.book.received == []


# ------------------------------------------------------------------ wrong method


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        # SGLang 0.5.23's http_server: /generate is an api_route of POST and PUT (Starlette joins
        # a set, in no fixed order: ours sorts), /abort_request a post, the rest gets (FastAPI
        # routes do not answer HEAD for them).
        ("GET", "/generate", "POST, PUT"),
        ("GET", "/abort_request", "POST"),
        ("POST", "/health", "GET"),
        ("HEAD", "/model_info", "GET"),
        ("DELETE", "/v1/models", "GET"),
    ],
)
async def test_a_wrong_method_is_fastapis_405_with_allow(method: str, path: str, allow: str) -> None:
    async with over("sglang-http") as (fe, _), fe.http.request(method, fe.url + path) as response:
        assert response.status == 405
        assert response.headers["Allow"] == allow
        if method != "HEAD":
            assert response.headers["Content-Type"] == "application/json"
            assert await response.read() == b'{"detail":"Method Not Allowed"}'


async def test_a_trailing_slash_is_starlettes_307_to_the_routed_path() -> None:
    async with (
        over("sglang-http") as (fe, _),
        fe.http.post(fe.url + "/generate/?x=1", json={}, allow_redirects=False) as response,
    ):
        assert response.status == 307
        assert response.headers["Location"] == fe.url + "/generate?x=1"
        assert await response.read() == b""
