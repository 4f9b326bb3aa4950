"""Preempt and migrate with every part a real process on loopback, on each engine kind: a
``testkit-engine`` (vLLM, or SGLang over gRPC or HTTP) running one sequence at a time, its
sidecar, and ``sidecar-frontend
--preempt-after-secs 0.2``. A long, less urgent stream runs; a more urgent request arrives and
waits past the threshold; the stream is paused (its engine request aborted), the urgent request
runs, and the stream resumes: its client sees a 200 stream with exactly the tokens and usage of
an uninterrupted run of the same request, and no error. The frontend logs the pause and the
resumption, and counts the preemption."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import aiohttp
import anyio
import pytest

from tests.e2e_helpers import WAIT, child_env, free_port, process, script, serving_port

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow(10)]

PROMPT = [101, 202, 303, 404]
MAX_TOKENS = 60


class JsonLog:
    """A process whose JSON log lines are read as they come (a full pipe would stall it), so a
    test can wait on a line."""

    def __init__(self, argv: list[str]) -> None:
        self.popen = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env()
        )
        self.lines: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            if line.startswith("{"):
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue
                with self._changed:
                    self.lines.append(entry)
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def first(self, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The first log line ``match`` accepts (waiting for it, bounded)."""
        deadline = time.monotonic() + WAIT
        with self._changed:
            while True:
                for entry in self.lines:
                    if match(entry):
                        return entry
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    events = [e.get("event") for e in self.lines[-20:]]
                    raise AssertionError(f"no such log line; exit {self.popen.poll()}; last events {events}")
                self._changed.wait(left)

    def matching(self, event: str) -> list[dict[str, Any]]:
        with self._changed:
            return [entry for entry in self.lines if entry.get("event") == event]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=WAIT)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=WAIT)
        self._reader.join(timeout=WAIT)


@contextmanager
def json_log(argv: list[str]) -> Iterator[JsonLog]:
    proc = JsonLog(argv)
    try:
        yield proc
    finally:
        proc.stop()


def engine_and_sidecar(stack: ExitStack, engine: str) -> int:
    """A testkit engine of ``engine``'s kind running one sequence at a time, and its sidecar;
    the sidecar's port."""
    if engine == "vllm":
        engine_port = free_port()
        stack.enter_context(
            process(
                [
                    script("testkit-engine"),
                    *("vllm", "--listen", f"127.0.0.1:{engine_port}"),
                    *("--max-num-seqs", "1", "--token-latency-ms", "20"),
                ]
            )
        )
        sidecar_argv = [
            script("sidecar-vllm"),
            *("--grpc-endpoint", f"127.0.0.1:{engine_port}", "--grpc-connections", "1"),
        ]
    else:
        transport = engine.removeprefix("sglang-")
        grpc_port, http_port = free_port(), free_port()
        stack.enter_context(
            process(
                [
                    script("testkit-engine"),
                    *("sglang", "--grpc-listen", f"127.0.0.1:{grpc_port}"),
                    *("--http-listen", f"127.0.0.1:{http_port}"),
                    *("--max-running-requests", "1", "--token-latency-ms", "20"),
                ]
            )
        )
        endpoint = (
            ["--http-endpoint", f"127.0.0.1:{http_port}"]
            if transport == "http"
            else ["--grpc-endpoint", f"127.0.0.1:{grpc_port}", "--grpc-connections", "1"]
        )
        sidecar_argv = [script("sidecar-sglang"), *endpoint, "--transport", transport]
    sidecar = stack.enter_context(process([*sidecar_argv, "--listen", "127.0.0.1:0", "--log-format", "json"]))
    return serving_port(sidecar)


@contextmanager
def fleet(engine: str) -> Iterator[tuple[JsonLog, str, int]]:
    """Engine, sidecar and frontend; the frontend's log, URL and metrics port."""
    with ExitStack() as stack:
        worker = engine_and_sidecar(stack, engine)
        metrics_port = free_port()
        frontend = stack.enter_context(
            json_log(
                [
                    script("sidecar-frontend"),
                    *("--listen", "127.0.0.1:0", "--log-format", "json"),
                    *("--metrics-port", str(metrics_port), "--worker", f"127.0.0.1:{worker}"),
                    *("--preempt-after-secs", "0.2"),
                ]
            )
        )
        port = int(frontend.first(lambda e: e.get("event") == "serving")["port"])
        url = f"http://127.0.0.1:{port}"
        wait_ready(url)
        yield frontend, url, metrics_port


def wait_ready(url: str) -> None:
    """Until /health answers 200 (its worker serves); bounded."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)  # polling a real process: there is no event to wait on
    raise AssertionError("the frontend never became ready")


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def body(rid: str, *, stream: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "token_ids": PROMPT,
        "request_id": rid,
        "stream": stream,
        "sampling_params": {"max_tokens": MAX_TOKENS, "ignore_eos": True, "seed": 5},
    }
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


async def stream(
    http: aiohttp.ClientSession, url: str, rid: str, started: anyio.Event | None = None
) -> tuple[int, list[int], dict[str, Any], list[Any]]:
    """A stream's status, tokens, usage and error events; ``started`` is set after 3 tokens."""
    tokens: list[int] = []
    usage: dict[str, Any] = {}
    errors: list[Any] = []
    async with http.post(url + "/inference/v1/generate", json=body(rid, stream=True)) as response:
        async for line in response.content:
            text = line.decode().rstrip("\r\n")
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            event = json.loads(text[len("data: ") :])
            if "error" in event:
                errors.append(event)
            for choice in event.get("choices", ()):
                tokens.extend(choice["token_ids"])
            usage = event.get("usage") or usage
            if started is not None and len(tokens) >= 3:
                started.set()
        return response.status, tokens, usage, errors


@pytest.mark.parametrize("engine", ["vllm", "sglang-grpc", "sglang-http"])
async def test_a_preempted_stream_resumes_token_exactly_across_real_processes(engine: str) -> None:
    with fleet(engine) as (frontend, url, metrics_port):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as http:
            reference = await stream(http, url, "ref")
            assert reference[0] == 200
            assert len(reference[1]) == MAX_TOKENS
            started = anyio.Event()
            results: dict[str, Any] = {}

            async def low() -> None:
                results["low"] = await stream(http, url, "low", started)

            async def urgent() -> None:
                async with http.post(
                    url + "/inference/v1/generate",
                    json=body("high", stream=False),
                    headers={"x-sidecar-priority": "-5"},  # vLLM's meaning: lower goes first
                ) as response:
                    results["high"] = (response.status, await response.json())

            async with anyio.create_task_group() as group:
                group.start_soon(low)
                with anyio.fail_after(WAIT):
                    await started.wait()
                group.start_soon(urgent)
        status, tokens, usage, errors = results["low"]
        assert status == 200
        assert errors == []
        assert tokens == reference[1]
        assert usage == reference[2]
        assert results["high"][0] == 200
        paused = frontend.first(lambda e: e.get("event") == "request preempted")
        assert paused["request_id"].endswith("low")
        assert (paused["urgency"], paused["waiting_urgency"]) == (0, 5)
        assert 3 <= paused["delivered_tokens"] < MAX_TOKENS
        resumed = frontend.first(lambda e: e.get("event") == "request resumed")
        assert resumed["request_id"] == paused["request_id"]
        assert resumed["waited_secs"] > 0
        assert len(frontend.matching("request preempted")) == 1
        samples = scrape(metrics_port)
        preempted = [v for k, v in samples.items() if k.startswith("frontend_admission_preemptions_total")]
        assert preempted == [1.0]
        failures = [v for k, v in samples.items() if k.startswith("frontend_worker_failures_total")]
        assert sum(failures) == 0
