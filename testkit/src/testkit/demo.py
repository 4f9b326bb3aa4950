"""`make run`: a testkit engine and its sidecar on loopback, one real streamed generation.

Starts ``testkit-engine`` and the sidecar as separate processes, exactly as a user would run
them, waits for the sidecar's health to say SERVING, streams one generation through the public
API, prints the tokens, the finish reason and the usage, and shuts every process down with
SIGTERM (the sidecar drains, then exits 0). The demos (``--engine``, ``make run ENGINE=``):

- ``vllm``: the testkit vLLM engine and ``sidecar-vllm`` (the default);
- ``sglang``: the testkit SGLang engine and ``sidecar-sglang`` over SGLang's gRPC API;
- ``sglang-http``: the same over SGLang's HTTP API (``--transport http``);
- ``frontend``: ``sidecar-frontend`` in front of the vLLM sidecar, and one ``curl`` against
  SGLang's ``/generate`` on it.

A child that exits before the demo is done (a flag it refuses, a port already taken) stops the
demo at once with one line naming it and its exit code; its own output is just above.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar_common.api import sidecar_pb2
from testkit.client import generate

__all__ = ["DEMOS", "main"]

DEMOS: Final = ("vllm", "sglang", "sglang-http", "frontend")
# How long the demo waits for its processes to serve; a child that exits ends the wait at once.
READY_WAIT: Final = 60.0
# How long each child gets to exit after SIGTERM (the sidecar drains in less).
STOP_WAIT: Final = 15.0
PROMPT: Final = (101, 7, 42, 9, 13)


class ChildExited(Exception):
    """A process of the demo ended before the demo was done with it."""

    def __init__(self, label: str, code: int) -> None:
        super().__init__(f"{label} exited with code {code} before the demo was done (its output is above)")


class NotReady(Exception):
    """A process of the demo did not serve within the wait."""


@dataclass
class _Children:
    """The demo's processes, by label, in start order."""

    procs: dict[str, subprocess.Popen[bytes]]

    def check(self) -> None:
        """Raise :class:`ChildExited` for the first child that is no longer running."""
        for label, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                raise ChildExited(label, code)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _script(name: str) -> list[str]:
    """The console script beside this interpreter, else the module form."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return [str(beside)]
    module = {
        "testkit-engine": "testkit",
        "sidecar-vllm": "sidecar_vllm",
        "sidecar-sglang": "sidecar_sglang",
        "sidecar-frontend": "sidecar_frontend",
    }
    return [sys.executable, "-m", module[name]]


@contextlib.contextmanager
def _started(commands: dict[str, list[str]]) -> Iterator[_Children]:
    """Start each command (in order); on the way out, SIGTERM them in reverse order."""
    children = _Children({})
    try:
        for label, argv in commands.items():
            print(f"$ {shlex.join(argv)}", flush=True)
            quiet = subprocess.DEVNULL if label == "engine" else None
            children.procs[label] = subprocess.Popen(argv, stdout=quiet)
        yield children
    finally:
        for label, proc in reversed(children.procs.items()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    code = proc.wait(timeout=STOP_WAIT)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    code = proc.wait()
                print(f"{label} exited with {code}", flush=True)


def _engine_command(engine: str, grpc_port: int, http_port: int) -> list[str]:
    if engine == "vllm":
        return [*_script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{grpc_port}"]
    return [
        *_script("testkit-engine"),
        "sglang",
        "--grpc-listen",
        f"127.0.0.1:{grpc_port}",
        "--http-listen",
        f"127.0.0.1:{http_port}",
    ]


def _sidecar_command(demo: str, grpc_port: int, http_port: int, listen_port: int) -> list[str]:
    common = [
        "--listen",
        f"127.0.0.1:{listen_port}",
        "--grpc-startup-deadline-secs",
        f"{READY_WAIT:.0f}",
        "--log-format",
        "console",
    ]
    if demo in ("vllm", "frontend"):
        return [*_script("sidecar-vllm"), "--grpc-endpoint", f"127.0.0.1:{grpc_port}", *common]
    if demo == "sglang":
        return [*_script("sidecar-sglang"), "--grpc-endpoint", f"127.0.0.1:{grpc_port}", *common]
    # sglang-http: SGLang's HTTP API only (the gRPC endpoint is not needed over HTTP).
    return [
        *_script("sidecar-sglang"),
        "--transport",
        "http",
        "--http-endpoint",
        f"127.0.0.1:{http_port}",
        *common,
    ]


def _health_status(target: str) -> int:
    """The sidecar's overall health status, or -1 while it does not answer."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0
            )
        except grpc.RpcError:
            return -1
        status: int = reply.status
        return status


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            ok: bool = response.status == 200
            return ok
    except (urllib.error.URLError, OSError):
        return False


def _wait_ready(children: _Children, what: str, ready: Callable[[], bool]) -> None:
    """Until ``ready()`` says so, checking that no child exited meanwhile; bounded by READY_WAIT."""
    give_up = time.monotonic() + READY_WAIT
    while True:
        children.check()
        if ready():
            return
        if time.monotonic() > give_up:
            raise NotReady(f"{what} not ready after {READY_WAIT:.0f} s")
        time.sleep(0.1)


def _sidecar_demo(demo: str, max_tokens: int) -> int:
    grpc_port, http_port, listen_port = _free_port(), _free_port(), _free_port()
    target = f"127.0.0.1:{listen_port}"
    engine = "vllm" if demo == "vllm" else "sglang"
    commands = {
        "engine": _engine_command(engine, grpc_port, http_port),
        "sidecar": _sidecar_command(demo, grpc_port, http_port, listen_port),
    }
    request = sidecar_pb2.PreprocessedRequest(
        request_id="demo-1",
        token_ids=PROMPT,
        stop_conditions=sidecar_pb2.StopConditions(max_tokens=max_tokens),
        output_options=sidecar_pb2.OutputOptions(logprobs=0),
    )
    with _started(commands) as children:
        _wait_ready(
            children,
            f"the sidecar at {target}",
            lambda: _health_status(target) == health_pb2.HealthCheckResponse.SERVING,
        )
        print(f"sidecar SERVING at {target}; streaming one generation:", flush=True)
        result = asyncio.run(generate(target, request, echo=True))
        children.check()
    if result.error is not None:
        print(f"generation failed: {result.error}", file=sys.stderr)
        return 1
    print(f"streamed {len(result.token_ids)} tokens in {len(result.chunks)} chunks", flush=True)
    return 0


def _frontend_demo(max_tokens: int) -> int:
    grpc_port, listen_port, frontend_port = _free_port(), _free_port(), _free_port()
    url = f"http://127.0.0.1:{frontend_port}"
    commands = {
        "engine": _engine_command("vllm", grpc_port, 0),
        "sidecar": _sidecar_command("frontend", grpc_port, 0, listen_port),
        "frontend": [
            *_script("sidecar-frontend"),
            "--listen",
            f"127.0.0.1:{frontend_port}",
            "--worker",
            f"127.0.0.1:{listen_port}",
            "--log-format",
            "console",
        ],
    }
    body = json.dumps(
        {"input_ids": list(PROMPT), "sampling_params": {"max_new_tokens": max_tokens}, "stream": True}
    )
    curl = ["curl", "-sSfN", f"{url}/generate", "-H", "Content-Type: application/json", "-d", body]
    with _started(commands) as children:
        # /health answers 200 once a worker serves the model.
        _wait_ready(children, f"the frontend at {url}", lambda: _http_ok(f"{url}/health"))
        print(f"frontend ready at {url}; one SGLang /generate call:", flush=True)
        print(f"$ {shlex.join(curl)}", flush=True)
        run = subprocess.run(curl, check=False, timeout=READY_WAIT)
        children.check()
    if run.returncode != 0:
        print(f"curl failed with exit code {run.returncode}", file=sys.stderr)
    return run.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testkit.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=DEMOS, default="vllm", help="which demo (make run ENGINE=...)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    try:
        if args.engine == "frontend":
            return _frontend_demo(args.max_tokens)
        return _sidecar_demo(args.engine, args.max_tokens)
    except (ChildExited, NotReady) as failure:
        print(f"demo failed: {failure}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C reached every child too; the ones still running were stopped on the way out.
        print("demo interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
