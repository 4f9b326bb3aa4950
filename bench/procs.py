"""Starting, pinning, waiting for and stopping the benchmark's processes."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["LoadGen", "Proc", "free_port", "pin_prefix", "wait_grpc_ready", "wait_http_ready"]

LOG_DIR = Path(os.environ.get("BENCH_LOG_DIR", "/tmp/bench-logs"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def pin_prefix(core: int | None) -> list[str]:
    """`taskset -c N` when pinning is possible (2+ cores and taskset present), else nothing."""
    if core is None or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", str(core)]


@dataclass
class Proc:
    """One child process, its log file under LOG_DIR, stopped with SIGTERM then SIGKILL."""

    name: str
    argv: list[str]
    core: int | None
    popen: subprocess.Popen[bytes] | None = None
    log_path: Path = field(default_factory=Path)

    def start(self) -> Proc:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{self.name}.log"
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [*pin_prefix(self.core), *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        # taskset execs the command, so the child's pid is the measured process's pid.
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, grace: float = 3.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(2.0)


def wait_grpc_ready(proc: Proc, address: str, deadline_s: float) -> None:
    """Wait until grpc.health.v1 says SERVING (UNIMPLEMENTED counts as up: the port answers)."""
    end = time.monotonic() + deadline_s
    last = "not tried"
    while time.monotonic() < end:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited early:\n{proc.log_tail()}")
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return
                last = err.code().name
        time.sleep(0.1)
    raise RuntimeError(
        f"{proc.name} at {address} not ready after {deadline_s:.0f}s ({last}):\n{proc.log_tail()}"
    )


def wait_http_ready(proc: Proc, url: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    last = "not tried"
    while time.monotonic() < end:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited early:\n{proc.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
                last = str(resp.status)
        except OSError as err:
            last = str(err)
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name} at {url} not ready after {deadline_s:.0f}s ({last}):\n{proc.log_tail()}")


class LoadGen:
    """The load generator process, driven one JSON line per run."""

    def __init__(self, core: int | None, module: str = "bench.loadgen") -> None:
        self._popen = subprocess.Popen(
            [*pin_prefix(core), sys.executable, "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )

    def run(self, command: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        stdin: IO[bytes] | None = self._popen.stdin
        stdout: IO[bytes] | None = self._popen.stdout
        assert stdin is not None
        assert stdout is not None
        stdin.write((json.dumps(command) + "\n").encode())
        stdin.flush()
        # The loadgen bounds its own run; a hang past this is a harness failure, not a result.
        deadline = time.monotonic() + timeout_s
        line = b""

        with selectors.DefaultSelector() as sel:
            sel.register(stdout, selectors.EVENT_READ)
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.close()
                    raise RuntimeError(f"loadgen did not answer within {timeout_s:.0f}s")
                chunk = os.read(stdout.fileno(), 1 << 20)
                if not chunk:
                    raise RuntimeError("loadgen exited")
                line += chunk
        result: dict[str, Any] = json.loads(line)
        return result

    def close(self) -> None:
        if self._popen.poll() is None:
            assert self._popen.stdin is not None
            self._popen.stdin.close()
            try:
                self._popen.wait(5.0)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait(2.0)
