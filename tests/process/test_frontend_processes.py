"""``sidecar-frontend --processes 2`` as a user runs it: a testkit engine, ``sidecar-vllm`` and
the frontend as real processes on loopback. Requests are spread over both processes (the
merged ``/metrics`` says which process served each); SIGTERM to the parent lets the streams in
flight on both finish, then it exits 0; a killed process, or one whose event loop stops, is
replaced while the other serves on."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from http.client import HTTPResponse
from typing import Any

import pytest

from tests.e2e_helpers import WAIT, free_port, process
from tests.process.test_frontend_process import PROMPT, frontend_argv, post_json, vllm_sidecar, wait_ready

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow(20)]


class Logs:
    """The JSON lines of the parent and its processes (one stdout), read as they come: the
    processes' request lines must never fill the pipe while a test waits on something else."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        with_closed_pipe = (ValueError, OSError)
        try:
            for line in proc.stdout:
                if line.startswith("{"):
                    self.lines.put(json.loads(line))
        except with_closed_pipe:
            pass
        self.lines.put(None)

    def until(self, wanted: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        """The next line ``wanted`` accepts (bounded by WAIT)."""
        deadline = time.monotonic() + WAIT
        while (left := deadline - time.monotonic()) > 0:
            try:
                entry = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if entry is None:
                raise AssertionError(f"the output ended before {what}")
            self.seen.append(entry)
            if wanted(entry):
                return entry
        raise AssertionError(f"no {what} within {WAIT} s")

    def rest(self) -> list[dict[str, Any]]:
        """Every line up to the end of the output (once the processes have exited)."""
        while (entry := self.lines.get(timeout=WAIT)) is not None:
            self.seen.append(entry)
        return self.seen


def event(name: str, **fields: Any) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e.get("event") == name and all(e.get(k) == v for k, v in fields.items())


@contextmanager
def processes(
    sidecar_port: int, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], Logs, str, int]]:
    metrics_port = free_port()
    extra = ("--processes", "2", "--metrics-port", str(metrics_port))
    with process(frontend_argv(sidecar_port, extra=extra), env) as proc:
        logs = Logs(proc)
        serving = logs.until(lambda e: e.get("event") == "serving" and "processes" in e, "serving")
        assert serving["processes"] == 2
        url = f"http://127.0.0.1:{serving['port']}"
        wait_ready(url)
        yield proc, logs, url, metrics_port


def metrics(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT) as response:
        text = response.read().decode()
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        pairs = [p.split("=", 1) for p in labels.rstrip("}").split(",") if "=" in p]
        samples[(name, frozenset((k, v.strip('"')) for k, v in pairs))] = float(value)
    return samples


def by_process(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for (series, labels), value in samples.items():
        if series == name:
            process_label = dict(labels).get("process", "")
            totals[process_label] = totals.get(process_label, 0.0) + value
    return totals


def generate(url: str) -> int:
    status, body = post_json(
        url + "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    )
    assert status == 200, body
    return len(body["output_ids"])


def open_stream(url: str, tokens: int) -> HTTPResponse:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": tokens}, "stream": True}
    request = urllib.request.Request(
        url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    response: HTTPResponse = urllib.request.urlopen(request, timeout=WAIT)
    assert response.readline().startswith(b"data: ")
    return response


def finished(response: HTTPResponse, tokens: int) -> bool:
    """The rest of a stream: it ends with [DONE] after its last event of ``tokens`` outputs."""
    events = [ln[6:] for ln in response.read().decode().splitlines() if ln.startswith("data: ")]
    response.close()
    return events[-1] == "[DONE]" and len(json.loads(events[-2])["output_ids"]) == tokens


def test_requests_are_spread_over_both_processes_and_one_scrape_shows_them() -> None:
    with ExitStack() as stack:
        port = vllm_sidecar(stack)
        _, _, url, metrics_port = stack.enter_context(processes(port))
        # Each request on a new connection: the kernel spreads connections over the processes.
        for _ in range(30):
            assert generate(url) == 2
        samples = metrics(metrics_port)
        served = by_process(samples, "frontend_requests_total")
        assert set(served) == {"0", "1"}, served
        assert sum(served.values()) == 30
        assert all(count > 0 for count in served.values()), served
        assert by_process(samples, "frontend_process_up") == {"0": 1.0, "1": 1.0}
        assert by_process(samples, "frontend_process_restarts_total") == {"0": 0.0, "1": 0.0}


def test_sigterm_to_the_parent_drains_every_process_and_no_stream_is_lost() -> None:
    with ExitStack() as stack:
        port = vllm_sidecar(stack, "--token-latency-ms", "20")
        proc, logs, url, metrics_port = stack.enter_context(processes(port))
        tokens = 60
        streams: list[HTTPResponse] = []
        # Streams on new connections until both processes have some in flight (the kernel's
        # spread is random; a few suffice).
        while len(streams) < 40:
            streams.append(open_stream(url, tokens))
            inflight = by_process(metrics(metrics_port), "frontend_worker_inflight")
            if len(streams) >= 4 and inflight.get("0", 0) > 0 and inflight.get("1", 0) > 0:
                break
        assert inflight.get("0", 0) > 0, inflight
        assert inflight.get("1", 0) > 0, inflight
        proc.send_signal(signal.SIGTERM)
        logs.until(event("stop requested"), "the parent's stop")
        assert all(finished(stream, tokens) for stream in streams)
        assert proc.wait(timeout=WAIT) == 0
        entries = logs.rest()
        stopped = {e.get("process") for e in entries if e.get("event") == "stopped"}
        assert stopped == {0, 1, None}, "each process, then the parent"
        assert entries[-1]["event"] == "stopped"
        assert entries[-1]["exit_code"] == 0
        drained = [e for e in entries if e.get("event") == "request" and e.get("outcome") != "ok"]
        assert drained == []


def test_a_killed_process_is_restarted_while_the_other_serves() -> None:
    with ExitStack() as stack:
        port = vllm_sidecar(stack)
        _, logs, url, metrics_port = stack.enter_context(processes(port))
        started = {e["process"]: e["pid"] for e in logs.seen if e.get("event") == "process started"}
        os.kill(started[0], signal.SIGKILL)
        ended = logs.until(event("process ended", process=0), "process 0's end")
        assert ended["status"] == "killed by SIGKILL"
        assert ended["level"] == "error"
        again = logs.until(event("process started", process=0), "process 0's restart")
        assert again["pid"] != started[0]
        logs.until(event("serving", process=0), "process 0 serving again")
        for _ in range(10):
            assert generate(url) == 2
        samples = metrics(metrics_port)
        assert by_process(samples, "frontend_process_restarts_total") == {"0": 1.0, "1": 0.0}
        assert by_process(samples, "frontend_process_up") == {"0": 1.0, "1": 1.0}


def test_a_process_whose_loop_stops_answering_is_killed_and_replaced() -> None:
    with ExitStack() as stack:
        port = vllm_sidecar(stack)
        # Asked every second, killed after 3 questions unanswered (production: 10 s, 6): short,
        # yet long enough that a process starting on a loaded machine is not taken for wedged.
        env = {"SIDECAR_TEST_PROCESS_LIVENESS": "1.0,3"}
        _, logs, url, _ = stack.enter_context(processes(port, env))
        started = {e["process"]: e["pid"] for e in logs.seen if e.get("event") == "process started"}
        os.kill(started[1], signal.SIGSTOP)  # its event loop no longer runs
        try:
            wedged = logs.until(event("process not answering: killing it", process=1), "the kill")
            assert wedged["pid"] == started[1]
            logs.until(event("serving", process=1), "process 1 serving again")
        finally:
            with suppress(ProcessLookupError):
                os.kill(started[1], signal.SIGKILL)
        for _ in range(10):
            assert generate(url) == 2
