"""The fan-out admin calls (issue 28): ``POST /flush_cache`` empties every serving worker's
prefix cache, ``GET /get_loads`` lists every worker's load; both as SGLang's model gateway (SMG)
answers them, so a trainer's script written for SMG reads ours.

* ``/flush_cache``: each serving worker's sidecar gets a ``FlushCache`` (vLLM's gRPC
  ``FlushCache``, SGLang's ``/flush_cache`` or its gRPC ``FlushCache``), all at once, each
  bounded by :data:`FLUSH_TIMEOUT`. 200 ``{"status": "success", "message",
  "workers_flushed", "total_workers"}`` when every one flushed; 206 ``"partial_success"`` with
  ``successful`` (their URLs) and ``failed`` (``[{"worker", "error"}]``: an engine's refusal in
  its words, a sidecar that cannot flush its engine's cache, a worker not serving) otherwise.
  No worker: 200 and "nothing to flush", as SMG. A worker is named by its registered URL.
* ``/get_loads``: 200 ``{"workers": [{"worker", "load", "details"}]}``: ``load`` is the
  worker's requests in flight as GET /workers counts them; ``details`` the engine's own figures
  (running and waiting requests, KV use, engine state, weight version; null where unknown).

The replies are built by pure functions (:func:`flush_reply`, :func:`loads_reply`); the
handlers only call the sidecars.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Final

import anyio
import grpc
import orjson
from aiohttp import web

from sidecar_common.api import sidecar_pb2
from sidecar_common.tracing import outgoing_metadata
from sidecar_frontend.membership import Membership
from sidecar_frontend.registry import Worker
from sidecar_frontend.workers import WorkerSet

__all__ = [
    "FLUSH_TIMEOUT",
    "FlushOutcome",
    "LoadRow",
    "fanout_handlers",
    "flush_reply",
    "loads_reply",
]

# A flush waits for the engine to empty its cache, which SGLang does between steps.
FLUSH_TIMEOUT: Final = 30.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class FlushOutcome:
    """One worker's flush: ``error`` None when it flushed."""

    worker: str
    error: str | None = None


@dataclass(frozen=True)
class LoadRow:
    worker: str
    load: int
    running_requests: int | None
    waiting_requests: int | None
    kv_usage: float | None
    engine_state: str
    weight_version: str | None


def flush_reply(outcomes: list[FlushOutcome]) -> tuple[int, dict[str, object]]:
    """The status and body of ``/flush_cache`` for these outcomes (module docstring)."""
    successful = [o.worker for o in outcomes if o.error is None]
    failed = [{"worker": o.worker, "error": o.error} for o in outcomes if o.error is not None]
    total = len(outcomes)
    if total == 0:
        message = "No workers registered; nothing to flush"
    elif not failed:
        message = f"Successfully flushed cache on all {total} workers"
    else:
        message = f"Cache flush: {len(successful)} succeeded, {len(failed)} failed"
    body: dict[str, object] = {
        "status": "partial_success" if failed else "success",
        "message": message,
        "workers_flushed": len(successful),
        "total_workers": total,
    }
    if failed:
        body["successful"] = successful
        body["failed"] = failed
    return (206 if failed else 200), body


def loads_reply(rows: Iterable[LoadRow]) -> dict[str, object]:
    """The body of ``/get_loads``."""
    return {
        "workers": [
            {
                "worker": row.worker,
                "load": row.load,
                "details": {
                    "running_requests": row.running_requests,
                    "waiting_requests": row.waiting_requests,
                    "kv_usage": row.kv_usage,
                    "engine_state": row.engine_state,
                    "weight_version": row.weight_version,
                },
            }
            for row in rows
        ]
    }


async def _flush_one(worker: Worker, name: str, timeout: float) -> FlushOutcome:
    if not worker.eligible:
        return FlushOutcome(name, f"the worker is not serving ({worker.listed_state})")
    try:
        with anyio.fail_after(timeout):
            await worker.stub().FlushCache(
                sidecar_pb2.FlushCacheRequest(), timeout=timeout, metadata=outgoing_metadata()
            )
    except grpc.RpcError as err:
        code = err.code() if isinstance(err, grpc.aio.AioRpcError) else None
        details = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
        return FlushOutcome(name, f"{code.name if code is not None else 'error'}: {details}")
    except TimeoutError:
        return FlushOutcome(name, f"no answer within {timeout:g} s")
    return FlushOutcome(name)


async def flush_all(targets: list[tuple[Worker, str]], timeout: float = FLUSH_TIMEOUT) -> list[FlushOutcome]:
    """Flush every (worker, its name) at once; one outcome each, in the order given."""
    outcomes: list[FlushOutcome | None] = [None] * len(targets)

    async def one(index: int, worker: Worker, name: str) -> None:
        outcomes[index] = await _flush_one(worker, name, timeout)

    async with anyio.create_task_group() as group:
        for index, (worker, name) in enumerate(targets):
            group.start_soon(one, index, worker, name)
    return [o for o in outcomes if o is not None]


def _json(status: int, body: object) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def fanout_handlers(workers: WorkerSet, membership: Membership) -> dict[str, dict[str, Handler]]:
    """``/flush_cache`` and ``/get_loads`` by method, for the admin routes."""

    def named() -> list[tuple[Worker, str]]:
        return [(w, membership.url_of(w.address)) for w in workers.workers()]

    async def flush(request: web.Request) -> web.StreamResponse:
        status, body = flush_reply(await flush_all(named()))
        return _json(status, body)

    async def loads(request: web.Request) -> web.StreamResponse:
        rows = [
            LoadRow(
                worker=name,
                load=worker.score(),
                running_requests=worker.running_requests,
                waiting_requests=worker.waiting_requests,
                kv_usage=worker.kv_usage,
                engine_state=worker.engine_state.value,
                weight_version=worker.weight_version,
            )
            for worker, name in named()
        ]
        return _json(200, loads_reply(rows))

    return {"/flush_cache": {"POST": flush}, "/get_loads": {"GET": loads}}
