"""The SGLang sidecar as a user runs it: ``testkit-engine sglang`` and ``sidecar-sglang`` as
subprocesses through their console scripts, one streaming generation per transport."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
WAIT = 30.0


def _script(name: str) -> str:
    path = BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"console script {name} is not installed"
    return found


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_") and k != "NOTIFY_SOCKET"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_for_port(port: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the engine exited during start-up"
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


@contextmanager
def _process(argv: Sequence[str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env()
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=WAIT)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _serving_port(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    deadline = time.monotonic() + WAIT
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("event") == "serving":
                return int(entry["port"])
    raise AssertionError(f"the sidecar never served; output: {seen}")


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_one_streaming_generation_through_the_console_scripts(transport: str) -> None:
    grpc_port, http_port = _free_port(), _free_port()
    engine_argv = [
        _script("testkit-engine"),
        "sglang",
        "--grpc-listen",
        f"127.0.0.1:{grpc_port}",
        "--http-listen",
        f"127.0.0.1:{http_port}",
    ]
    sidecar_argv = [
        _script("sidecar-sglang"),
        "--grpc-endpoint",
        f"127.0.0.1:{grpc_port}",
        "--listen",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--transport",
        transport,
    ]
    if transport == "http":
        sidecar_argv += ["--http-endpoint", f"http://127.0.0.1:{http_port}"]
    with _process(engine_argv) as engine:
        _wait_for_port(grpc_port if transport == "grpc" else http_port, engine)
        with _process(sidecar_argv) as sidecar:
            port = _serving_port(sidecar)
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = sidecar_pb2_grpc.WorkerStub(channel)
                request = sidecar_pb2.PreprocessedRequest(request_id="proc", token_ids=[101, 202, 303, 404])
                request.stop_conditions.max_tokens = 6
                outs = list(stub.Generate(request, timeout=WAIT))
            assert sum(len(o.token_ids) for o in outs) == 6
            assert [o.finish_reason for o in outs][-1] == sidecar_pb2.LENGTH
            assert outs[-1].completion_usage.completion_tokens == 6
            sidecar.send_signal(signal.SIGTERM)
            assert sidecar.wait(timeout=WAIT) == 0


def test_http_transport_without_http_endpoint_is_a_usage_error() -> None:
    result = subprocess.run(
        [_script("sidecar-sglang"), "--grpc-endpoint", "127.0.0.1:1", "--transport", "http"],
        capture_output=True,
        text=True,
        timeout=WAIT,
        cwd=ROOT,
        env=_env(),
        check=False,
    )
    assert result.returncode == 2
    assert "--http-endpoint" in result.stdout + result.stderr
