"""Bare engines registered through the membership API, as a trainer does with SMG: a testkit
SGLang HTTP engine registered by its ``http://`` URL, a testkit vLLM gRPC engine by its
``grpc://`` URL with ``engine`` ``vllm``. The frontend (a real process) runs a sidecar for each
as its child: the worker serves generations and is listed with the URL it was registered by;
the child killed is started again (counted) and the worker serves again; DELETE stops the
child; the frontend's shutdown stops its children, and so does its death (SIGKILL)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.e2e_helpers import WAIT, free_port, process, script, start, stop
from tests.process.test_membership_process import (
    call,
    serving_when_every_process_answers,
    until_metrics,
    until_serving,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow(40)]

PROMPT = [101, 202, 303, 404]
STARTED = "bare engine's sidecar started"


@dataclass
class Log:
    """The frontend's JSON log lines (its children's included: they share its stdout), read
    by a thread so that the pipe never fills."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            with self.changed:
                self.entries.append(json.loads(line))
                self.changed.notify_all()
        with self.changed:
            self.entries.append({"event": "<eof>"})
            self.changed.notify_all()

    def wait_for(self, matches: Callable[[dict[str, Any]], bool], after: int = 0) -> dict[str, Any]:
        """The first entry from index ``after`` on that ``matches`` (waits for it, bounded)."""
        deadline = time.monotonic() + WAIT
        with self.changed:
            while True:
                for entry in self.entries[after:]:
                    if matches(entry):
                        return entry
                if self.entries and self.entries[-1]["event"] == "<eof>":
                    raise AssertionError(f"the frontend's output ended first: {self.entries[-40:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no such log line within {WAIT}s: {self.entries[-40:]}")
                self.changed.wait(left)


@dataclass
class Frontend:
    proc: subprocess.Popen[str]
    url: str
    metrics: str
    log: Log


@contextmanager
def frontend(*flags: str) -> Iterator[Frontend]:
    """``sidecar-frontend`` with no worker, once it serves (with ``--processes``: every process)."""
    metrics_port = free_port()
    argv = [
        script("sidecar-frontend"),
        "--listen",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--metrics-port",
        str(metrics_port),
        "--metrics-host",
        "127.0.0.1",
        *flags,
    ]
    proc = start(argv)
    log = Log()
    reader = threading.Thread(target=log.read, args=(proc,), daemon=True)
    reader.start()
    try:
        try:
            serving = log.wait_for(
                # The parent's line, or the one process's (a process of --processes N names itself).
                lambda e: (
                    e.get("event") == "serving" and "frontend" in e.get("logger", "") and "process" not in e
                )
            )
        except AssertionError as err:
            assert proc.stderr is not None
            if proc.poll() is not None:  # it exited: its last words
                err = AssertionError(f"{err}; exit {proc.returncode}; stderr: {proc.stderr.read()[-2000:]}")
            raise err from None
        yield Frontend(proc, f"http://127.0.0.1:{serving['port']}", f"http://127.0.0.1:{metrics_port}", log)
    finally:
        stop(proc)
        reader.join(timeout=WAIT)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def until_gone(pid: int) -> None:
    deadline = time.monotonic() + WAIT
    while alive(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.05)  # another process's child: there is no event to wait on


def restarts(fe: Frontend, url: str) -> float:
    with urllib.request.urlopen(fe.metrics + "/metrics", timeout=WAIT) as response:
        text = response.read().decode()
    found = re.search(r'frontend_bare_sidecar_restarts_total\{url="' + re.escape(url) + r'"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


@dataclass(frozen=True)
class Engine:
    """A bare testkit engine: how it is started, registered and asked to generate."""

    name: str
    argv: Callable[[int], list[str]]
    body: Callable[[int], dict[str, Any]]
    generate: tuple[str, dict[str, Any]]
    sidecar_module: str


SGLANG_HTTP = Engine(
    "sglang-http",
    # Its gRPC port too: the testkit's default one would be shared by two engines.
    lambda port: [
        script("testkit-engine"),
        "sglang",
        "--http-listen",
        f"127.0.0.1:{port}",
        "--grpc-listen",
        f"127.0.0.1:{free_port()}",
    ],
    lambda port: {"url": f"http://127.0.0.1:{port}"},
    ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}),
    "sidecar_sglang",
)
VLLM_GRPC = Engine(
    "vllm-grpc",
    lambda port: [script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{port}"],
    lambda port: {"url": f"grpc://127.0.0.1:{port}", "engine": "vllm", "worker_type": "regular"},
    ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4}}),
    "sidecar_vllm",
)


def generated(fe: Frontend, engine: Engine) -> int:
    path, body = engine.generate
    status, answer = call("POST", fe.url + path, body)
    assert status == 200, answer
    tokens = answer["output_ids"] if "output_ids" in answer else answer["choices"][0]["token_ids"]
    return len(tokens)


@pytest.mark.parametrize("engine", [SGLANG_HTTP, VLLM_GRPC], ids=lambda e: e.name)
def test_a_bare_engine_serves_through_its_managed_sidecar(engine: Engine) -> None:
    with ExitStack() as stack:
        port = free_port()
        stack.enter_context(process(engine.argv(port)))
        fe = stack.enter_context(frontend())
        body = engine.body(port)
        status, accepted = call("POST", fe.url + "/workers", body)
        assert status == 202, accepted
        assert accepted["worker_id"] == str(uuid.uuid5(uuid.NAMESPACE_URL, body["url"]))
        row = until_serving(fe.url, body["url"])
        assert (row["id"], row["source"], row["engine"]) == (
            accepted["worker_id"],
            "api",
            engine.name.split("-")[0],
        )
        first = fe.log.wait_for(lambda e: e.get("event") == STARTED)
        assert first["url"] == body["url"]
        assert row["sidecar"] == f"grpc://{first['sidecar']}"
        assert first["argv"][:2] == ["-m", engine.sidecar_module]
        assert generated(fe, engine) == 4

        # The child dies: it is started again on the same port, and the worker serves again.
        seen = len(fe.log.entries)
        os.kill(first["pid"], signal.SIGKILL)
        again = fe.log.wait_for(lambda e: e.get("event") == STARTED, after=seen)
        assert again["pid"] != first["pid"]
        assert again["sidecar"] == first["sidecar"]
        assert restarts(fe, body["url"]) == 1.0
        until_serving(fe.url, body["url"])
        assert generated(fe, engine) == 4

        # DELETE: the worker drains and leaves, then its sidecar stops.
        status, deleted = call("DELETE", fe.url + f"/workers/{accepted['worker_id']}")
        assert (status, deleted["url"]) == (202, body["url"]), deleted
        fe.log.wait_for(
            lambda e: e.get("event") == "bare engine's sidecar stopped" and e["url"] == body["url"]
        )
        until_gone(again["pid"])
        _, listed = call("GET", fe.url + "/workers")
        assert listed["workers"] == []
        # Registered again, it gets a new sidecar.
        status, _ = call("POST", fe.url + "/workers", body)
        assert status == 202
        until_serving(fe.url, body["url"])


def test_the_legacy_dialect_and_the_frontends_exit_stop_the_children() -> None:
    with ExitStack() as stack:
        ports = [free_port(), free_port()]
        for port in ports:
            stack.enter_context(process(SGLANG_HTTP.argv(port)))
        urls = [f"http://127.0.0.1:{port}" for port in ports]

        # vllm-router's dialect: /add_worker answers once the worker serves.
        with frontend() as fe:
            status, text = call("POST", fe.url + f"/add_worker?url={urls[0]}")
            assert (status, text) == (200, f"Successfully added worker: {urls[0]}")
            assert generated(fe, SGLANG_HTTP) == 4
            _, listed = call("GET", fe.url + "/list_workers")
            assert listed == {"urls": [urls[0]]}
            status, text = call("POST", fe.url + f"/remove_worker?url={urls[0]}")
            assert (status, text) == (200, f"Successfully removed worker: {urls[0]}")
            child = fe.log.wait_for(lambda e: e.get("event") == STARTED)
            until_gone(child["pid"])

            # The frontend's shutdown (SIGTERM) stops the children it still runs.
            for url in urls:
                status, _ = call("POST", fe.url + "/workers", {"url": url})
                assert status == 202
            for url in urls:
                until_serving(fe.url, url)
            children = [e["pid"] for e in fe.log.entries if e.get("event") == STARTED][1:]
            assert len(children) == 2, [
                e for e in fe.log.entries if "exited" in e.get("event", "") or e.get("level") == "error"
            ]
        assert fe.proc.returncode == 0
        for pid in children:
            assert not alive(pid)

        # The frontend killed outright: its children are not left behind.
        with frontend() as fe:
            status, _ = call("POST", fe.url + "/workers", {"url": urls[1]})
            assert status == 202
            child = fe.log.wait_for(lambda e: e.get("event") == STARTED)
            until_serving(fe.url, urls[1])
            fe.proc.kill()
            fe.proc.wait(timeout=WAIT)
            until_gone(child["pid"])


def test_under_processes_the_parent_runs_one_sidecar_per_engine() -> None:
    with ExitStack() as stack:
        port = free_port()
        stack.enter_context(process(SGLANG_HTTP.argv(port)))
        fe = stack.enter_context(frontend("--processes", "2"))
        url = f"http://127.0.0.1:{port}"
        status, accepted = call("POST", fe.url + "/workers", {"url": url})
        assert status == 202, accepted
        row = until_serving(fe.url, url)
        first = fe.log.wait_for(lambda e: e.get("event") == STARTED)
        assert row["sidecar"] == f"grpc://{first['sidecar']}"
        # Each process dials the sidecar on its own; the parent's scrape says when both serve.
        until_metrics(fe.metrics + "/metrics", {"0": 1.0, "1": 1.0})
        for _ in range(8):  # each reaches one of the processes: both route to the one sidecar
            assert generated(fe, SGLANG_HTTP) == 4
        status, again = call("POST", fe.url + "/workers", {"url": url})
        assert (status, again["code"]) == (409, "WORKER_ALREADY_EXISTS")

        # Killed, the parent starts it again; the worker serves again.
        seen = len(fe.log.entries)
        os.kill(first["pid"], signal.SIGKILL)
        restarted = fe.log.wait_for(lambda e: e.get("event") == STARTED, after=seen)
        assert restarted["sidecar"] == first["sidecar"]
        assert restarts(fe, url) == 1.0
        until_serving(fe.url, url)
        until_metrics(fe.metrics + "/metrics", {"0": 1.0, "1": 1.0})
        # One sidecar for the engine, not one per process.
        assert [e["pid"] for e in fe.log.entries if e.get("event") == STARTED] == [
            first["pid"],
            restarted["pid"],
        ]

        # DELETE: every process drains it, then the parent stops the sidecar.
        status, _ = call("DELETE", fe.url + f"/workers/{accepted['worker_id']}")
        assert status == 202
        fe.log.wait_for(lambda e: e.get("event") == "bare engine's sidecar stopped")
        until_gone(restarted["pid"])
        for _ in range(4):  # whichever process answers
            _, listed = call("GET", fe.url + "/workers")
            assert listed["workers"] == []

        # vllm-router's /add_worker: once it answers, both processes serve the engine.
        status, text = call("POST", fe.url + f"/add_worker?url={url}")
        assert (status, text) == (200, f"Successfully added worker: {url}")
        assert serving_when_every_process_answers(fe.metrics + "/metrics") == {"0": 1.0, "1": 1.0}
