"""The vLLM sidecar as a user runs it: ``testkit-engine vllm`` and ``sidecar-vllm`` as real
processes through their console scripts, talking over loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from tests.e2e_helpers import ROOT, WAIT, free_port, generate_six, log_lines, process, script, serving_port

pytestmark = pytest.mark.timeout(90)


def engine_argv(port: int) -> list[str]:
    return [script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{port}"]


def sidecar_argv(engine_port: int, deadline: float) -> list[str]:
    return [
        script("sidecar-vllm"),
        "--grpc-endpoint",
        f"127.0.0.1:{engine_port}",
        "--listen",
        "127.0.0.1:0",
        "--grpc-connections",
        "2",
        "--grpc-startup-deadline-secs",
        str(deadline),
        "--grpc-retry-interval-secs",
        "0.2",
        "--log-format",
        "json",
    ]


def test_streaming_generation_through_the_console_scripts() -> None:
    engine_port = free_port()
    with process(engine_argv(engine_port)), process(sidecar_argv(engine_port, deadline=WAIT)) as sidecar:
        port = serving_port(sidecar)
        outs = generate_six(port)
        assert sum(len(o.token_ids) for o in outs) == 6
        assert outs[-1].finish_reason == sidecar_pb2.LENGTH
        usage = outs[-1].completion_usage
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (4, 6, 10)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = sidecar_pb2_grpc.WorkerStub(channel).GetModelInfo(
                sidecar_pb2.GetModelInfoRequest(), timeout=WAIT
            )
        assert info.engine == "vllm"
        assert info.served_model_name == "testkit-model"
        sidecar.send_signal(signal.SIGTERM)
        assert sidecar.wait(timeout=WAIT) == 0


def test_engine_started_after_the_sidecar_within_the_deadline_is_reached() -> None:
    engine_port = free_port()
    with process(sidecar_argv(engine_port, deadline=WAIT)) as sidecar:
        # The sidecar is retrying against a closed port by now.
        time.sleep(1.0)
        assert sidecar.poll() is None
        with process(engine_argv(engine_port)):
            port = serving_port(sidecar)
            outs = generate_six(port)
            assert sum(len(o.token_ids) for o in outs) == 6


def test_no_engine_by_the_deadline_is_a_clear_start_up_error() -> None:
    engine_port = free_port()
    with process(sidecar_argv(engine_port, deadline=1.0)) as sidecar:
        code = sidecar.wait(timeout=WAIT)
        assert code != 0
        failures = [e for e in log_lines(sidecar) if e.get("event") == "start-up failed"]
        assert len(failures) == 1
        error = failures[0]["error"]
        assert f"127.0.0.1:{engine_port}" in error
        assert "startup deadline 1s" in error


def test_python_dash_m_runs_the_same_command_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, "-m", "sidecar_vllm", "--grpc-endpoint", "https://secure:1"],
        capture_output=True,
        text=True,
        timeout=WAIT,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert run.returncode == 2, "a TLS endpoint is a usage error, before any network I/O"
    assert "--grpc-endpoint" in run.stderr
