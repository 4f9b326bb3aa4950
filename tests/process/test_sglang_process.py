"""The SGLang sidecar as a user runs it: ``testkit-engine sglang`` and ``sidecar-sglang`` as
subprocesses through their console scripts, one streaming generation per transport."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import pytest

from sidecar_common.api import sidecar_pb2
from tests.e2e_helpers import ROOT, WAIT, child_env, free_port, generate_six, process, script, serving_port

pytestmark = pytest.mark.timeout(90)


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


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_one_streaming_generation_through_the_console_scripts(transport: str) -> None:
    grpc_port, http_port = free_port(), free_port()
    engine_argv = [
        script("testkit-engine"),
        "sglang",
        "--grpc-listen",
        f"127.0.0.1:{grpc_port}",
        "--http-listen",
        f"127.0.0.1:{http_port}",
    ]
    sidecar_argv = [
        script("sidecar-sglang"),
        "--listen",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--transport",
        transport,
    ]
    if transport == "http":
        sidecar_argv += ["--http-endpoint", f"http://127.0.0.1:{http_port}"]
    else:
        sidecar_argv += ["--grpc-endpoint", f"127.0.0.1:{grpc_port}"]
    with process(engine_argv) as engine:
        _wait_for_port(grpc_port if transport == "grpc" else http_port, engine)
        with process(sidecar_argv) as sidecar:
            outs = generate_six(serving_port(sidecar))
            assert sum(len(o.token_ids) for o in outs) == 6
            assert [o.finish_reason for o in outs][-1] == sidecar_pb2.LENGTH
            assert outs[-1].completion_usage.completion_tokens == 6
            sidecar.send_signal(signal.SIGTERM)
            assert sidecar.wait(timeout=WAIT) == 0


def test_http_transport_without_http_endpoint_is_a_usage_error() -> None:
    result = subprocess.run(
        [script("sidecar-sglang"), "--transport", "http"],
        capture_output=True,
        text=True,
        timeout=WAIT,
        cwd=ROOT,
        env=child_env(),
        check=False,
    )
    assert result.returncode == 2
    assert "--http-endpoint" in result.stdout + result.stderr
