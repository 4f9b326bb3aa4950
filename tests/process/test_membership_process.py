"""The membership API as a trainer uses it: ``sidecar-frontend`` started with no worker, a
testkit vLLM engine and its ``sidecar-vllm`` as real processes, the sidecar registered with
curl (``POST /workers``, bearer token from the variable) and with urllib (the legacy
``/add_worker``), generations through it, its removal; ``--admin-listen``; with
``--processes 2`` a registration taken by either process reaches both, and a process killed
and restarted by the parent still holds it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest

from tests.e2e_helpers import WAIT, free_port, log_lines, process, script, serving_port

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow(30)]

PROMPT = [101, 202, 303, 404]
TOKEN = "process-test-token"


def sidecar(stack: ExitStack) -> int:
    """A testkit vLLM engine and its sidecar, as processes; the sidecar's port."""
    engine_port = free_port()
    stack.enter_context(process([script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{engine_port}"]))
    proc = stack.enter_context(
        process(
            [
                script("sidecar-vllm"),
                "--grpc-endpoint",
                f"127.0.0.1:{engine_port}",
                "--listen",
                "127.0.0.1:0",
                "--grpc-connections",
                "1",
                "--grpc-retry-interval-secs",
                "0.2",
                "--log-format",
                "json",
            ]
        )
    )
    return serving_port(proc)


@contextmanager
def frontend(
    *flags: str, env: dict[str, str] | None = None, seen: list[dict[str, Any]] | None = None
) -> Iterator[tuple[str, str]]:
    """``sidecar-frontend`` with no worker, once it serves (with ``--processes``: every
    process): (its URL, its admin URL). ``seen``: gets the log lines read until then."""
    argv = [script("sidecar-frontend"), "--listen", "127.0.0.1:0", "--log-format", "json", *flags]
    seen = seen if seen is not None else []
    with process(argv, env) as proc:
        admin_port: int | None = None
        for entry in log_lines(proc):
            seen.append(entry)
            if entry.get("event") == "admin endpoint up":
                admin_port = int(entry["port"])
            # The parent's line, or the one process's (a process of --processes N names itself).
            if entry.get("event") == "serving" and "process" not in entry:
                url = f"http://127.0.0.1:{entry['port']}"
                yield url, f"http://127.0.0.1:{admin_port}" if admin_port is not None else url
                return
        raise AssertionError(f"the frontend never served; exit {proc.poll()}; log: {seen}")


def call(method: str, url: str, body: object = None, token: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def until_serving(admin: str, worker_url: str, token: str | None = None) -> dict[str, Any]:
    """GET /workers until the worker serves (bounded); its row."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        _, listed = call("GET", admin + "/workers", token=token)
        rows = [row for row in listed["workers"] if row["url"] == worker_url]
        if rows and rows[0]["state"] == "serving":
            return dict(rows[0])
        time.sleep(0.05)  # polling a real process: there is no event to wait on
    raise AssertionError(f"{worker_url} never served: {listed}")


def test_a_sidecar_registered_with_curl_serves_and_leaves() -> None:
    with ExitStack() as stack:
        port = sidecar(stack)
        url, admin = stack.enter_context(frontend(env={"SIDECAR_FRONTEND_ADMIN_TOKEN": TOKEN}))
        worker_url = f"grpc://127.0.0.1:{port}"
        body = json.dumps({"url": worker_url, "worker_type": "regular"})
        run = subprocess.run(
            ["curl", "-sSf", "-H", f"Authorization: Bearer {TOKEN}", "-H", "Content-Type: application/json",
             "-d", body, admin + "/workers"],
            capture_output=True, text=True, timeout=WAIT, check=True,
        )  # fmt: skip
        accepted = json.loads(run.stdout)
        assert accepted["status"] == "accepted"
        row = until_serving(admin, worker_url, TOKEN)
        assert (row["id"], row["model"], row["source"]) == (accepted["worker_id"], "testkit-model", "api")

        status, answer = call(
            "POST",
            url + "/inference/v1/generate",
            {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4}},
        )
        assert status == 200
        assert len(answer["choices"][0]["token_ids"]) == 4
        # Without the token: 401, and nothing changes.
        status, refused = call("DELETE", admin + f"/workers/{accepted['worker_id']}")
        assert (status, refused["code"]) == (401, "UNAUTHORIZED")
        status, deleted = call("DELETE", admin + f"/workers/{accepted['worker_id']}", token=TOKEN)
        assert (status, deleted["status"]) == (202, "accepted")
        status, _ = call(
            "POST", url + "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        )
        assert status == 503, "its only worker is gone"


def test_the_legacy_add_on_an_admin_port_of_its_own() -> None:
    with ExitStack() as stack:
        port = sidecar(stack)
        url, admin = stack.enter_context(frontend("--admin-listen", "127.0.0.1:0"))
        assert admin != url
        worker_url = f"grpc://127.0.0.1:{port}"
        # On the HTTP port the admin paths are not served: the format's 404.
        status, _ = call("GET", url + "/list_workers")
        assert status == 404
        status, text = call("POST", admin + f"/add_worker?url={worker_url}")
        assert (status, text) == (200, f"Successfully added worker: {worker_url}")
        assert call("GET", admin + "/list_workers") == (200, {"urls": [worker_url]})
        status, answer = call(
            "POST", url + "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}
        )
        assert status == 200
        assert len(answer["output_ids"]) == 3
        status, text = call("POST", admin + f"/remove_worker?url={worker_url}")
        assert (status, text) == (200, f"Successfully removed worker: {worker_url}")


def _scrape(metrics_url: str) -> str:
    with urllib.request.urlopen(metrics_url, timeout=WAIT) as response:
        return str(response.read().decode())


def _serving_in(text: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for process_label, value in re.findall(
        r'^frontend_workers\{process="(\d+)",role="agg",state="serving"\} (\S+)$', text, re.M
    ):
        found[process_label] = float(value)
    return found


def serving_by_process(metrics_url: str) -> dict[str, float]:
    """Each process's serving workers, from the parent's merged scrape."""
    return _serving_in(_scrape(metrics_url))


def serving_when_every_process_answers(metrics_url: str, processes: int = 2) -> dict[str, float]:
    """:func:`serving_by_process` from the first scrape every process answered (the parent
    leaves out one that did not answer within its bound; bounded)."""
    deadline = time.monotonic() + WAIT
    while True:
        text = _scrape(metrics_url)
        up = re.findall(r'^frontend_process_up\{process="(\d+)"\} 1\.0$', text, re.M)
        if len(set(up)) == processes:
            return _serving_in(text)
        assert time.monotonic() < deadline, f"not every process answered the scrape: {up}"
        time.sleep(0.1)  # polling a real process: there is no event to wait on


def until_metrics(metrics_url: str, expected: dict[str, float]) -> None:
    """Until both processes report ``expected`` serving workers (bounded)."""
    deadline = time.monotonic() + WAIT
    found: dict[str, float] = {}
    while time.monotonic() < deadline:
        found = serving_by_process(metrics_url)
        if all(found.get(p, 0.0) == n for p, n in expected.items()):
            return
        time.sleep(0.1)  # polling a real process: there is no event to wait on
    raise AssertionError(f"serving workers by process: {found}, expected {expected}")


def test_with_two_processes_a_registration_reaches_both_and_survives_a_restart() -> None:
    with ExitStack() as stack:
        port = sidecar(stack)
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
        worker_url = f"grpc://127.0.0.1:{port}"
        status, accepted = call("POST", url + "/workers", {"url": worker_url})
        assert status == 202
        until_metrics(metrics, {"0": 1.0, "1": 1.0})
        vllm_body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
        # Each call a new connection, spread by the kernel over both processes: all served.
        for _ in range(12):
            assert call("POST", url + "/inference/v1/generate", vllm_body)[0] == 200
        status, again = call("POST", url + "/workers", {"url": worker_url})
        assert (status, again["code"]) == (409, "WORKER_ALREADY_EXISTS")

        # A process killed outright is restarted by the parent, with the registration.
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            with urllib.request.urlopen(metrics, timeout=WAIT) as response:
                if 'frontend_process_restarts_total{process="0"} 1.0' in response.read().decode():
                    break
            time.sleep(0.1)  # polling a real process: there is no event to wait on
        until_metrics(metrics, {"0": 1.0, "1": 1.0})

        status, deleted = call("DELETE", url + f"/workers/{accepted['worker_id']}")
        assert status == 202, deleted
        until_metrics(metrics, {"0": 0.0, "1": 0.0})
        for _ in range(6):
            assert call("POST", url + "/inference/v1/generate", vllm_body)[0] == 503


def test_with_two_processes_add_worker_answers_once_both_serve() -> None:
    """A trainer's ``/add_worker`` then its requests: once the call answers, every process
    serves the worker, so no request sent after it meets a process still connecting."""
    with ExitStack() as stack:
        port = sidecar(stack)
        metrics_port = free_port()
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        url, _ = stack.enter_context(frontend("--processes", "2", "--metrics-port", str(metrics_port)))
        worker_url = f"grpc://127.0.0.1:{port}"
        status, text = call("POST", url + f"/add_worker?url={worker_url}")
        assert (status, text) == (200, f"Successfully added worker: {worker_url}")
        # Right after the answer (the first scrape both answer): both processes serve it.
        assert serving_when_every_process_answers(metrics) == {"0": 1.0, "1": 1.0}
        vllm_body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
        for _ in range(12):  # each call a new connection, spread over both processes
            assert call("POST", url + "/inference/v1/generate", vllm_body)[0] == 200
        status, text = call("POST", url + f"/remove_worker?url={worker_url}")
        assert (status, text) == (200, f"Successfully removed worker: {worker_url}")
