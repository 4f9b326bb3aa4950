"""Admission as a user runs it: ``testkit-engine``, ``sidecar-vllm`` and ``sidecar-frontend`` as
real processes on loopback. A rate limits file is read at start (a bad one stops the frontend
with its name) and again when it changes; a refusal is a 429 with ``Retry-After`` and its one
``request`` log line names the reason and the tenant; a vLLM priority is served with admission
and refused by the engine's wire without it; curl sees a full queue's 429."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_helpers import WAIT, free_port, log_lines, process
from tests.process.test_frontend_process import frontend, frontend_argv, vllm_sidecar

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow(10)]

PROMPT = [101, 202, 303, 404]
TENANT = "x-gateway-inference-fairness-id"


def post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            return response.status, dict(response.headers), json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read() or b"null")


def generate(url: str, tenant: str) -> tuple[int, dict[str, str], Any]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    return post(url + "/generate", body, {TENANT: tenant})


def until_logged(proc: subprocess.Popen[str], event: str) -> dict[str, Any]:
    """The next log line of ``event`` (the test's timeout bounds the wait)."""
    for entry in log_lines(proc):
        if entry.get("event") == event:
            return entry
    raise AssertionError(f"the frontend exited ({proc.poll()}) before logging {event!r}")


def test_the_rate_limits_file_is_enforced_and_reread_when_it_changes(tmp_path: Path) -> None:
    limits = tmp_path / "limits.toml"
    limits.write_text('[tenants."batch"]\nrequests_per_minute = 1\n')
    with ExitStack() as stack:
        port = vllm_sidecar(stack)
        proc, url = stack.enter_context(frontend(port, extra=("--rate-limits", str(limits))))
        assert generate(url, "batch")[0] == 200
        status, headers, body = generate(url, "batch")
        assert status == 429
        assert headers["x-sidecar-refused-reason"] == "rate_limited"
        assert 1 <= int(headers["Retry-After"]) <= 60
        assert body["code"] == 429
        assert "rate_limited" in body["message"]
        # Another tenant (here the default one) is not held back by batch's limit.
        assert generate(url, "")[0] == 200
        refused = next(
            e for e in iter(lambda: until_logged(proc, "request"), None) if e.get("outcome") == "refused"
        )
        assert (refused["reason"], refused["tenant"], refused["status"]) == ("RATE_LIMITED", "batch", 429)
        # The operator raises batch's limit: the frontend applies it without a restart.
        limits.write_text('[tenants."batch"]\nrequests_per_minute = 600\n')
        reloaded = until_logged(proc, "rate limits reloaded")
        assert reloaded["tenants"] == 1
        # Its bucket keeps its level across the reload and fills at the new rate (ten requests a
        # second): a client that honours Retry-After is served at its next try.
        status, headers, _ = generate(url, "batch")
        if status == 429:
            time.sleep(int(headers["Retry-After"]))
            status = generate(url, "batch")[0]
        assert status == 200


def test_a_bad_rate_limits_file_stops_the_frontend_naming_it(tmp_path: Path) -> None:
    limits = tmp_path / "limits.toml"
    limits.write_text("[default]\nrequests_per_minute = -3\n")
    with ExitStack() as stack:
        port = vllm_sidecar(stack)
        proc = stack.enter_context(process(frontend_argv(port, extra=("--rate-limits", str(limits)))))
        assert proc.wait(timeout=WAIT) == 1
        failed = [e for e in log_lines(proc) if e.get("event") == "start-up failed"]
        assert failed
        assert str(limits) in failed[0]["error"]
        assert "requests_per_minute" in failed[0]["error"]


@pytest.mark.parametrize("admission", [True, False], ids=["admission", "no-admission"])
def test_a_vllm_priority_is_served_with_admission_and_refused_by_the_wire_without(admission: bool) -> None:
    with ExitStack() as stack:
        port = vllm_sidecar(stack)
        _, url = stack.enter_context(frontend(port, extra=() if admission else ("--no-admission",)))
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}, "priority": 3}
        status, _, answer = post(url + "/inference/v1/generate", body)
        if admission:
            assert status == 200, answer
            assert len(answer["choices"][0]["token_ids"]) == 2
        else:
            assert status == 400
            assert "priority" in answer["error"]["message"]


def queued_requests(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=WAIT) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("frontend_admission_queued{")
    )


def test_curl_gets_a_full_queues_429_while_the_fleet_is_busy() -> None:
    with ExitStack() as stack:
        port = vllm_sidecar(stack, "--token-latency-ms", "20")
        metrics_port = free_port()
        flags = (
            "--worker-capacity",
            f"127.0.0.1:{port}=1",
            "--max-queue-depth",
            "1",
            "--admission-headroom",
            "0",
            "--metrics-port",
            str(metrics_port),
        )
        _, url = stack.enter_context(frontend(port, extra=flags))
        hold = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
            "stream": True,
        }
        request = urllib.request.Request(
            url + "/generate", data=json.dumps(hold).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=WAIT) as holding:
            assert holding.readline().startswith(b"data: ")  # it runs: the one slot is taken
            answered: list[int] = []
            waiting = threading.Thread(target=lambda: answered.append(generate(url, "")[0]), daemon=True)
            waiting.start()
            deadline = time.monotonic() + WAIT
            while queued_requests(metrics_port) < 1:  # a real process: polled, bounded
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.05)
            body = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
            run = subprocess.run(
                ["curl", "-s", "-i", "-H", "Content-Type: application/json", "-d", body, url + "/generate"],
                capture_output=True,
                text=True,
                timeout=WAIT,
                check=True,
            )
            head, _, payload = run.stdout.partition("\n\n")
            assert head.startswith("HTTP/1.1 429")
            lowered = head.lower()
            assert "\nretry-after: " in lowered
            assert "\nx-sidecar-refused-reason: queue_full" in lowered
            assert json.loads(payload)["code"] == 429
        # The holder's connection closed: its slot frees and the waiting request is served.
        waiting.join(timeout=WAIT)
        assert answered == [200]
