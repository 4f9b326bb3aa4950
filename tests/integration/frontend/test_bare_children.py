"""The frontend's managed sidecars as processes (sidecar_frontend/bare_children.py), with a
small Python program standing in for the sidecar: a child that exits is started again and
counted; a child that ignores SIGTERM is killed after the grace; a removed worker's child is
stopped only once the worker set let go of the worker."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
import structlog.testing
from prometheus_client import CollectorRegistry, Counter

from sidecar_common.parent_death import PARENT_PID_VARIABLE
from sidecar_frontend.bare_children import BareSidecars, ManagedSidecar
from sidecar_frontend.bare_sidecars import ChildSettings, RestartPolicy
from sidecar_frontend.membership import Registration

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

WAIT = 30.0
REGISTRATION = Registration("http://127.0.0.1:9", "127.0.0.1:9", "agg", "sglang", None, "127.0.0.1:1")


def _child(program: str, *, policy: RestartPolicy | None = None, grace: float = 5.0) -> ManagedSidecar:
    restarts = Counter("restarts", "test", ["url"], registry=CollectorRegistry())
    return ManagedSidecar(
        REGISTRATION,
        [sys.executable, "-c", program],
        {},
        0,
        policy or RestartPolicy(first_delay=0.01, max_delay=0.05),
        restarts,
        grace,
    )


async def _until(check: Any) -> None:
    with anyio.fail_after(WAIT):
        while not check():  # noqa: ASYNC110
            await anyio.sleep(0.01)  # another process's doing: no event to wait on


async def _run_until(child: ManagedSidecar, check: Any) -> None:
    """Run ``child`` (restarts and all) until ``check()`` holds, then stop it."""
    async with anyio.create_task_group() as group:
        group.start_soon(child.run)
        await _until(check)
        await child.stop()


async def test_a_child_that_exits_is_started_again_and_counted() -> None:
    child = _child("raise SystemExit(3)")
    await _run_until(child, lambda: child.restarted >= 2)
    assert child.restarts.labels(url=REGISTRATION.url)._value.get() == child.restarted
    assert child.process is not None
    assert child.process.returncode == 3


async def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    program = (
        "import signal, time, pathlib\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(600)\n"
    )
    child = _child(program, grace=0.2)
    await _run_until(child, ready.exists)
    assert child.process is not None
    assert child.process.returncode == -9
    assert child.restarted == 0


async def test_a_child_is_told_its_parent_and_runs_in_its_own_process_group(tmp_path: Path) -> None:
    # What the child's parent-death guard reads (sidecar_common/parent_death.py), and a group
    # of its own (a terminal's Ctrl-C reaches the frontend, not the child).
    seen = tmp_path / "seen"
    program = (
        "import os, pathlib\n"
        f"told = os.environ[{PARENT_PID_VARIABLE!r}]\n"
        "own = os.getpgid(0) == os.getpid()\n"
        f"pathlib.Path({str(seen)!r}).write_text(f'{{told}} {{os.getppid()}} {{own}}')\n"
        "import time; time.sleep(600)\n"
    )
    child = _child(program, grace=0.2)
    await _run_until(child, lambda: seen.exists() and seen.read_text())
    parent, ppid, own_group = seen.read_text().split()
    assert parent == ppid == str(os.getpid())
    assert own_group == "True"


class FakeWorkers:
    """What BareSidecars reads of the worker set: whether it holds an address, and changes."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self._changed = anyio.Event()

    def get(self, address: str) -> object | None:
        return address if address in self.held else None

    def next_change(self) -> anyio.Event:
        return self._changed

    def drop(self, address: str) -> None:
        self.held.discard(address)
        self._changed.set()
        self._changed = anyio.Event()


async def test_a_removed_workers_sidecar_stops_once_the_worker_left() -> None:
    workers = FakeWorkers()
    settings = ChildSettings(sys.executable, "json", "info")
    async with BareSidecars(cast(Any, workers), settings, stop_grace=5.0) as bare:
        started = bare.start(REGISTRATION)
        address = started.worker_address
        child = bare.children()[address]
        # Stand in for the sidecar: a program that runs until told to stop.
        child.argv = [sys.executable, "-c", "import time; time.sleep(600)"]
        workers.held.add(address)
        await _until(lambda: child.pid is not None)
        bare.stop_after_leaving(address)
        await anyio.wait_all_tasks_blocked()
        assert child.pid is not None, "its worker still drains: the child runs"
        workers.drop(address)
        with anyio.fail_after(WAIT):
            await child.stopped.wait()
        assert address not in bare.children()
        # Another child runs until the block ends: leaving it stops that one too.
        other = bare.start(Registration("http://127.0.0.1:8", "127.0.0.1:8", "agg", "sglang"))
        second = bare.children()[other.worker_address]
        second.argv = [sys.executable, "-c", "import time; time.sleep(600)"]
        await _until(lambda: second.pid is not None)
    assert second.stopped.is_set()
    assert second.process is not None
    assert second.process.returncode is not None


async def test_a_spawn_that_raises_costs_that_child_never_the_frontend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An event loop that refuses an argument raises ValueError, not OSError: the frontend once
    # exited on it. Now it is logged, counted as an exit and tried again after the backoff.
    async def refuse(*args: object, **kwargs: object) -> object:
        raise ValueError("unexpected kwargs: process_group")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", refuse)
    child = _child("raise SystemExit(0)")
    with structlog.testing.capture_logs() as logs:
        await _run_until(child, lambda: child.restarted >= 2)
    failed = [e for e in logs if e["event"] == "a bare engine's sidecar did not start"]
    assert failed
    assert "unexpected kwargs" in failed[0]["error"]
    assert child.restarts.labels(url=REGISTRATION.url)._value.get() == child.restarted
