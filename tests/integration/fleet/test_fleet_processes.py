"""A fleet as an operator runs it, every part a real process on loopback: etcd, testkit
engines, ``sidecar-vllm --etcd-endpoints`` and ``sidecar-frontend --discovery etcd``, with HTTP
clients. Workers join and leave through etcd only; etcd going away stops nothing."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from typing import Any

import pytest

from tests.e2e_helpers import WAIT, free_port, log_lines, process, script, serving_port
from tests.etcd_fixture import EtcdServer
from tests.integration.fleet.helpers import engine_argv, sidecar_argv

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow(10)]

PROMPT = [101, 202, 303, 404]


def post_generate(url: str, max_new_tokens: int = 4) -> tuple[int, Any]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": max_new_tokens}}
    request = urllib.request.Request(
        url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def wait_ready(url: str) -> None:
    """Until /health answers 200 (a discovered worker serves); bounded."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)  # polling a real process: there is no event to wait on
    raise AssertionError("the frontend never found a serving worker")


def wait_worker_serving(frontend: subprocess.Popen[str], address: str) -> None:
    """Until the frontend logs that its worker set has ``address`` SERVING (found in etcd)."""
    seen = []
    for entry in log_lines(frontend):
        seen.append(entry.get("event"))
        if (entry.get("event"), entry.get("worker"), entry.get("state")) == (
            "worker state",
            address,
            "serving",
        ):
            return
    raise AssertionError(f"the frontend never served {address}; exit {frontend.poll()}; events {seen}")


def test_a_fleet_on_etcd_serves_through_joins_leaves_and_an_etcd_outage(etcd: EtcdServer) -> None:
    with ExitStack() as stack:
        first_engine, second_engine = free_port(), free_port()
        stack.enter_context(process(engine_argv(first_engine)))
        stack.enter_context(process(engine_argv(second_engine)))
        first = stack.enter_context(process(sidecar_argv(first_engine, etcd, "--drain-timeout-secs", "5")))
        serving_port(first)
        frontend = stack.enter_context(
            process(
                [
                    script("sidecar-frontend"),
                    "--listen",
                    "127.0.0.1:0",
                    "--log-format",
                    "json",
                    "--discovery",
                    "etcd",
                    "--etcd-endpoints",
                    etcd.endpoint,
                ]
            )
        )
        url = f"http://127.0.0.1:{serving_port(frontend)}"
        wait_ready(url)
        status, body = post_generate(url)
        assert status == 200, body
        assert len(body["output_ids"]) == 4

        # A second worker joins; the first leaves (SIGTERM: its key goes, then it drains).
        second = stack.enter_context(process(sidecar_argv(second_engine, etcd)))
        second_address = f"127.0.0.1:{serving_port(second)}"
        wait_worker_serving(frontend, second_address)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=WAIT) == 0
        # The frontend drained the first worker when its key went, before it refused work:
        # nothing is sent to the gone worker, every request lands on the second.
        for _ in range(5):
            status, body = post_generate(url)
            assert status == 200, body

        # etcd is not on the request path: with it gone the frontend keeps its last view.
        etcd.kill()
        for _ in range(3):
            status, body = post_generate(url)
            assert status == 200, body
