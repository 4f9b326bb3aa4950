"""A real etcd server for the fleet tests: one member on loopback, free ports, a temporary
data directory. It can be stopped and started again on the same ports and data (leases and
keys survive, as with a real restart), or killed.

A missing ``etcd`` binary fails the tests that need it, naming the fix: these tests are part
of the suite, not optional extras.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e_helpers import WAIT, free_port

__all__ = ["EtcdServer", "etcd_binary", "running_etcd"]


def etcd_binary() -> str:
    found = shutil.which("etcd")
    if found is None:
        pytest.fail(
            "the fleet tests need a real etcd server and `etcd` is not on PATH: run `make setup` "
            "(scripts/ensure_system_tools.sh installs Debian's etcd-server package)",
            pytrace=False,
        )
    return found


class EtcdServer:
    def __init__(self, data_dir: Path) -> None:
        self.binary = etcd_binary()
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"etcd-{self.client_port}.log"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def argv(self) -> list[str]:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            "--name=test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-level=warn",
        ]

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "etcd already running"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        # etcd has no readiness signal but its /health endpoint: ask it, bounded.
        url = f"http://127.0.0.1:{self.client_port}/health"
        deadline = time.monotonic() + WAIT
        last = ""
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"etcd exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as reply:
                    body = reply.read().decode()
                if '"health":"true"' in body.replace(" ", ""):
                    return
                last = body
            except (OSError, urllib.error.URLError) as err:
                last = repr(err)
            time.sleep(0.05)
        raise AssertionError(f"etcd not healthy within {WAIT}s ({last}): {self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM and wait: a clean shutdown, as an operator restarting etcd does."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        self._end(signal.SIGKILL)

    def _end(self, signum: signal.Signals) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signum)
        try:
            proc.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=WAIT)

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def running_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """Generator body for a fixture: a started server, stopped afterwards."""
    server = EtcdServer(tmp_path / "etcd-data")
    server.start()
    try:
        yield server
    finally:
        server.kill()
