"""``POST /flush_cache`` and ``GET /get_loads`` through the frontend's admin routes, over a
vLLM and an SGLang-over-HTTP testkit worker registered through ``POST /workers``: a flush
empties both engines' prefix caches (200, SMG's body); an engine that refuses (a request
holds its blocks) is listed under ``failed`` in its own words (206), the other still flushed;
the loads name each worker by its registered URL."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar_common.api import sidecar_pb2
from tests.e2e_helpers import until
from tests.integration.frontend.test_membership_e2e import admin_frontend
from tests.sglang_fixtures import sglang_stack
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(90)

PROMPT = list(range(1000, 1064))


async def test_flush_cache_reaches_every_worker_and_names_a_refusal_in_the_engines_words() -> None:
    async with (
        vllm_stack(token_latency_ms=20.0) as vllm,
        sglang_stack("http", token_latency_ms=20.0) as sglang,
        admin_frontend() as fe,
    ):
        vllm_url = f"grpc://127.0.0.1:{vllm.server.port}"
        sglang_url = f"grpc://127.0.0.1:{sglang.server.port}"
        for url in (vllm_url, sglang_url):
            status, _, _ = await fe.call("POST", "/workers", body={"url": url})
            assert status == 202
        await fe.until(lambda: len(fe.workers.serving()) == 2)
        for stack in (vllm, sglang):  # a finished request leaves its prompt's blocks cached
            request = sidecar_pb2.PreprocessedRequest(request_id="fill", token_ids=PROMPT)
            request.stop_conditions.max_tokens = 2
            assert [o async for o in stack.stub.Generate(request)]
        engines = (vllm.engine, sglang.engine)
        assert all(_cached_blocks(engine) > 0 for engine in engines)

        status, body, _ = await fe.call("POST", "/flush_cache")
        assert status == 200
        assert body == {
            "status": "success",
            "message": "Successfully flushed cache on all 2 workers",
            "workers_flushed": 2,
            "total_workers": 2,
        }
        assert [_cached_blocks(engine) for engine in engines] == [0, 0]

        # A long request on the vLLM worker (sent to its sidecar) holds blocks: its engine
        # refuses the flush, the SGLang one flushes.
        request = sidecar_pb2.PreprocessedRequest(request_id="long", token_ids=PROMPT)
        request.stop_conditions.max_tokens = 500
        call = vllm.stub.Generate(request)
        try:
            await until(lambda: vllm.engine.book.running_count > 0, "the long request runs", secs=30.0)
            status, body, _ = await fe.call("POST", "/flush_cache")
        finally:
            call.cancel()
        assert status == 206
        assert body["status"] == "partial_success"
        assert body["workers_flushed"] == 1
        assert body["successful"] == [sglang_url]
        (failed,) = body["failed"]
        assert failed["worker"] == vllm_url
        assert "cannot reset the prefix cache: requests are running" in failed["error"]

        status, loads, _ = await fe.call("GET", "/get_loads")
        assert status == 200
        assert sorted(row["worker"] for row in loads["workers"]) == sorted([vllm_url, sglang_url])
        for row in loads["workers"]:
            assert set(row["details"]) == {
                "running_requests",
                "waiting_requests",
                "kv_usage",
                "engine_state",
                "weight_version",
            }


def _cached_blocks(engine: Any) -> int:
    return sum(len(cache) for cache in engine.kv_cache.caches)
