"""The owner of the server's background tasks: every task it started ends with it, none starts
after it closed, and a task that fails is logged rather than lost."""

from __future__ import annotations

import asyncio
import contextlib

import anyio
import pytest
from structlog.testing import capture_logs

from sidecar_server.background import BackgroundTasks

pytestmark = pytest.mark.timeout(30)


async def test_close_cancels_every_task_and_starts_no_more() -> None:
    tasks = BackgroundTasks("owner")
    started = anyio.Event()

    async def forever() -> None:
        started.set()
        await anyio.sleep_forever()

    task = tasks.spawn(forever, "forever")
    assert task is not None
    assert task.get_name() == "owner: forever"
    await started.wait()
    with anyio.fail_after(10):
        await tasks.close(timeout=10)
    assert task.cancelled()
    assert tasks.running == 0
    assert tasks.spawn(forever, "late") is None


async def test_a_failed_task_is_logged() -> None:
    tasks = BackgroundTasks("owner")

    async def broken() -> None:
        raise ZeroDivisionError("division by zero")

    with capture_logs() as logs:
        task = tasks.spawn(broken, "broken")
        assert task is not None
        with anyio.fail_after(10):
            # Until the task's done callback (which logs) has run.
            while tasks.running:  # noqa: ASYNC110 - a task, not an event
                await anyio.sleep(0.01)
    (line,) = [e for e in logs if e["event"] == "background task failed"]
    assert line["log_level"] == "error"
    assert line["task"] == "owner: broken"
    assert "ZeroDivisionError" in line["error"]
    await tasks.close(timeout=10)


async def test_close_waits_no_longer_than_its_timeout_for_a_task_that_ignores_cancellation() -> None:
    tasks = BackgroundTasks("owner")
    inside, release = anyio.Event(), anyio.Event()

    async def stubborn() -> None:
        inside.set()
        while not release.is_set():
            # A task that swallows its cancellation (a bug elsewhere): close() must not hang.
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    task = tasks.spawn(stubborn, "stubborn")
    assert task is not None
    await inside.wait()
    with capture_logs() as logs:
        await tasks.close(timeout=0.05)
    assert not task.done()
    (line,) = [e for e in logs if e["event"] == "background tasks still running after stop"]
    assert line["tasks"] == ["owner: stubborn"]
    release.set()
    with anyio.fail_after(10):
        await task
