"""KV-aware routing over real sidecars in-process (testkit vLLM engines with their paged prefix
cache, a frontend with a router): requests sharing a prefix go where it is cached, and the
engine's cached-token count reaches the client and the hit-rate metrics."""

from __future__ import annotations

import random
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web

from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.handler import Frontend, HandlerConfig
from sidecar_frontend.metrics import Metrics
from sidecar_frontend.routing.router import RouterConfig, Routing
from sidecar_frontend.routing.wiring import RoutingParts
from sidecar_frontend.workers import WorkerSet
from tests.integration.frontend.fixtures import FAST_WORKERS, FrontendStack, frontend_stack
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(90)

PREFIX = [(7 * i) % 30000 + 1 for i in range(1024)]  # 64 blocks of 16


async def _generate(fe: FrontendStack, prompt: list[int]) -> dict[str, Any]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}
    async with fe.http.post(fe.url + "/generate", json=body) as response:
        assert response.status == 200, await response.text()
        reply: dict[str, Any] = await response.json()
    return reply


def _sample(fe: FrontendStack, name: str, labels: dict[str, str]) -> float:
    value = fe.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _workers_with(fe: FrontendStack, name: str) -> dict[str, float]:
    return {
        fe.address(i): _sample(fe, name, {"worker": fe.address(i)})
        for i in range(len(fe.sidecars))
        if _sample(fe, name, {"worker": fe.address(i)})
    }


async def test_approx_sends_a_shared_prefix_back_where_it_went_and_the_cache_hits() -> None:
    async with frontend_stack(3, formats=(SGLANG, VLLM), routing=RouterConfig(routing=Routing.APPROX)) as fe:
        first = await _generate(fe, [*PREFIX, 11, 12, 13])
        assert first["meta_info"]["cached_tokens"] == 0
        second = await _generate(fe, [*PREFIX, 21, 22, 23])
        # The whole shared prefix was cached on the worker the first request went to.
        assert second["meta_info"]["cached_tokens"] == len(PREFIX)
        prompts = _workers_with(fe, "frontend_kv_prompt_tokens_total")
        assert len(prompts) == 1, prompts
        (worker,) = prompts
        assert _sample(fe, "frontend_kv_reported_cached_tokens_total", {"worker": worker}) == len(PREFIX)
        assert _sample(fe, "frontend_kv_predicted_cached_tokens_total", {"worker": worker}) == len(PREFIX)
        decisions = fe.metrics.registry.get_sample_value
        assert decisions("frontend_routing_decisions_total", {"role": "agg", "reason": "load"}) == 1
        assert decisions("frontend_routing_decisions_total", {"role": "agg", "reason": "affinity"}) == 1


async def test_load_routing_keeps_counting_the_hit_rate() -> None:
    async with frontend_stack(2, formats=(SGLANG, VLLM), routing=RouterConfig(routing=Routing.LOAD)) as fe:
        await _generate(fe, [*PREFIX, 1])
        await _generate(fe, [*PREFIX, 2])
        total = sum(_workers_with(fe, "frontend_kv_prompt_tokens_total").values())
        assert total == 2 * (len(PREFIX) + 1)
        assert sum(_workers_with(fe, "frontend_kv_predicted_cached_tokens_total").values()) == 0


async def test_prefill_workers_are_chosen_by_their_cache_and_decode_workers_by_load() -> None:
    """A disaggregated fleet (two vLLM prefill workers, one decode worker): a request sharing a
    prefix is prefilled where the prefix went; the decode worker is chosen by load."""
    async with AsyncExitStack() as stack:
        roles = ["prefill", "prefill", "decode"]
        kv_roles = {"prefill": "kv_producer", "decode": "kv_consumer"}
        sidecars = [
            await stack.enter_async_context(vllm_stack(mode=role, kv_role=kv_roles[role]))  # type: ignore[arg-type]
            for role in roles
        ]
        metrics = Metrics()
        parts = RoutingParts.build(
            RouterConfig(routing=Routing.APPROX), metrics.registry, rand=random.Random(1)
        )
        workers = await stack.enter_async_context(WorkerSet(FAST_WORKERS, rand=random.Random(3)))
        for role, sidecar in zip(roles, sidecars, strict=True):
            workers.add_worker(f"127.0.0.1:{sidecar.server.port}", role)
        with anyio.fail_after(20):
            await workers.wait_serving(2, "prefill")
            await workers.wait_serving(1, "decode")
        choice = parts.choice(workers)
        frontend = Frontend(
            (SGLANG, VLLM), workers, HandlerConfig(), metrics=metrics, choice=choice, watch=choice
        )
        runner = web.AppRunner(frontend.build_app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        http = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)))
        fe = FrontendStack(
            frontend, workers, metrics, f"http://127.0.0.1:{runner.addresses[0][1]}", http, sidecars
        )
        await _generate(fe, [*PREFIX, 11])
        await _generate(fe, [*PREFIX, 12])
        get = metrics.registry.get_sample_value
        assert get("frontend_routing_decisions_total", {"role": "prefill", "reason": "load"}) == 1
        assert get("frontend_routing_decisions_total", {"role": "prefill", "reason": "affinity"}) == 1
        assert get("frontend_routing_decisions_total", {"role": "decode", "reason": "load"}) == 2
        # Both prefills ran on one worker, the second hitting the prefix the first cached.
        prefills = _workers_with(fe, "frontend_kv_prompt_tokens_total")
        assert len(prefills) == 1, prefills
        (prefill,) = prefills
        assert prefill in {fe.address(0), fe.address(1)}
        assert _sample(fe, "frontend_kv_reported_cached_tokens_total", {"worker": prefill}) == len(PREFIX)
