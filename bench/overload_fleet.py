"""The overload benchmark's processes: three testkit vLLM engines with their ``sidecar-vllm``,
one ``sidecar-frontend`` at a time over them, the engines' queues polled through each sidecar's
``GetLoad``, and every process's CPU.

Nothing is pinned: the fleet is sized so that all of it together stays far below the machine
(each level reports every process's CPU, the machine's, and what something else took).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from bench.overload_plan import FleetShape
from bench.plan import _script
from bench.procs import Proc, free_port, wait_grpc_ready, wait_http_ready
from bench.procstat import cpu_seconds, machine_busy_seconds
from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc

__all__ = ["CpuMeter", "Fleet", "QueuePoller", "frontend_flags"]

STARTUP_S = 120.0
POLL_INTERVAL_S = 0.1


@functools.cache
def frontend_flags() -> frozenset[str]:
    """The ``--flags`` the installed ``sidecar-frontend`` accepts (admission lands later)."""
    try:
        done = subprocess.run(
            [_script("sidecar-frontend"), "--help"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    words = (done.stdout + done.stderr).replace(",", " ").replace("[", " ").replace("]", " ").split()
    return frozenset(w for w in words if w.startswith("--"))


@dataclass
class Fleet:
    shape: FleetShape
    workers: list[Proc] = field(default_factory=list)
    sidecars: list[str] = field(default_factory=list)
    frontend: Proc | None = None
    url: str = ""

    def start_workers(self) -> None:
        s = self.shape
        engines: list[tuple[Proc, str]] = []
        for i in range(s.workers):
            address = f"127.0.0.1:{free_port()}"
            argv = [
                _script("testkit-engine"), "vllm", "--listen", address,
                "--max-num-seqs", str(s.max_running),
                "--max-num-queued-reqs", str(s.max_num_queued_reqs),
                "--token-latency-ms", f"{s.token_latency_ms:g}",
                "--token-latency-slope-ms", f"{s.slope_ms:g}",
                "--prefill-us-per-token", f"{s.prefill_us_per_token:g}",
                "--chunk-tokens", "1",
            ]  # fmt: skip
            engines.append((Proc(f"overload-engine{i}", argv, None).start(), address))
            self.workers.append(engines[-1][0])
        for proc, address in engines:
            wait_grpc_ready(proc, address, STARTUP_S)
        sidecars: list[tuple[Proc, str]] = []
        for i, (_, engine_address) in enumerate(engines):
            listen = f"127.0.0.1:{free_port()}"
            argv = [_script("sidecar-vllm"), "--grpc-endpoint", engine_address, "--listen", listen,
                    "--log-level", "warning"]  # fmt: skip
            sidecars.append((Proc(f"overload-sidecar{i}", argv, None).start(), listen))
            self.workers.append(sidecars[-1][0])
        for proc, listen in sidecars:
            wait_grpc_ready(proc, listen, STARTUP_S)
            self.sidecars.append(listen)

    def frontend_argv(self, port: int, admission: bool, extra: Sequence[str] = ()) -> list[str]:
        argv = [_script("sidecar-frontend"), "--listen", f"127.0.0.1:{port}", "--format", "vllm"]
        for address in self.sidecars:
            argv += ["--worker", address]
        argv += ["--log-level", "warning", "--request-timeout-secs", "0"]
        # Admission is on by default once the frontend has it; before that, today's frontend is
        # the "off" configuration and takes no flag.
        if not admission and "--no-admission" in frontend_flags():
            argv.append("--no-admission")
        return [*argv, *extra]

    def start_frontend(self, admission: bool, extra: Sequence[str] = ()) -> list[str]:
        port = free_port()
        argv = self.frontend_argv(port, admission, extra)
        self.frontend = Proc(f"overload-frontend-{'on' if admission else 'off'}", argv, None).start()
        self.url = f"http://127.0.0.1:{port}"
        wait_http_ready(self.frontend, self.url + "/health", STARTUP_S)
        return argv

    def stop_frontend(self) -> None:
        if self.frontend is not None:
            self.frontend.stop()
            self.frontend = None

    def pids(self) -> dict[str, int]:
        """Every process of the benchmark by name, this one (the client) included."""
        procs = [*self.workers, *([self.frontend] if self.frontend else [])]
        named = {p.name.removeprefix("overload-"): p.pid for p in procs}
        return {**named, "client": os.getpid()}

    def stop(self) -> None:
        self.stop_frontend()
        for proc in reversed(self.workers):
            proc.stop()


class CpuMeter:
    """CPU of each process, of them all (``benchmark``), of the machine, and of everything else
    on it (``other``: another suite, a type check), between ``start`` and ``read``, in cores."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = pids
        self._cpu0: dict[str, float] = {}
        self._busy0 = 0.0
        self._t0 = 0.0

    def start(self, now: float) -> None:
        self._cpu0 = {name: cpu_seconds(pid) for name, pid in self._pids.items()}
        self._busy0, _ = machine_busy_seconds()
        self._t0 = now

    def read(self, now: float) -> dict[str, float]:
        span = max(now - self._t0, 1e-9)
        used = {name: cpu_seconds(pid) - self._cpu0[name] for name, pid in self._pids.items()}
        busy, _ = machine_busy_seconds()
        machine = busy - self._busy0
        cores = {name: round(value / span, 3) for name, value in used.items()}
        cores["benchmark"] = round(sum(used.values()) / span, 3)
        cores["machine"] = round(machine / span, 3)
        cores["other"] = round(max(0.0, machine - sum(used.values())) / span, 3)
        return cores


class QueuePoller:
    """Every ``POLL_INTERVAL_S``, each sidecar's ``GetLoad``: the high-water marks of its
    engine's waiting and running requests since the last :meth:`take`."""

    def __init__(self, sidecars: list[str]) -> None:
        self._sidecars = sidecars
        self._waiting = [0] * len(sidecars)
        self._running = [0] * len(sidecars)
        self._failed = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> QueuePoller:
        self._task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def take(self) -> dict[str, list[int] | int]:
        marks: dict[str, list[int] | int] = {
            "waiting": list(self._waiting),
            "running": list(self._running),
            "failed_polls": self._failed,
        }
        self._waiting = [0] * len(self._sidecars)
        self._running = [0] * len(self._sidecars)
        self._failed = 0
        return marks

    async def _poll(self) -> None:
        channels = [grpc.aio.insecure_channel(a) for a in self._sidecars]
        stubs = [sidecar_pb2_grpc.WorkerStub(c) for c in channels]
        try:
            while True:
                replies = await asyncio.gather(
                    *(s.GetLoad(sidecar_pb2.GetLoadRequest(), timeout=1.0) for s in stubs),
                    return_exceptions=True,
                )
                for i, reply in enumerate(replies):
                    if isinstance(reply, BaseException):
                        self._failed += 1
                        continue
                    waiting = sum(r.waiting_requests for r in reply.ranks)
                    running = sum(r.running_requests for r in reply.ranks)
                    self._waiting[i] = max(self._waiting[i], waiting)
                    self._running[i] = max(self._running[i], running)
                await asyncio.sleep(POLL_INTERVAL_S)
        finally:
            for channel in channels:
                await channel.close(None)
