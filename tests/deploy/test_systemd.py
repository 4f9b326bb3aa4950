"""The sidecar under systemd's notify protocol, as a real process against a testkit engine:
``WATCHDOG=1`` pings at half of ``$WATCHDOG_USEC`` from the event loop, and a ``STATUS=``
line when the engine goes down. systemd is played by a datagram socket in the test."""

from __future__ import annotations

import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar_server import systemd
from tests.e2e_helpers import ROOT, WAIT, child_env, free_port, script


@pytest.mark.parametrize(
    ("environ", "period"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "4242"}, 0.5),
        ({}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        # Inherited from a parent the watchdog is for: not ours to feed.
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "me"}, None),
    ],
)
def test_watchdog_period_is_half_what_systemd_gives_this_process(
    environ: dict[str, str], period: float | None
) -> None:
    assert systemd.watchdog_period(environ, pid=4242) == period


@pytest.fixture
def systemd_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """What systemd listens on: a datagram socket; every receive is bounded by WAIT."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.settimeout(WAIT)
    try:
        yield sock, path
    finally:
        sock.close()


def _stop(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=WAIT)


def test_watchdog_pings_and_status_when_the_engine_goes_down(
    systemd_socket: tuple[socket.socket, str],
) -> None:
    sock, path = systemd_socket
    engine_port = free_port()
    engine = subprocess.Popen(
        [script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{engine_port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=child_env(),
    )
    env = child_env()
    env.update(
        NOTIFY_SOCKET=path,
        # systemd sets both for the unit's main process: 1 s, so a ping every 0.5 s.
        WATCHDOG_USEC="1000000",
        SIDECAR_GRPC_ENDPOINT=f"127.0.0.1:{engine_port}",
        SIDECAR_LISTEN="127.0.0.1:0",
        SIDECAR_GRPC_CONNECTIONS="2",
        SIDECAR_GRPC_STARTUP_DEADLINE_SECS=str(WAIT),
        SIDECAR_LOG_FORMAT="json",
    )
    sidecar = subprocess.Popen(
        [script("sidecar"), "vllm"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        messages: list[str] = []

        def receive_until(wanted: str) -> None:
            while not any(wanted in m for m in messages):
                messages.append(sock.recv(4096).decode())

        receive_until("READY=1")
        ready_at = next(i for i, m in enumerate(messages) if "READY=1" in m)
        # Fed from the start (systemd's clock may run while the engine loads) ...
        assert "WATCHDOG=1" in messages[:ready_at]
        # ... and on, while serving.
        while messages[ready_at:].count("WATCHDOG=1") < 2:
            messages.append(sock.recv(4096).decode())
        assert "engine down" not in "".join(messages)

        assert _stop(engine) == 0
        receive_until("STATUS=engine down")
        (down,) = [m for m in messages if m.startswith("STATUS=engine down")]
        assert f"vllm engine at 127.0.0.1:{engine_port}" in down
        # Still fed while the engine is away: an outage is no reason for systemd to restart.
        after = len(messages)
        while messages[after:].count("WATCHDOG=1") < 2:
            messages.append(sock.recv(4096).decode())

        assert _stop(sidecar) == 0
        receive_until("STOPPING=1")
    finally:
        _stop(sidecar)
        _stop(engine)
