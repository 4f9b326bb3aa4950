"""Disaggregated prefill -> decode through the frontend, over real sidecars in prefill and
decode mode on testkit engines. The topology law: aggregated and disaggregated serving give
the same tokens, finish reason and usage for the same request, both formats. And: the vLLM
handoff goes from the prefill's terminal into the decode request; SGLang's bootstrap triple
is shared by both steps (chosen up front once the prefill worker's bootstrap address is
known); cancels and failures abort what was started, exactly once."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import anyio
import pytest
import structlog.testing
from aiohttp import web
from testkit.book import Outcome
from testkit.faults import FaultKind, FaultPlan

from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.handler import Frontend, HandlerConfig
from sidecar_frontend.metrics import Metrics
from sidecar_frontend.server import WorkerMetrics
from sidecar_frontend.workers import WorkerSet, WorkerState
from tests.e2e_helpers import until
from tests.integration.frontend.fixtures import FAST_WORKERS, FrontendStack
from tests.sglang_fixtures import sglang_stack
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(90)

ENGINES = ["vllm", "sglang-grpc", "sglang-http"]
PROMPT = [101, 202, 303, 404, 505]


def sidecar(engine: str, mode: str, **config: Any) -> Any:
    if engine == "vllm":
        kv_role = {"agg": "", "prefill": "kv_producer", "decode": "kv_consumer"}[mode]
        return vllm_stack(mode=mode, kv_role=kv_role, **config)  # type: ignore[arg-type]
    return sglang_stack(engine.removeprefix("sglang-"), mode=mode, **config)  # type: ignore[arg-type]


@asynccontextmanager
async def fleet(engine: str, roles: list[str], **config: Any) -> AsyncIterator[FrontendStack]:
    """One sidecar per role (agg, prefill or decode) behind one frontend serving both formats."""
    async with AsyncExitStack() as stack:
        sidecars = [await stack.enter_async_context(sidecar(engine, role, **config)) for role in roles]
        metrics = Metrics()
        workers = await stack.enter_async_context(WorkerSet(FAST_WORKERS, rand=random.Random(3)))
        for role, s in zip(roles, sidecars, strict=True):
            workers.add_worker(f"127.0.0.1:{s.server.port}", role)
        with anyio.fail_after(20):
            for role in set(roles):
                await workers.wait_serving(roles.count(role), role)
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


def body_of(fmt: str, rid: str, stream: bool) -> tuple[str, dict[str, Any]]:
    if fmt == "sglang":
        return "/generate", {
            "input_ids": PROMPT,
            "rid": rid,
            "stream": stream,
            "sampling_params": {"max_new_tokens": 7},
        }
    body: dict[str, Any] = {"token_ids": PROMPT, "request_id": rid, "stream": stream}
    body["sampling_params"] = {"max_tokens": 7}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return "/inference/v1/generate", body


async def outcome(fe: FrontendStack, fmt: str, rid: str, stream: bool) -> dict[str, Any]:
    """Tokens, finish reason and usage as the client saw them."""
    path, body = body_of(fmt, rid, stream)
    async with fe.http.post(fe.url + path, json=body) as response:
        assert response.status == 200, await response.text()
        if not stream:
            reply = await response.json()
            events = [reply]
        else:
            events = []
            async for line in response.content:
                text = line.decode().rstrip("\r\n")
                if text.startswith("data: ") and text != "data: [DONE]":
                    events.append(json.loads(text[len("data: ") :]))
    if fmt == "sglang":
        meta = events[-1]["meta_info"]
        return {
            "tokens": events[-1]["output_ids"],
            "finish": meta["finish_reason"],
            "usage": (meta["prompt_tokens"], meta["completion_tokens"]),
        }
    choices = [c for e in events for c in e.get("choices", ())]
    usage = events[-1]["usage"]
    return {
        "tokens": [t for c in choices for t in c["token_ids"]],
        "finish": [c["finish_reason"] for c in choices if c.get("finish_reason")],
        "usage": (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]),
    }


@pytest.mark.parametrize("engine", ENGINES)
async def test_aggregated_and_disaggregated_serving_give_the_same_output(engine: str) -> None:
    async with fleet(engine, ["agg"]) as agg:
        expected = {
            (fmt, stream): await outcome(agg, fmt, f"a-{fmt}-{stream}", stream)
            for fmt in ("sglang", "vllm")
            for stream in (False, True)
        }
    async with fleet(engine, ["prefill", "decode"]) as fe:
        for (fmt, stream), want in expected.items():
            assert await outcome(fe, fmt, f"d-{fmt}-{stream}", stream) == want, (fmt, stream)
        prefill, decode = fe.sidecars
        # Every request ran once on each side, and each side completed it.
        assert len(prefill.engine.book.received) == len(decode.engine.book.received) == len(expected)
        await until(lambda: decode.server.inflight == 0 and prefill.server.inflight == 0, "idle")
        for side in (prefill, decode):
            assert {r.outcome for r in side.engine.book.finished} == {Outcome.FINISHED}
            assert side.engine.book.aborts == []


async def test_vllm_the_decode_request_carries_the_prefills_handoff() -> None:
    async with fleet("vllm", ["prefill", "decode"]) as fe:
        await outcome(fe, "vllm", "h1", stream=False)
        _prefill, decode = fe.sidecars
        [(rid, kv)] = decode.engine.handoffs
        assert rid.endswith("-h1")
        assert kv["do_remote_prefill"] is True
        assert {"remote_host", "remote_port", "remote_engine_id", "remote_block_ids"} <= set(kv)


@pytest.mark.parametrize("engine", ["sglang-grpc", "sglang-http"])
async def test_sglang_both_steps_share_one_bootstrap_triple_chosen_up_front_once_known(engine: str) -> None:
    async with fleet(engine, ["prefill", "decode"], bootstrap_port=8123) as fe:
        prefill, decode = fe.sidecars
        for n in range(3):
            await outcome(fe, "sglang", f"b{n}", stream=False)
        for n in range(3):
            [p_rid] = [r for r in prefill.engine.bootstraps if r.endswith(f"-b{n}")]
            [d_rid] = [r for r in decode.engine.bootstraps if r.endswith(f"-b{n}")]
            assert prefill.engine.bootstraps[p_rid] == decode.engine.bootstraps[d_rid]
            assert decode.engine.bootstraps[d_rid][1] == 8123
        rooms = {b[2] for b in decode.engine.bootstraps.values()}
        assert len(rooms) == 3
        # Learned from the first handoff; from then on the frontend draws the room itself.
        address = f"127.0.0.1:{prefill.server.port}"
        assert fe.frontend.bootstraps[address].port == 8123


async def test_sglang_once_the_bootstrap_is_known_decode_starts_while_prefill_runs() -> None:
    async with fleet("sglang-grpc", ["prefill", "decode"], token_latency_ms=50.0) as fe:
        prefill, decode = fe.sidecars
        await outcome(fe, "sglang", "learn", stream=False)  # the bootstrap address is learned
        prefill.engine.faults.add("slow", FaultPlan(FaultKind.STALL_FIRST_TOKEN, stall_secs=30))
        task = asyncio.ensure_future(outcome(fe, "sglang", "slow", stream=False))
        # The decode request arrives while the prefill is still stalled.
        await until(
            lambda: any(r.endswith("-slow") for r, _ in decode.engine.book.received), "decode started"
        )
        assert any(r.endswith("-slow") for r in prefill.engine.book.running_ids())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: decode.server.inflight == 0 and prefill.server.inflight == 0, "both ended")
        # The client left: each step was aborted, once, and ended once.
        for side in (prefill, decode):
            assert len([r for r in side.engine.book.aborts if r.endswith("-slow")]) == 1
            assert len([r for r in side.engine.book.finished if r.request_id.endswith("-slow")]) == 1


async def test_a_prefill_failure_ends_the_request_with_the_formats_error_and_no_decode() -> None:
    async with fleet("vllm", ["prefill", "decode"]) as fe:
        prefill, decode = fe.sidecars
        prefill.engine.faults.add("bad", FaultPlan(FaultKind.ERROR_AFTER, after=0, code="INVALID_ARGUMENT"))
        path, body = body_of("vllm", "bad", stream=False)
        async with fe.http.post(fe.url + path, json=body) as response:
            assert response.status == 400
        assert decode.engine.book.received == []


async def test_a_client_gone_during_prefill_aborts_the_prefill_once_and_never_decodes() -> None:
    async with fleet("vllm", ["prefill", "decode"]) as fe:
        prefill, decode = fe.sidecars
        prefill.engine.faults.add("gone", FaultPlan(FaultKind.STALL_FIRST_TOKEN, stall_secs=30))
        task = asyncio.ensure_future(outcome(fe, "vllm", "gone", stream=True))
        await until(
            lambda: any(r.endswith("-gone") for r in prefill.engine.book.running_ids()), "prefill runs"
        )
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: prefill.server.inflight == 0 and fe.frontend.inflight == 0, "ended")
        assert len([r for r in prefill.engine.book.aborts if r.endswith("-gone")]) == 1
        assert decode.engine.book.received == []


async def test_an_abort_by_id_during_decode_aborts_the_decode_once() -> None:
    async with fleet("vllm", ["prefill", "decode"], token_latency_ms=20.0) as fe:
        prefill, decode = fe.sidecars
        path, body = body_of("vllm", "stop-me", stream=True)
        body["sampling_params"] = {"max_tokens": 500}
        async with fe.http.post(fe.url + path, json=body) as response:
            assert (await response.content.readline()).startswith(b"data: ")
            status, _ = await _post(fe, "/inference/v1/abort_requests", {"request_ids": ["stop-me"]})
            assert status == 200
            rest = [line async for line in response.content]
        assert any(b'"finish_reason":"abort"' in line.replace(b" ", b"") for line in rest)
        await until(lambda: decode.server.inflight == 0, "decode ended")
        assert len([r for r in decode.engine.book.aborts if r.endswith("-stop-me")]) == 1
        assert [r.outcome for r in prefill.engine.book.finished] == [Outcome.FINISHED]


async def _post(fe: FrontendStack, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with fe.http.post(fe.url + path, json=body) as response:
        return response.status, await response.text()


async def test_a_prefill_the_engine_aborted_ends_the_request_as_cancelled_without_a_decode_step() -> None:
    from smg_grpc_proto.generated import vllm_engine_pb2

    async with fleet("vllm", ["prefill", "decode"]) as fe:
        prefill, decode = fe.sidecars
        prefill.engine.faults.add("pa", FaultPlan(FaultKind.STALL_FIRST_TOKEN, stall_secs=30))
        task = asyncio.ensure_future(outcome(fe, "vllm", "pa", stream=False))
        await until(lambda: any(r.endswith("-pa") for r in prefill.engine.book.running_ids()), "prefill runs")
        private = [r for r in prefill.engine.book.running_ids() if r.endswith("-pa")]
        await prefill.engine.Abort(vllm_engine_pb2.AbortRequest(request_ids=private), None)
        result = await task
        assert result["finish"] == ["abort"]
        assert result["tokens"] == []
        assert decode.engine.book.received == []


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_decode_sidecar_listed_as_aggregated_is_refused_and_clients_get_503_misconfigured(
    engine: str,
) -> None:
    """``--prefill-worker P --worker D`` with D a decode sidecar: D is refused for its role
    (one error line, a metric), and a client gets a 503 saying the fleet is misconfigured in its
    format's shape, never a 400 about kv_transfer_params; no engine sees a request."""
    async with AsyncExitStack() as stack:
        prefill = await stack.enter_async_context(sidecar(engine, "prefill"))
        decode = await stack.enter_async_context(sidecar(engine, "decode"))
        metrics = Metrics()
        workers = await stack.enter_async_context(WorkerSet(FAST_WORKERS))
        workers.events.subscribe(WorkerMetrics(metrics))
        decode_address = f"127.0.0.1:{decode.server.port}"
        workers.add_worker(f"127.0.0.1:{prefill.server.port}", "prefill")
        workers.add_worker(decode_address, "agg")  # the mistake
        with anyio.fail_after(20):
            await workers.wait_serving(1, "prefill")
        refused = workers.get(decode_address)
        assert refused is not None
        await until(lambda: refused.state is WorkerState.REFUSED, "the decode sidecar is refused")
        frontend = Frontend((SGLANG, VLLM), workers, HandlerConfig(), metrics=metrics)
        runner = web.AppRunner(frontend.build_app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        http = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)))
        why = f"the fleet is misconfigured: worker {decode_address} was given as an aggregated worker"
        for fmt in ("sglang", "vllm"):
            path, body = body_of(fmt, f"mis-{fmt}", stream=False)
            body.pop("kv_transfer_params", None)
            with structlog.testing.capture_logs() as logs:
                async with http.post(url + path, json=body) as response:
                    assert response.status == 503
                    text = await response.text()
            assert why in text
            assert "kv_transfer_params" not in text
            (line,) = [e for e in logs if e["event"] == "request"]
            assert line["reason"] == "MISCONFIGURED"
            assert why in line["error"]
            assert line["request_id"].endswith(f"mis-{fmt}")
            labels = {"format": fmt, "outcome": "unavailable", "reason": "MISCONFIGURED"}
            assert metrics.registry.get_sample_value("frontend_requests_total", labels) == 1
        async with http.get(url + "/health") as response:
            assert response.status == 503
        assert metrics.registry.get_sample_value("frontend_worker_refusals_total", {"reason": "role"}) == 1
        assert prefill.engine.book.received == decode.engine.book.received == []
