"""``POST /weight_version`` on ``sidecar-frontend --processes 2`` as real processes: the version
one process takes is answered by ``GET /weight_version`` from both (each answer names the
process that gave it) as soon as the POST answered, and a process killed and restarted by the
parent begins with it."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from contextlib import ExitStack
from typing import Any

import pytest

from tests.e2e_helpers import WAIT, free_port
from tests.process.test_membership_process import call, frontend

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow(20)]


def answers_until(url: str, processes: set[int], done: Any) -> dict[int, dict[str, Any]]:
    """GET /weight_version, each call a new connection (the kernel spreads them over the
    processes), until each of ``processes`` gave an answer ``done`` accepts (bounded); the
    last answer of each process."""
    deadline = time.monotonic() + WAIT
    last: dict[int, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        status, body = call("GET", url + "/weight_version")
        assert status == 200, body
        last[body["process"]] = body
        if all(p in last and done(last[p]) for p in processes):
            return last
        time.sleep(0.02)  # polling real processes: there is no event to wait on
    raise AssertionError(f"the processes' last answers: {last}")


def restarted(metrics: str, process: int) -> bool:
    with urllib.request.urlopen(metrics, timeout=WAIT) as response:
        return f'frontend_process_restarts_total{{process="{process}"}} 1.0' in response.read().decode()


def test_a_version_set_through_one_process_is_answered_by_both_and_survives_a_restart() -> None:
    with ExitStack() as stack:
        metrics_port = free_port()
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        seen: list[dict[str, Any]] = []
        url, _ = stack.enter_context(
            frontend(
                "--processes",
                "2",
                "--metrics-port",
                str(metrics_port),
                seen=seen,
            )
        )
        pids = {e["process"]: e["pid"] for e in seen if e.get("event") == "process started"}
        assert sorted(pids) == [0, 1]
        before = answers_until(url, {0, 1}, lambda body: True)
        assert {p: b["weight_version"] for p, b in before.items()} == {0: None, 1: None}

        status, posted = call("POST", url + "/weight_version", {"weight_version": "step-7"})
        assert status == 200, posted
        assert (posted["weight_version"], posted["set_by_admin"]) == ("step-7", True)
        assert posted["process"] in (0, 1)

        # Both processes held it when the POST answered: every answer after it has it.
        def holds_it(body: dict[str, Any]) -> bool:
            assert body["weight_version"] == "step-7", body
            return True

        after = answers_until(url, {0, 1}, holds_it)
        for body in after.values():
            assert (body["set_by_admin"], body["route_latest_weights"]) == (True, True)

        # A process killed outright is restarted by the parent, with the version set.
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + WAIT
        while not restarted(metrics, 0):
            assert time.monotonic() < deadline, "process 0 was not restarted"
            time.sleep(0.1)  # polling a real process: there is no event to wait on
        # Every answer from process 0 now comes from its new run: the first one has the version.
        first = answers_until(url, {0}, lambda body: True)[0]
        assert (first["weight_version"], first["set_by_admin"]) == ("step-7", True)

        # Given back to the workers' reports (none here), in both.
        status, posted = call("POST", url + "/weight_version", {"weight_version": None})
        assert (status, posted["set_by_admin"]) == (200, False)
        answers_until(url, {0, 1}, lambda body: body["weight_version"] is None and not body["set_by_admin"])
