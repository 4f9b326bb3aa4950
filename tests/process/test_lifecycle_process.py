"""Ports an operator gets wrong, and start-up errors that must not hide: real sidecar
processes on loopback (the fake engine of test_daemon_cli, or sidecar-vllm and a testkit
engine)."""

from __future__ import annotations

import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sidecar_common.api import sidecar_pb2
from tests.process.test_daemon_cli import (
    STARTS,
    WAIT,
    _Daemon,
    _fake,
    _free_port,
    _generate,
    _json_lines,
    _run,
    _script,
    testkit_vllm,
)

__all__ = ["testkit_vllm"]  # a fixture, used by name below


def _one_error_naming(result: subprocess.CompletedProcess[str], address: str) -> dict[str, object]:
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [e for e in _json_lines(result.stdout) if e.get("level") in ("error", "critical")]
    assert len(errors) == 1, result.stdout
    assert address in str(errors[0]["error"]), errors[0]
    assert "Traceback" not in result.stdout + result.stderr
    return errors[0]


def test_a_second_sidecar_on_a_taken_listen_port_exits_1_naming_it() -> None:
    port = _free_port()
    first = _Daemon(*STARTS, "--listen", f"127.0.0.1:{port}")
    try:
        first.wait_for("serving")
        second = _run(_fake(*STARTS, "--listen", f"127.0.0.1:{port}", "--log-format", "json"))
        error = _one_error_naming(second, f"127.0.0.1:{port}")
        assert "in use" in str(error["error"])
        first.proc.send_signal(signal.SIGTERM)
        assert first.finish() == 0
    finally:
        first.finish()


def test_listen_on_the_engines_own_port_exits_1_naming_it(testkit_vllm: str) -> None:
    # The engine (a grpc server, SO_REUSEPORT on) holds the port: the sidecar must not bind
    # beside it and connect to itself.
    result = _run(
        [_script("sidecar-vllm"), "--grpc-endpoint", testkit_vllm, "--listen", testkit_vllm],
        SIDECAR_LOG_FORMAT="json",
        SIDECAR_GRPC_STARTUP_DEADLINE_SECS="20",
    )
    _one_error_naming(result, testkit_vllm)


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])


def test_a_taken_metrics_port_exits_1_naming_it(taken_port: int) -> None:
    result = _run(_fake(*STARTS, "--listen", "127.0.0.1:0", "--metrics-port", str(taken_port)))
    error = _one_error_naming(result, f"127.0.0.1:{taken_port}")
    assert "metrics" in str(error["error"])


def _scrape(host: str, port: int) -> bool:
    """True if the metrics endpoint answers at host:port; False if nothing listens there."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=WAIT) as response:
            return b"sidecar_" in response.read()
    except urllib.error.URLError as err:
        if isinstance(err.reason, ConnectionRefusedError):
            return False
        raise


@pytest.mark.parametrize(
    ("args", "env", "bound", "not_bound"),
    [
        # Metrics follow --listen by default (they used to bind every interface).
        ((), {}, "127.0.0.1", "127.0.0.2"),
        (("--metrics-host", "127.0.0.2"), {}, "127.0.0.2", "127.0.0.1"),
        ((), {"SIDECAR_METRICS_HOST": "127.0.0.2"}, "127.0.0.2", "127.0.0.1"),
    ],
    ids=["default-follows-listen", "flag", "env"],
)
def test_metrics_bind_the_host_of_listen_unless_told_otherwise(
    args: tuple[str, ...], env: dict[str, str], bound: str, not_bound: str
) -> None:
    port = _free_port()
    daemon = _Daemon(*STARTS, "--listen", "127.0.0.1:0", "--metrics-port", str(port), *args, **env)
    try:
        daemon.wait_for("serving")
        assert _scrape(bound, port)
        assert not _scrape(not_bound, port)
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.finish() == 0
    finally:
        daemon.finish()


def test_a_bad_metrics_host_is_a_usage_error() -> None:
    result = _run(_fake(*STARTS, "--metrics-host", "not a host"))
    assert result.returncode == 2
    assert "--metrics-host" in result.stderr


def test_a_bug_during_start_up_exits_1_at_once_with_its_traceback_logged_once() -> None:
    # The deadline is ten minutes: retrying the bug would outlast the test's wait.
    result = _run(
        _fake(
            "--grpc-endpoint", "127.0.0.1:1",
            "--fake-start", "bug",
            "--grpc-startup-deadline-secs", "600",
            "--listen", "127.0.0.1:0",
            "--log-format", "json",
        )
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [e for e in _json_lines(result.stdout) if e.get("level") in ("error", "critical")]
    assert len(errors) == 1, result.stdout
    assert "TypeError: unsupported operand type(s)" in str(errors[0].get("exception", ""))
    assert "CANNOT_CONNECT" not in result.stdout


def test_a_delivered_stream_ends_ok_on_a_second_sigterm_and_is_not_aborted(tmp_path: Path) -> None:
    aborts = tmp_path / "aborts.txt"
    daemon = _Daemon(
        *STARTS,
        *("--fake-tokens", "2", "--fake-hold-after-terminal", "--drain-timeout-secs", "3600"),
        *("--fake-abort-file", str(aborts)),
    )
    try:
        port = int(str(daemon.wait_for("serving")["port"]))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = _generate(channel, "finished")
            chunks = [next(stream)]
            while chunks[-1].finish_reason == sidecar_pb2.UNSPECIFIED:
                chunks.append(next(stream))
            assert chunks[-1].finish_reason == sidecar_pb2.LENGTH
            # Signalled while the sidecar still waits (drain grace, 5 s) for the engine to close.
            daemon.proc.send_signal(signal.SIGTERM)
            daemon.wait_for("stop requested")
            daemon.proc.send_signal(signal.SIGTERM)
            assert list(stream) == []  # ends OK: no error status after the whole answer
        assert daemon.finish() == 0
        assert not aborts.exists()
    finally:
        daemon.finish()
