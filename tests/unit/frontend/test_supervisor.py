"""The supervisor of the frontend's background tasks: a failure (an exception, or a
CancelledError nobody asked for) is one error line naming the task and its worker, counted, and
the task runs again; a real cancel ends it quietly; nothing else is touched."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from sidecar_frontend.supervisor import Supervisor, SupervisorConfig

FAST = SupervisorConfig(restart_first_secs=0.01, restart_max_secs=0.05)


def failures(registry: CollectorRegistry, task: str) -> float:
    return registry.get_sample_value("frontend_background_failures_total", {"task": task}) or 0.0


class Runs:
    """A task body that fails its first ``fail`` runs (``error`` raised), then waits forever;
    ``started`` is set at each run."""

    def __init__(self, fail: int, error: type[BaseException] = RuntimeError) -> None:
        self.fail = fail
        self.error = error
        self.count = 0
        self.started = anyio.Event()

    async def __call__(self) -> None:
        self.count += 1
        self.started.set()
        self.started = anyio.Event()
        if self.count <= self.fail:
            raise self.error("boom")
        await anyio.sleep_forever()

    async def reach(self, count: int) -> None:
        with anyio.fail_after(10):
            while self.count < count:
                await self.started.wait()


@pytest.mark.parametrize("error", [RuntimeError, AttributeError, asyncio.CancelledError])
async def test_a_failed_task_is_logged_once_with_its_worker_counted_and_run_again(
    error: type[BaseException],
) -> None:
    registry = CollectorRegistry()
    failing, sibling = Runs(fail=1, error=error), Runs(fail=0)
    with capture_logs() as logs:
        async with Supervisor(FAST, registry=registry) as supervisor:
            supervisor.start("load_poll", failing, owner="10.0.0.1:50051")
            supervisor.start("health", sibling, owner="10.0.0.2:50051")
            await failing.reach(2)  # failed once, then ran again
            await sibling.reach(1)
            assert sibling.count == 1, "another worker's task is untouched"
    errors = [e for e in logs if e["log_level"] == "error"]
    assert len(errors) == 1, errors
    assert errors[0]["event"] == "background task failed"
    assert errors[0]["task"] == "load_poll"
    assert errors[0]["worker"] == "10.0.0.1:50051"
    assert failures(registry, "load_poll") == 1
    assert failures(registry, "health") == 0


async def test_a_bare_cancelled_error_in_a_child_does_not_cancel_the_owner() -> None:
    """The task group would take a child's CancelledError for a request to stop and end the
    body silently (what killed the frontend under load); supervised, the body goes on."""
    reached_after = False
    with capture_logs() as logs:
        async with Supervisor(FAST) as supervisor:
            task = Runs(fail=3, error=asyncio.CancelledError)
            supervisor.start("kv_stream", task, owner="w")
            await task.reach(4)
            await anyio.lowlevel.checkpoint()  # a cancel of the body would land here
            reached_after = True
    assert reached_after
    assert [e["task"] for e in logs if e["event"] == "background task failed"] == ["kv_stream"] * 3


async def test_stopping_an_owner_cancels_its_tasks_quietly_and_only_its_own() -> None:
    registry = CollectorRegistry()
    mine, other = Runs(fail=0), Runs(fail=0)
    with capture_logs() as logs:
        async with Supervisor(FAST, registry=registry) as supervisor:
            supervisor.start("health", mine, owner="a")
            supervisor.start("load_poll", mine, owner="a")
            supervisor.start("health", other, owner="b")
            await mine.reach(2)
            await other.reach(1)
            supervisor.stop_owner("a")
            with anyio.fail_after(10):
                await supervisor.until_ended("a")
            assert supervisor.tasks_of("b") == 1
    assert not [e for e in logs if e["log_level"] == "error"]
    assert failures(registry, "health") == 0


async def test_a_task_that_returns_is_done_and_one_not_restarted_stays_ended() -> None:
    calls: list[str] = []

    async def once() -> None:
        calls.append("once")

    async def broken() -> None:
        calls.append("broken")
        raise ValueError("no")

    with capture_logs() as logs:
        async with Supervisor(FAST) as supervisor:
            supervisor.start("discovery", once)
            supervisor.start("redial", broken, owner="w", restart=False)
            with anyio.fail_after(10):
                await supervisor.until_ended("")
                await supervisor.until_ended("w")
    assert sorted(calls) == ["broken", "once"]
    failed = [e for e in logs if e["event"] == "background task failed"]
    assert [(e["task"], e["restart_in_secs"]) for e in failed] == [("redial", None)]


async def test_the_bodys_exception_reaches_the_group_as_with_a_task_groups_async_with() -> None:
    """The group sees the body's exception (it once went through an exit stack that hid it),
    and raises it as a task group does: in an exception group."""
    with pytest.RaisesGroup(KeyError):
        async with Supervisor(FAST) as supervisor:
            supervisor.start("health", Runs(fail=0), owner="w")
            raise KeyError("the body's own")


async def test_the_fault_file_fails_every_running_task_of_a_name_once(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    fault_file = tmp_path / "faults"
    config = SupervisorConfig(restart_first_secs=0.01, restart_max_secs=0.05, fault_file=fault_file)
    a, b, other = Runs(fail=0), Runs(fail=0), Runs(fail=0)
    with capture_logs() as logs:
        async with Supervisor(config, registry=registry) as supervisor:
            supervisor.start("load_poll", a, owner="a")
            supervisor.start("load_poll", b, owner="b")
            supervisor.start("health", other, owner="a")
            await a.reach(1)
            await b.reach(1)
            fault_file.write_text("load_poll\n")
            await a.reach(2)
            await b.reach(2)
            assert other.count == 1
    assert failures(registry, "load_poll") == 2
    failed = sorted(e["worker"] for e in logs if e["event"] == "background task failed")
    assert failed == ["a", "b"]


async def test_a_fault_file_read_half_written_fails_no_task_twice(tmp_path: Path) -> None:
    """A writer rewrites the whole file (truncate, then write): a read half way sees a cut last
    name, or fewer names. A cut name fails nothing, and a name read again later fails nothing
    again (the task-faults process test saw one worker's health fail twice)."""
    registry = CollectorRegistry()
    fault_file = tmp_path / "faults"
    config = SupervisorConfig(restart_first_secs=0.01, restart_max_secs=0.05, fault_file=fault_file)
    a, other = Runs(fail=0), Runs(fail=0)
    async with Supervisor(config, registry=registry) as supervisor:
        supervisor.start("load_poll", a, owner="a")
        supervisor.start("health", other, owner="a")
        await a.reach(1)
        await other.reach(1)
        fault_file.write_text("health\nload_p")  # the second line not written yet
        await other.reach(2)  # the poll that read it
        assert a.count == 1
        fault_file.write_text("health\nload_poll\n")
        await a.reach(2)  # the poll that read the whole file: health is not failed again
        assert other.count == 2
    assert failures(registry, "health") == 1
    assert failures(registry, "load_poll") == 1


async def test_a_stopped_task_that_ends_with_a_cancel_not_its_own_does_not_stop_the_owner() -> None:
    """A worker is forgotten: its tasks are stopped and its channels closed in the same step.
    A task awaiting a call then ends with grpc.aio's own CancelledError (the closing channel
    cancelled the call), which is not the scope's, so the scope let it through; the task group
    took it for a cancel of its host and the frontend stopped without a word (about 5 runs in
    110 of the kill-and-drain load test under CPU hogs)."""
    started = anyio.Event()

    async def awaiting_a_call() -> None:
        started.set()
        with contextlib.suppress(asyncio.CancelledError):
            await anyio.sleep_forever()
        raise asyncio.CancelledError()  # grpc.aio's, with neither the scope's message nor context

    body_ran_on = False
    with capture_logs() as logs:
        async with Supervisor(FAST) as supervisor:
            supervisor.start("load_poll", awaiting_a_call, owner="10.0.0.1:50051")
            await started.wait()
            supervisor.stop_owner("10.0.0.1:50051")
            with anyio.fail_after(10):
                await supervisor.until_ended("10.0.0.1:50051")
            await anyio.lowlevel.checkpoint()  # a cancel of the body would land here
            body_ran_on = True
    assert body_ran_on
    assert not [e for e in logs if e["log_level"] == "error"], "a stop asked for is not a failure"
