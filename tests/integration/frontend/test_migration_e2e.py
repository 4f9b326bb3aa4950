"""The continuation law over real sidecars: a generation whose worker dies at a random token
continues on another worker, and the client's output equals the output with no failure, token
for token, for both formats and all three engine kinds (testkit engines: the output is a
function of the prompt, autoregressively, so a continuation can reproduce it).

Two sidecars of one engine kind behind the frontend; the stream is read until k tokens
arrived, then the sidecar running it is stopped (its in-flight generations end with a
migratable ENGINE_SHUTDOWN)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.handler import HandlerConfig
from tests.e2e_helpers import until
from tests.integration.frontend.fixtures import FrontendStack, frontend_over, sse_events, two_workers
from tests.vllm_fixtures import vllm_stack

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow(16)]

ENGINES = ["vllm", "sglang-grpc", "sglang-http"]
PROMPT = [101, 202, 303, 404]
MAX_TOKENS = 24


def request_body(fmt: str, rid: str) -> tuple[str, dict[str, Any]]:
    if fmt == "sglang":
        return "/generate", {
            "input_ids": PROMPT,
            "rid": rid,
            "stream": True,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": MAX_TOKENS},
        }
    return "/inference/v1/generate", {
        "token_ids": PROMPT,
        "request_id": rid,
        "stream": True,
        "stream_options": {"include_usage": True},
        "sampling_params": {"max_tokens": MAX_TOKENS, "min_tokens": 3, "logprobs": 1},
    }


def summary(fmt: str, events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the client got, without the fields that differ between any two runs (ids, times)."""
    if fmt == "sglang":
        last = events[-1]  # cumulative: the last event holds everything
        meta = last["meta_info"]
        return {
            "tokens": last["output_ids"],
            "finish": meta["finish_reason"],
            "usage": (meta["prompt_tokens"], meta["completion_tokens"]),
            "logprobs": [(v, t) for v, t, *_ in meta["output_token_logprobs"]],
            "events_cumulative": all(
                e["output_ids"] == last["output_ids"][: len(e["output_ids"])] for e in events
            ),
        }
    choices = [c for e in events for c in e.get("choices", ())]
    return {
        "tokens": [t for c in choices for t in c["token_ids"]],
        "finish": [c["finish_reason"] for c in choices if c.get("finish_reason")],
        "usage": {k: v for k, v in events[-1]["usage"].items() if k != "prompt_tokens_details"},
        "logprobs": [lp for c in choices if c.get("logprobs") for lp in c["logprobs"]["content"]],
    }


async def stream(
    fe: FrontendStack, fmt: str, rid: str, kill_after: int | None = None
) -> tuple[list[dict[str, Any]], int | None]:
    """The stream's events; with ``kill_after``, the worker running it is stopped once that
    many tokens arrived (returns which sidecar was stopped)."""
    path, body = request_body(fmt, rid)
    events: list[dict[str, Any]] = []
    killed: int | None = None
    async with fe.http.post(fe.url + path, json=body) as response:
        assert response.status == 200
        async for line in response.content:
            text = line.decode().rstrip("\r\n")
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            events.append(json.loads(text[len("data: ") :]))
            if kill_after is not None and killed is None and delivered(fmt, events) >= kill_after:
                killed = running_on(fe, rid)
                await fe.sidecars[killed].server.stop()
    return events, killed


def delivered(fmt: str, events: list[dict[str, Any]]) -> int:
    if fmt == "sglang":
        return len(events[-1].get("output_ids", ()))
    return sum(len(c["token_ids"]) for e in events for c in e.get("choices", ()))


def running_on(fe: FrontendStack, rid: str) -> int:
    for index, sidecar in enumerate(fe.sidecars):
        if any(r.endswith("-" + rid) for r in sidecar.engine.book.running_ids()):
            return index
    raise AssertionError(f"{rid} runs on no engine")


def metric(fe: FrontendStack, name: str, **labels: str) -> float:
    value = fe.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
@pytest.mark.parametrize("engine", ENGINES)
async def test_a_worker_killed_at_a_random_token_changes_nothing_the_client_sees(
    engine: str, fmt: str
) -> None:
    kill_after = random.Random(f"{engine}/{fmt}").randrange(1, MAX_TOKENS - 2)
    async with two_workers(engine) as fe:
        reference, _ = await stream(fe, fmt, "calm")
        events, killed = await stream(fe, fmt, "storm", kill_after=kill_after)
        assert killed is not None
        assert summary(fmt, events) == summary(fmt, reference)
        assert len(summary(fmt, events)["tokens"]) == MAX_TOKENS
        assert metric(fe, "frontend_migrations_total", format=fmt, outcome="migrated") == 1
        survivor = fe.sidecars[1 - killed]
        # The continuation ran on the survivor with the delivered tokens appended to the prompt.
        await until(lambda: survivor.server.inflight == 0, "the survivor is idle")
        continued = [r for r, _ in survivor.engine.book.received if r.endswith("-storm")]
        assert len(continued) == 1


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
async def test_a_unary_request_whose_worker_dies_is_unchanged(fmt: str) -> None:
    # A non-streaming request is one answer from its worker: nothing is delivered before it,
    # so a worker that dies mid-generation has its request run again from the start elsewhere.
    async with two_workers("vllm") as fe:
        path, body = request_body(fmt, "u-calm")
        body = {**body, "stream": False}
        body.pop("stream_options", None)
        async with fe.http.post(fe.url + path, json=body) as response:
            reference = await response.json()
        victim_body = {**body, "rid" if fmt == "sglang" else "request_id": "u-storm"}

        async def post() -> Any:
            async with fe.http.post(fe.url + path, json=victim_body) as response:
                return await response.json()

        pending = asyncio.ensure_future(post())
        # Kill the worker once its engine generated tokens (none reached the frontend).
        await until(lambda: _generated(fe, "u-storm") >= 3, "three tokens were generated")
        assert _tokens_delivered(fe) == 0
        victim = next(i for i, s in enumerate(fe.sidecars) if _running(s, "u-storm"))
        await fe.sidecars[victim].server.stop()
        reply = await pending
        assert metric(fe, "frontend_retries_total", format=fmt) == 1
        assert metric(fe, "frontend_migrations_total", format=fmt, outcome="migrated") == 0
        if fmt == "sglang":
            assert reply["output_ids"] == reference["output_ids"]
            for key in ("finish_reason", "prompt_tokens", "completion_tokens", "output_token_logprobs"):
                assert reply["meta_info"][key] == reference["meta_info"][key], key
        else:
            assert reply["choices"] == reference["choices"]
            assert reply["usage"] == reference["usage"]


def _generated(fe: FrontendStack, rid: str) -> int:
    """Tokens the engines generated so far for the request ``rid`` (its KV beyond the prompt)."""
    for sidecar in fe.sidecars:
        book = sidecar.engine.book
        for running in book.running_ids():
            if running.endswith("-" + rid):
                held = book.held_tokens(running) or 0
                return max(0, held - len(PROMPT))
    return 0


def _running(sidecar: Any, rid: str) -> bool:
    return any(r.endswith("-" + rid) for r in sidecar.engine.book.running_ids())


def _tokens_delivered(fe: FrontendStack) -> int:
    """Tokens the frontend's one exchange in flight gave its encoder so far."""
    return sum(a.progress.completion_tokens() for x in fe.frontend._exchanges for a in x.attempts)


async def test_a_guided_request_is_not_migrated_and_ends_with_the_formats_error() -> None:
    async with two_workers("vllm") as fe:
        body = {
            "input_ids": PROMPT,
            "stream": True,
            "rid": "guided",
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "regex": "[a-z]+"},
        }
        events: list[dict[str, Any]] = []
        async with fe.http.post(fe.url + "/generate", json=body) as response:
            async for line in response.content:
                text = line.decode().rstrip("\r\n")
                if text.startswith("data: ") and text != "data: [DONE]":
                    events.append(json.loads(text[len("data: ") :]))
                    if len(events) == 2:
                        await fe.sidecars[running_on(fe, "guided")].server.stop()
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert metric(fe, "frontend_migrations_total", format="sglang", outcome="guided_decoding") == 1


async def test_the_migration_limit_bounds_the_moves_then_the_formats_error() -> None:
    async with two_workers("vllm", HandlerConfig(migration_limit=1)) as fe:
        from testkit.faults import FaultKind, FaultPlan

        for sidecar in fe.sidecars:
            sidecar.engine.faults.add("lim", FaultPlan(FaultKind.CLOSE_AFTER, after=2))
        _path, body = request_body("sglang", "lim")
        async with fe.http.post(fe.url + "/generate", json=body) as response:
            events = [json.loads(e) for e in (await sse_events(response))[:-1]]
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(events[-1]["output_ids"]) == 4, "two tokens from each of the two attempts"
        assert metric(fe, "frontend_migrations_total", format="sglang", outcome="migrated") == 1
        assert metric(fe, "frontend_migrations_total", format="sglang", outcome="limit") == 1


async def _engine_abort(fe: FrontendStack, index: int, rid: str) -> None:
    """The engine aborts the request by itself (no client, no frontend asked for it)."""
    from smg_grpc_proto.generated import vllm_engine_pb2

    engine = fe.sidecars[index].engine
    private = [r for r in engine.book.running_ids() if r.endswith("-" + rid)]
    await engine.Abort(vllm_engine_pb2.AbortRequest(request_ids=private), None)


@pytest.mark.parametrize("draining", [True, False])
async def test_an_engine_abort_on_a_draining_worker_migrates_and_on_a_serving_one_reaches_the_client(
    draining: bool,
) -> None:
    async with two_workers("vllm") as fe:
        reference, _ = await stream(fe, "vllm", "ref")
        path, body = request_body("vllm", "eab")
        events: list[dict[str, Any]] = []
        async with fe.http.post(fe.url + path, json=body) as response:
            async for line in response.content:
                text = line.decode().rstrip("\r\n")
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                events.append(json.loads(text[len("data: ") :]))
                if len(events) == 3:
                    victim = running_on(fe, "eab")
                    if draining:  # the frontend knows it is going away (etcd key gone, health)
                        fe.workers.drain_worker(fe.address(victim))
                    await _engine_abort(fe, victim, "eab")
        if draining:
            assert summary("vllm", events) == summary("vllm", reference)
            assert metric(fe, "frontend_migrations_total", format="vllm", outcome="migrated") == 1
        else:
            finishes = [
                c["finish_reason"] for e in events for c in e.get("choices", ()) if c.get("finish_reason")
            ]
            assert finishes == ["abort"]
            assert metric(fe, "frontend_migrations_total", format="vllm", outcome="migrated") == 0


async def test_a_migration_is_counted_only_when_another_worker_took_it() -> None:
    """One worker, which fails after two tokens (migratable): nobody can take the rest, so the
    failure is counted as no_worker, never as migrated, and the request log says no move."""
    from testkit.faults import FaultKind, FaultPlan

    async with (
        vllm_stack() as sidecar,
        frontend_over(
            [f"127.0.0.1:{sidecar.server.port}"],
            [sidecar],
            formats=(SGLANG, VLLM),
            config=HandlerConfig(worker_wait=0.2),
        ) as fe,
    ):
        sidecar.engine.faults.add("alone", FaultPlan(FaultKind.ERROR_AFTER, after=2, code="UNAVAILABLE"))
        _path, body = request_body("sglang", "alone")
        async with fe.http.post(fe.url + "/generate", json=body) as response:
            events = [json.loads(e) for e in (await sse_events(response))[:-1]]
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert metric(fe, "frontend_migrations_total", format="sglang", outcome="migrated") == 0
        assert metric(fe, "frontend_migrations_total", format="sglang", outcome="no_worker") == 1
        address = fe.address(0)
        assert metric(fe, "frontend_worker_failures_total", worker=address, reason="CANNOT_CONNECT") == 1
        assert metric(fe, "frontend_worker_request_duration_seconds_count", worker=address) == 1
        assert metric(fe, "frontend_worker_time_to_first_token_seconds_count", worker=address) == 1
