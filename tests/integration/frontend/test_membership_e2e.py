"""The membership API through the frontend's HTTP port, with aiohttp as the trainer: a testkit
vLLM sidecar registered by ``POST /workers`` serves, is listed with its state, model and load,
and drains on ``DELETE`` (a stream in flight finishes); the legacy ``/add_worker``,
``/remove_worker``, ``/list_workers``; the bearer token and loopback rules; the refusals. (Several processes:
tests/unit/frontend/test_membership_relay.py and tests/process/test_membership_process.py.)"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from testkit.faults import FaultKind, FaultPlan

from sidecar_frontend.admin import AdminApi
from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.handler import Frontend, HandlerConfig
from sidecar_frontend.membership import Membership, worker_id
from sidecar_frontend.workers import WorkerSet
from tests.e2e_helpers import until
from tests.integration.frontend.fixtures import FAST_WORKERS, sse_events
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(90)

PROMPT = [101, 202, 303, 404]
TOKEN = "test-admin-token"


@dataclass
class Admin:
    url: str
    http: aiohttp.ClientSession
    workers: WorkerSet
    membership: Membership

    async def call(
        self, method: str, path: str, *, body: object = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, Mapping[str, str]]:
        """(status, JSON or text, headers) of one call."""
        data = None if body is None else json.dumps(body).encode()
        async with self.http.request(method, self.url + path, data=data, headers=headers) as response:
            text = await response.text()
            try:
                payload: Any = json.loads(text)
            except ValueError:
                payload = text
            return response.status, payload, dict(response.headers)

    async def until(self, condition: Callable[[], bool]) -> None:
        """Until ``condition`` holds, re-checked at each change of the worker set (bounded)."""
        with anyio.fail_after(20):
            while True:
                changed = self.workers.next_change()
                if condition():
                    return
                await changed.wait()


def _from_peer(peer: str) -> Middleware:
    """A middleware that makes every request come from ``peer`` (as a remote client would)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await handler(request.clone(remote=peer))

    return middleware


@asynccontextmanager
async def admin_frontend(
    *,
    token: str | None = None,
    discovered: tuple[str, ...] = (),
    peer: str | None = None,
    alone: bool = False,
    add_wait: float = 20.0,
) -> AsyncIterator[Admin]:
    """A frontend with no worker, its admin API on its HTTP port (or alone on its own port)."""
    async with WorkerSet(FAST_WORKERS, rand=random.Random(7)) as workers:
        membership = Membership(workers, "static")
        for address in discovered:
            membership.add_worker(address)
        api = AdminApi(workers, membership, token=token, add_wait=add_wait)
        frontend = Frontend((VLLM, SGLANG), workers, HandlerConfig())
        app = api.app() if alone else frontend.build_app(api.routes())
        if peer is not None:
            app.middlewares.append(_from_peer(peer))
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                yield Admin(url, http, workers, membership)
        finally:
            await runner.cleanup()


async def test_a_registered_sidecar_serves_is_listed_and_drains_on_delete() -> None:
    async with vllm_stack(token_latency_ms=5.0) as sidecar, admin_frontend() as fe:
        address = f"127.0.0.1:{sidecar.server.port}"
        url = f"grpc://{address}"
        status, body, headers = await fe.call("POST", "/workers", body={"url": url, "worker_type": "regular"})
        expected_id = worker_id(url)
        assert status == 202
        assert body["status"] == "accepted"
        assert (body["worker_id"], body["url"], body["location"]) == (
            expected_id,
            url,
            f"/workers/{expected_id}",
        )
        assert headers["Location"] == f"/workers/{expected_id}"
        await fe.until(lambda: bool(fe.workers.serving()))

        status, listed, _ = await fe.call("GET", "/workers")
        assert status == 200
        assert listed["total"] == 1
        assert listed["stats"] == {"regular_count": 1, "prefill_count": 0, "decode_count": 0}
        row = listed["workers"][0]
        assert {k: row[k] for k in ("id", "url", "worker_type", "state", "model", "engine", "source")} == {
            "id": expected_id,
            "url": url,
            "worker_type": "regular",
            "state": "serving",
            "model": "testkit-model",
            "engine": "vllm",
            "source": "api",
        }
        assert row["weight_version"] is None
        assert row["load"] == 0

        # It serves: a generation through the frontend.
        body_unary = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}}
        async with fe.http.post(fe.url + "/inference/v1/generate", json=body_unary) as response:
            assert response.status == 200
            assert len((await response.json())["choices"][0]["token_ids"]) == 3

        # A stream in flight while it is deleted finishes; no new request goes there. The
        # engine holds it before its first token until the checks are done.
        release = asyncio.Event()
        plan = FaultPlan(FaultKind.STALL_FIRST_TOKEN, stall_secs=60, release=release)
        sidecar.engine.faults.add("held-stream", plan)
        stream_body = {
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 40},
            "stream": True,
            "request_id": "held-stream",
        }

        async def stream() -> list[str]:
            async with fe.http.post(fe.url + "/inference/v1/generate", json=stream_body) as response:
                assert response.status == 200
                return await sse_events(response)

        streaming = asyncio.ensure_future(stream())
        worker = fe.workers.get(address)
        assert worker is not None
        await until(lambda: worker.inflight == 1, "the stream is in flight on the worker")
        _, during, _ = await fe.call("GET", f"/workers/{expected_id}")
        assert during["load"] == 1

        status, deleted, _ = await fe.call("DELETE", f"/workers/{expected_id}")
        assert status == 202
        assert deleted == {
            "status": "accepted",
            "worker_id": expected_id,
            "url": url,
            "message": f"worker {url} is draining: requests in flight there finish, then it leaves",
        }
        _, draining, _ = await fe.call("GET", f"/workers/{expected_id}")
        assert (draining["state"], draining["source"], draining["url"]) == ("draining", "api", url)
        async with fe.http.post(fe.url + "/inference/v1/generate", json=body_unary) as refused:
            assert refused.status == 503, "no worker takes new requests"
        status, again, _ = await fe.call("DELETE", f"/workers/{expected_id}")
        assert (status, again["code"]) == (409, "WORKER_DRAINING")
        assert not streaming.done()

        release.set()
        events = await streaming
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 40
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        await fe.until(lambda: fe.workers.get(address) is None)
        _, after, _ = await fe.call("GET", "/workers")
        assert after["total"] == 0
        status, gone, _ = await fe.call("GET", f"/workers/{expected_id}")
        assert (status, gone) == (
            404,
            {"error": f"Worker {expected_id} not found", "code": "WORKER_NOT_FOUND"},
        )
        # Gone: it may be registered again.
        status, _, _ = await fe.call("POST", "/workers", body={"url": url})
        assert status == 202


async def test_the_legacy_endpoints() -> None:
    async with vllm_stack() as sidecar, admin_frontend() as fe:
        url = f"grpc://127.0.0.1:{sidecar.server.port}"
        # /add_worker answers once the worker serves, as the legacy routers do.
        status, text, _ = await fe.call("POST", f"/add_worker?url={url}")
        assert (status, text) == (200, f"Successfully added worker: {url}")
        assert len(fe.workers.serving()) == 1
        status, text, _ = await fe.call("POST", f"/add_worker?url={url}")
        assert status == 400
        assert text.startswith(f"worker {url} is already registered with id {worker_id(url)}")
        status, listed, _ = await fe.call("GET", "/list_workers")
        assert (status, listed) == (200, {"urls": [url]})

        async with fe.http.post(
            fe.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        ) as response:
            assert response.status == 200

        status, text, _ = await fe.call("POST", f"/remove_worker?url={url}")
        assert (status, text) == (200, f"Successfully removed worker: {url}")
        status, text, _ = await fe.call("POST", "/remove_worker?url=grpc://127.0.0.1:1")
        assert (status, text) == (200, "worker grpc://127.0.0.1:1 was not registered: nothing to remove")
        status, text, _ = await fe.call("POST", "/add_worker")
        assert (status, text) == (
            400,
            "the url query parameter is required: /add_worker?url=grpc://HOST:PORT",
        )
        status, text, _ = await fe.call("POST", "/add_worker?url=http://127.0.0.1:1")
        assert status == 501  # this AdminApi runs no sidecars (the frontend's does)
        assert "runs no sidecar for bare engines here" in text
        status, text, _ = await fe.call("GET", "/add_worker?url=" + url)
        assert status == 405


async def test_a_legacy_add_of_a_worker_that_never_serves_fails_and_removes_it() -> None:
    # Nothing listens on port 9: the worker never serves within the (shortened) wait.
    async with admin_frontend(add_wait=0.5) as fe:
        status, text, _ = await fe.call("POST", "/add_worker?url=grpc://127.0.0.1:9")
        assert (status, text) == (
            400,
            "Timeout 0.5s waiting for worker grpc://127.0.0.1:9 to serve; it was removed again",
        )
        assert fe.membership.registered() == {}


async def test_with_a_token_every_admin_call_needs_it() -> None:
    async with admin_frontend(token=TOKEN) as fe:
        for method, path in (("GET", "/workers"), ("GET", "/list_workers"), ("POST", "/workers")):
            status, body, headers = await fe.call(method, path)
            assert status == 401, path
            assert body == {
                "error": "admin calls need the header Authorization: Bearer <admin token>",
                "code": "UNAUTHORIZED",
            }
            assert headers["WWW-Authenticate"] == "Bearer"
            status, body, _ = await fe.call(method, path, headers={"Authorization": "Bearer wrong"})
            assert (status, body["code"]) == (401, "UNAUTHORIZED")
        status, _, _ = await fe.call("GET", "/workers", headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200
        # Generations never need it.
        async with fe.http.post(fe.url + "/generate", json={"input_ids": PROMPT}) as response:
            assert response.status == 503, "no worker yet, but not refused for want of a token"


async def test_without_a_token_only_loopback_may_call() -> None:
    async with admin_frontend(peer="10.1.2.3") as fe:
        for method, path in (
            ("GET", "/workers"),
            ("POST", "/add_worker?url=grpc://h:1"),
            ("DELETE", "/workers/x"),
        ):
            status, body, _ = await fe.call(method, path)
            assert (status, body["code"]) == (403, "FORBIDDEN"), path
            assert "only from this host's loopback" in body["error"]
    async with admin_frontend(token=TOKEN, peer="10.1.2.3") as fe:
        status, _, _ = await fe.call("GET", "/workers", headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, "with the token, any peer"
    async with admin_frontend() as fe:
        status, _, _ = await fe.call("GET", "/workers")
        assert status == 200, "loopback, no token"


async def test_refusals() -> None:
    async with vllm_stack() as sidecar:
        address = f"127.0.0.1:{sidecar.server.port}"
        async with admin_frontend(discovered=(address,)) as fe:
            status, body, headers = await fe.call("PUT", "/workers")
            assert (status, body["code"], headers["Allow"]) == (405, "METHOD_NOT_ALLOWED", "GET, POST")
            status, body, _ = await fe.call("GET", "/workers/nope")
            assert (status, body) == (404, {"error": "Worker nope not found", "code": "WORKER_NOT_FOUND"})
            status, body, _ = await fe.call("POST", "/workers", body={"url": "grpc://h:1", "priority": 3})
            assert (status, body) == (
                400,
                {
                    "error": "unsupported field priority: this frontend takes url, worker_type, "
                    "bootstrap_port, engine",
                    "code": "BAD_REQUEST",
                },
            )
            status, body, _ = await fe.call("POST", "/workers", body={"url": "http://h:1", "engine": "vllm"})
            assert (status, body["code"]) == (400, "BAD_REQUEST")  # vLLM's HTTP server: no sidecar speaks it
            status, body, _ = await fe.call("POST", "/workers", body={"url": "http://h:1"})
            assert (status, body["code"]) == (501, "NOT_IMPLEMENTED")  # this AdminApi runs no sidecars
            # The static list's worker belongs to discovery.
            status, body, _ = await fe.call("POST", "/workers", body={"url": f"grpc://{address}"})
            assert (status, body["code"]) == (409, "WORKER_FROM_DISCOVERY")
            status, body, _ = await fe.call("DELETE", f"/workers/{worker_id(f'grpc://{address}')}")
            assert (status, body["code"]) == (409, "WORKER_FROM_DISCOVERY")
            _, listed, _ = await fe.call("GET", "/workers")
            assert [row["source"] for row in listed["workers"]] == ["static"]


async def test_the_admin_endpoints_alone_on_their_port() -> None:
    async with admin_frontend(alone=True) as fe:
        status, _, _ = await fe.call("GET", "/workers")
        assert status == 200
        status, body, _ = await fe.call("POST", "/generate", body={"input_ids": PROMPT})
        assert (status, body) == (404, {"error": "no admin route for /generate", "code": "NOT_FOUND"})
