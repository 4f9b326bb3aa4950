"""The legacy ``/add_worker`` under ``--processes N``: it answers once the worker serves in
every process, not only in the one that took the call, so that a request sent after the answer
finds it serving whichever process it reaches. Two processes' worker sets in one event loop,
each with its relayed control, over a parent that decides as parent.py does (a
:class:`RelayBook`) and holds its lines to process 1 until the test lets them through (process
1 busy); a testkit vLLM sidecar as the worker. (The real processes:
tests/process/test_membership_process.py.)"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from sidecar_frontend.admin import AdminApi, ParentLink, RelayedControl
from sidecar_frontend.membership import Membership
from sidecar_frontend.membership_relay import (
    Apply,
    RelayBook,
    apply_line,
    everywhere_line,
    parse_request,
    parse_serving,
    refused_line,
)
from sidecar_frontend.registry import WorkerState
from sidecar_frontend.workers import WorkerSet
from tests.integration.frontend.fixtures import FAST_WORKERS
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(90)

WAIT = 20.0


class Parent:
    """The parent of two processes, as parent.py: a request is decided by the book and sent
    to both (or refused to the asker), a serving report is recorded and, once both said so,
    the worker is said to serve everywhere. Lines to process 1 wait while :attr:`held`."""

    def __init__(self, memberships: list[Membership]) -> None:
        self.book = RelayBook()
        self.controls = [RelayedControl(m, self._link(i)) for i, m in enumerate(memberships)]
        self.held: list[bytes] | None = []
        self.reported = [asyncio.Event(), asyncio.Event()]  # each process said a worker serves

    def _link(self, index: int) -> ParentLink:
        def send(line: bytes) -> None:
            request = parse_request(line)
            if request is not None:
                decision = self.book.decide(index, request)
                if isinstance(decision, Apply):
                    self._to_all(apply_line(decision))
                else:
                    self._write(index, refused_line(decision))
                return
            address = parse_serving(line)
            assert address is not None, line
            self.reported[index].set()
            everywhere = self.book.serving(index, address, len(self.controls))
            if everywhere is not None:
                self._to_all(everywhere_line(everywhere))

        return ParentLink(index, send, lambda handler: None, ())

    def _to_all(self, line: bytes) -> None:
        for index in range(len(self.controls)):
            self._write(index, line)

    def _write(self, index: int, line: bytes) -> None:
        if index == 1 and self.held is not None:
            self.held.append(line)
            return
        # The line arrives later, on the loop, as from a pipe.
        asyncio.get_running_loop().call_soon(self.controls[index].deliver, line)

    def release(self) -> None:
        """Process 1 reads what waited for it, and what comes from now on."""
        held, self.held = self.held or [], None
        for line in held:
            self._write(1, line)


@dataclass
class Fleet:
    client: TestClient[web.Request, web.Application]
    parent: Parent
    workers: list[WorkerSet]


@asynccontextmanager
async def two_processes() -> AsyncIterator[Fleet]:
    """Process 0's admin routes (as server.py builds them) and both processes' serving reports."""
    async with (
        WorkerSet(FAST_WORKERS, rand=random.Random(1)) as first,
        WorkerSet(FAST_WORKERS, rand=random.Random(2)) as second,
    ):
        parent = Parent([Membership(first, "static"), Membership(second, "static")])
        application = web.Application()
        application.add_routes(
            AdminApi(first, parent.controls[0].membership, token=None, control=parent.controls[0]).routes()
        )
        async with anyio.create_task_group() as reports:
            for control in parent.controls:
                reports.start_soon(control.report_serving)
            async with TestClient(TestServer(application)) as client:
                yield Fleet(client, parent, [first, second])
            reports.cancel_scope.cancel()


def _state(workers: WorkerSet, address: str) -> WorkerState | None:
    worker = workers.get(address)
    return worker.state if worker is not None else None


async def test_add_worker_answers_once_every_process_serves_the_worker() -> None:
    async with vllm_stack() as sidecar, two_processes() as fleet:
        address = f"127.0.0.1:{sidecar.server.port}"
        url = f"grpc://{address}"
        add = asyncio.create_task(fleet.client.post(f"/add_worker?url={url}"))
        # Process 0 serves the worker and says so; process 1 has not even been told of it.
        with anyio.fail_after(WAIT):
            await fleet.parent.reported[0].wait()
        assert _state(fleet.workers[0], address) is WorkerState.SERVING
        assert _state(fleet.workers[1], address) is None
        fleet.parent.release()
        with anyio.fail_after(WAIT):
            response = await add
        assert (response.status, await response.text()) == (200, f"Successfully added worker: {url}")
        # Whichever process the next request reaches serves the worker.
        assert [_state(workers, address) for workers in fleet.workers] == [WorkerState.SERVING] * 2


async def test_a_worker_removed_while_other_processes_connect_fails_the_add() -> None:
    async with vllm_stack() as sidecar, two_processes() as fleet:
        url = f"grpc://127.0.0.1:{sidecar.server.port}"
        add = asyncio.create_task(fleet.client.post(f"/add_worker?url={url}"))
        with anyio.fail_after(WAIT):
            await fleet.parent.reported[0].wait()
        # Process 1 never gets to it: the worker is removed meanwhile (another call).
        removed = await fleet.client.post(f"/remove_worker?url={url}")
        assert removed.status == 200
        with anyio.fail_after(WAIT):
            response = await add
        assert (response.status, await response.text()) == (400, f"worker {url} was removed before it served")
        assert fleet.parent.book.registrations() == ()
