"""The frontend as a user runs it: ``testkit-engine``, ``sidecar-vllm`` / ``sidecar-sglang``
and ``sidecar-frontend`` as real processes on loopback, with curl and aiohttp as clients."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest

from tests.e2e_helpers import ROOT, WAIT, free_port, log_lines, process, script, serving_port

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow(12)]

PROMPT = [101, 202, 303, 404]


def vllm_sidecar(stack: ExitStack, *engine_flags: str, sidecar_flags: tuple[str, ...] = ()) -> int:
    """A testkit vLLM engine and its sidecar; the sidecar's port."""
    engine_port = free_port()
    stack.enter_context(
        process([script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{engine_port}", *engine_flags])
    )
    sidecar = stack.enter_context(
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
                *sidecar_flags,
            ]
        )
    )
    return serving_port(sidecar)


def sglang_sidecar(stack: ExitStack, transport: str) -> int:
    grpc_port, http_port = free_port(), free_port()
    stack.enter_context(
        process(
            [
                script("testkit-engine"),
                "sglang",
                "--grpc-listen",
                f"127.0.0.1:{grpc_port}",
                "--http-listen",
                f"127.0.0.1:{http_port}",
            ]
        )
    )
    sidecar = stack.enter_context(
        process(
            [
                script("sidecar-sglang"),
                *(
                    ["--http-endpoint", f"127.0.0.1:{http_port}"]
                    if transport == "http"
                    else ["--grpc-endpoint", f"127.0.0.1:{grpc_port}", "--grpc-connections", "1"]
                ),
                "--transport",
                transport,
                "--listen",
                "127.0.0.1:0",
                "--log-format",
                "json",
            ]
        )
    )
    return serving_port(sidecar)


def frontend_argv(*workers: int, extra: tuple[str, ...] = ()) -> list[str]:
    argv = [script("sidecar-frontend"), "--listen", "127.0.0.1:0", "--log-format", "json", *extra]
    for port in workers:
        argv += ["--worker", f"127.0.0.1:{port}"]
    return argv


def wait_ready(url: str) -> None:
    """Until /health answers 200 (a worker serves); bounded."""
    import time

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


@contextmanager
def frontend(*workers: int, extra: tuple[str, ...] = ()) -> Iterator[tuple[subprocess.Popen[str], str]]:
    with process(frontend_argv(*workers, extra=extra)) as proc:
        url = f"http://127.0.0.1:{serving_port(proc)}"
        wait_ready(url)
        yield proc, url


def post_json(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


@pytest.fixture(scope="module")
def vllm_frontend() -> Iterator[tuple[str, int]]:
    """One engine, sidecar and frontend (with metrics) shared by the read-only tests."""
    with ExitStack() as stack:
        port = vllm_sidecar(stack)
        metrics_port = free_port()
        _, url = stack.enter_context(frontend(port, extra=("--metrics-port", str(metrics_port))))
        yield url, metrics_port


def test_curl_streams_sglang_generate_through_frontend_sidecar_and_engine(
    vllm_frontend: tuple[str, int],
) -> None:
    url, _ = vllm_frontend
    body = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}, "stream": True})
    run = subprocess.run(
        ["curl", "-sN", "-H", "Content-Type: application/json", "-d", body, url + "/generate"],
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=True,
    )
    events = [line[len("data: ") :] for line in run.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert len(last["output_ids"]) == 5
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert run.stdout.endswith("data: [DONE]\n\n")


def test_metrics_port_serves_the_frontends_metrics(vllm_frontend: tuple[str, int]) -> None:
    url, metrics_port = vllm_frontend
    status, _ = post_json(url + "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=WAIT) as response:
        text = response.read().decode()
    assert 'frontend_requests_total{format="sglang",outcome="ok",reason="NONE"}' in text
    assert "frontend_time_to_first_token_seconds_bucket" in text


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_vllm_format_over_sidecar_sglang(transport: str) -> None:
    with ExitStack() as stack:
        port = sglang_sidecar(stack, transport)
        _, url = stack.enter_context(frontend(port))
        status, body = post_json(
            url + "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4}}
        )
        assert status == 200
        assert len(body["choices"][0]["token_ids"]) == 4
        assert body["choices"][0]["finish_reason"] == "length"


def test_sigterm_lets_an_in_flight_stream_finish_then_exits_zero() -> None:
    with ExitStack() as stack:
        port = vllm_sidecar(stack, "--token-latency-ms", "20")
        proc, url = stack.enter_context(frontend(port))
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40}, "stream": True}
        request = urllib.request.Request(
            url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            first = response.readline()
            assert first.startswith(b"data: ")
            proc.send_signal(signal.SIGTERM)
            rest = response.read().decode()
        events = [line[len("data: ") :] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["meta_info"]["finish_reason"]["type"] == "length"
        assert proc.wait(timeout=WAIT) == 0
        entries = list(log_lines(proc))
        assert entries[-1]["event"] == "stopped"
        # One info line per request, with what an operator needs.
        lines = [e for e in entries if e.get("event") == "request"]
        assert len(lines) == 1
        assert lines[0]["level"] == "info"
        assert lines[0]["format"] == "sglang"
        assert (lines[0]["outcome"], lines[0]["status"], lines[0]["completion_tokens"]) == ("ok", 200, 40)


def test_usage_errors_name_the_flag_and_the_variable_mirrors_the_flag() -> None:
    # No --worker is no error: workers may come through the membership API (docs/rl.md).
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env["PYTHONPATH"] = str(ROOT)
    spaced = subprocess.run(
        [script("sidecar-frontend"), "--admin-token", "two words"],
        capture_output=True,
        text=True,
        timeout=WAIT,
        env=env,
        check=False,
    )
    assert spaced.returncode == 2
    assert "--admin-token" in spaced.stderr
    assert "two words" not in spaced.stderr, "a refused token is not echoed"
    env["SIDECAR_FRONTEND_REQUEST_TIMEOUT_SECS"] = "soon"
    bad = subprocess.run(
        [script("sidecar-frontend"), "--worker", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=WAIT,
        env=env,
        check=False,
    )
    assert bad.returncode == 2
    assert "SIDECAR_FRONTEND_REQUEST_TIMEOUT_SECS" in bad.stderr


def test_sidecar_frontend_subcommand_is_the_same_command_line() -> None:
    run = subprocess.run(
        [script("sidecar"), "frontend", "--help"], capture_output=True, text=True, timeout=WAIT, check=False
    )
    assert run.returncode == 0
    assert "sidecar frontend" in run.stdout
    assert "SIDECAR_FRONTEND_WORKER" in run.stdout
    module = subprocess.run(
        [sys.executable, "-m", "sidecar_frontend", "--version"],
        capture_output=True,
        text=True,
        timeout=WAIT,
        cwd=ROOT,
        check=False,
    )
    assert module.returncode == 0


def test_a_listen_port_in_use_is_a_start_up_failure() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        argv = [script("sidecar-frontend"), "--listen", f"127.0.0.1:{taken}", "--worker", "127.0.0.1:1"]
        with process([*argv, "--log-format", "json"]) as proc:
            assert proc.wait(timeout=WAIT) == 1
            assert any(e.get("event") == "start-up failed" for e in log_lines(proc))


def test_a_decode_sidecar_given_as_an_aggregated_worker_is_refused_in_one_line_and_clients_get_503() -> None:
    """The operator's mistake: ``--prefill-worker P --worker D`` with D a decode sidecar."""
    with ExitStack() as stack:
        prefill = vllm_sidecar(
            stack, "--kv-role", "kv_producer", sidecar_flags=("--disaggregation-mode", "prefill")
        )
        decode = vllm_sidecar(
            stack, "--kv-role", "kv_consumer", sidecar_flags=("--disaggregation-mode", "decode")
        )
        argv = frontend_argv(
            extra=("--prefill-worker", f"127.0.0.1:{prefill}", "--worker", f"127.0.0.1:{decode}")
        )
        proc = stack.enter_context(process(argv))
        url = f"http://127.0.0.1:{serving_port(proc)}"
        refused = next(e for e in log_lines(proc) if e.get("event") == "worker refused")
        assert (refused["level"], refused["worker"], refused["reason"]) == (
            "error",
            f"127.0.0.1:{decode}",
            "role",
        )
        assert "--worker decode=127.0.0.1:" in refused["error"]
        for path, body in (
            ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}),
            ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}),
        ):
            status, answer = post_json(url + path, body)
            assert status == 503, answer
            assert "the fleet is misconfigured" in json.dumps(answer)
