"""Helpers shared by the vLLM and SGLang sidecar suites: the public request builder, stream readers
and checks for the in-process end-to-end tests, and child-process handling for the console-script
tests."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import anyio
import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from testkit.book import Book

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc

__all__ = [
    "BIN",
    "PROMPT",
    "ROOT",
    "WAIT",
    "Out",
    "child_env",
    "collect",
    "collect_until_error",
    "free_port",
    "generate_six",
    "log_lines",
    "private_ids",
    "process",
    "public_request",
    "reason_of",
    "script",
    "serving_port",
    "start",
    "stop",
    "terminal",
    "tokens",
    "until",
]

Out = sidecar_pb2.LLMEngineOutput
PROMPT = [101, 202, 303, 404]

# ---------------------------------------------------------------------------- requests


def public_request(
    request_id: str = "req", token_ids: Sequence[int] = (101, 202, 303, 404), **stop: Any
) -> sidecar_pb2.PreprocessedRequest:
    req = sidecar_pb2.PreprocessedRequest(request_id=request_id, token_ids=token_ids)
    for key, value in stop.items():
        if isinstance(value, list):
            getattr(req.stop_conditions, key).extend(value)
        else:
            setattr(req.stop_conditions, key, value)
    return req


# ---------------------------------------------------------------------------- in-process streams


async def collect(call: Any) -> list[Out]:
    """The rest of the stream (read() based, so it mixes with earlier read() calls)."""
    outs: list[Out] = []
    while (out := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
        outs.append(out)
    return outs


async def collect_until_error(call: Any) -> tuple[list[Out], grpc.aio.AioRpcError]:
    outs: list[Out] = []
    try:
        while (out := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            outs.append(out)
    except grpc.aio.AioRpcError as err:
        return outs, err
    raise AssertionError("the stream ended OK")


def reason_of(err: grpc.aio.AioRpcError) -> tuple[str, str]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info.reason, info.metadata["migratable"]


def tokens(outs: list[Out], index: int = 0) -> list[int]:
    return [t for o in outs if o.index == index for t in o.token_ids]


def terminal(outs: list[Out], index: int = 0, *, last: bool = False) -> Out:
    """The one terminal output of choice ``index``; with ``last``, it must also end the stream."""
    mine = [o for o in outs if o.index == index and o.finish_reason != sidecar_pb2.UNSPECIFIED]
    assert len(mine) == 1
    if last:
        assert mine[0] is outs[-1]
    return mine[0]


async def until(cond: Callable[[], bool], what: str, secs: float = 10.0) -> None:
    # The engine's book has no events to wait on; poll it, bounded.
    with anyio.fail_after(secs):
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert cond(), what


class _BookKeeper(Protocol):
    @property
    def book(self) -> Book: ...


class _StackOfBookKeeper(Protocol):
    @property
    def engine(self) -> _BookKeeper: ...


def private_ids(stack: _StackOfBookKeeper) -> list[str]:
    return [rid for rid, _ in stack.engine.book.received]


# ---------------------------------------------------------------------------- child processes

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Bound on every wait for a child: far above what any of these needs, never hit when green.
WAIT = 30.0


def script(name: str) -> str:
    path = BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"console script {name} is not installed"
    return found


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_") and k != "NOTIFY_SOCKET"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start(argv: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """A child in the repository, its output piped, in :func:`child_env` plus ``env``."""
    return subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**child_env(), **(env or {})},
    )


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM and the exit that follows (SIGKILL if none within WAIT); then close the pipes."""
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


@contextmanager
def process(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    proc = start(argv, env)
    try:
        yield proc
    finally:
        stop(proc)


def log_lines(proc: subprocess.Popen[str]) -> Iterator[dict[str, Any]]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            yield json.loads(line)


def serving_port(proc: subprocess.Popen[str]) -> int:
    seen = []
    for entry in log_lines(proc):
        seen.append(entry)
        if entry.get("event") == "serving":
            return int(entry["port"])
    raise AssertionError(f"the sidecar never served; exit {proc.poll()}; log: {seen}")


def generate_six(port: int) -> list[sidecar_pb2.LLMEngineOutput]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = sidecar_pb2_grpc.WorkerStub(channel)
        request = sidecar_pb2.PreprocessedRequest(request_id="proc", token_ids=[101, 202, 303, 404])
        request.stop_conditions.max_tokens = 6
        return list(stub.Generate(request, timeout=WAIT))
