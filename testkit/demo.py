"""`make run`: a testkit engine and its sidecar on loopback, one real streamed generation.

Starts ``testkit-engine`` and ``sidecar-vllm`` (or ``sidecar-sglang``) as separate processes,
exactly as a user would run them, waits for the sidecar's health to say SERVING, streams one
generation through the public API, prints the tokens, the finish reason and the usage, and
shuts both processes down with SIGTERM (the sidecar drains, then exits 0).

``--engine frontend`` (``make run ENGINE=frontend``) adds ``sidecar-frontend`` in front of the
vLLM sidecar, prints one ``curl`` line against SGLang's ``/generate`` and runs it.
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
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from sidecar_common.api import sidecar_pb2
from testkit.client import generate, wait_serving

__all__ = ["main"]


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
def _process(argv: list[str], label: str) -> Iterator[subprocess.Popen[bytes]]:
    print(f"$ {' '.join(argv)}", flush=True)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL if label == "engine" else None)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            print(f"{label} exited with {code}", flush=True)


def _commands(
    engine: str, engine_port: int, http_port: int, sidecar_port: int
) -> tuple[list[str], list[str]]:
    listen = f"127.0.0.1:{sidecar_port}"
    common = ["--listen", listen, "--grpc-startup-deadline-secs", "60", "--log-format", "console"]
    if engine == "vllm":
        engine_cmd = [*_script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{engine_port}"]
        sidecar_cmd = [*_script("sidecar-vllm"), "--grpc-endpoint", f"127.0.0.1:{engine_port}", *common]
    else:
        engine_cmd = [
            *_script("testkit-engine"),
            "sglang",
            "--grpc-listen",
            f"127.0.0.1:{engine_port}",
            "--http-listen",
            f"127.0.0.1:{http_port}",
        ]
        sidecar_cmd = [
            *_script("sidecar-sglang"),
            "--grpc-endpoint",
            f"127.0.0.1:{engine_port}",
            "--http-endpoint",
            f"127.0.0.1:{http_port}",
            *common,
        ]
    return engine_cmd, sidecar_cmd


def _wait_http_ready(url: str, timeout: float) -> None:
    """Until ``url`` answers 200 (the frontend has a serving worker), bounded."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def _frontend_demo(max_tokens: int) -> int:
    engine_port, sidecar_port, frontend_port = _free_port(), _free_port(), _free_port()
    engine_cmd, sidecar_cmd = _commands("vllm", engine_port, 0, sidecar_port)
    frontend_cmd = [
        *_script("sidecar-frontend"),
        "--listen",
        f"127.0.0.1:{frontend_port}",
        "--worker",
        f"127.0.0.1:{sidecar_port}",
        "--log-format",
        "console",
    ]
    url = f"http://127.0.0.1:{frontend_port}"
    body = json.dumps(
        {"input_ids": [101, 7, 42, 9, 13], "sampling_params": {"max_new_tokens": max_tokens}, "stream": True}
    )
    curl = ["curl", "-sN", f"{url}/generate", "-H", "Content-Type: application/json", "-d", body]
    with _process(engine_cmd, "engine"), _process(sidecar_cmd, "sidecar"), _process(frontend_cmd, "frontend"):
        _wait_http_ready(f"{url}/health", timeout=60)
        print(f"frontend ready at {url}; one SGLang /generate call:", flush=True)
        print(f"$ {shlex.join(curl)}", flush=True)
        run = subprocess.run(curl, check=False)
    return run.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testkit.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["vllm", "sglang", "frontend"], default="vllm")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    if args.engine == "frontend":
        return _frontend_demo(args.max_tokens)

    engine_port, http_port, sidecar_port = _free_port(), _free_port(), _free_port()
    engine_cmd, sidecar_cmd = _commands(args.engine, engine_port, http_port, sidecar_port)
    target = f"127.0.0.1:{sidecar_port}"
    request = sidecar_pb2.PreprocessedRequest(
        request_id="demo-1",
        token_ids=[101, 7, 42, 9, 13],
        stop_conditions=sidecar_pb2.StopConditions(max_tokens=args.max_tokens),
        output_options=sidecar_pb2.OutputOptions(logprobs=0),
    )
    with _process(engine_cmd, "engine"), _process(sidecar_cmd, "sidecar"):
        asyncio.run(wait_serving(target, timeout=60))
        print(f"sidecar SERVING at {target}; streaming one generation:", flush=True)
        result = asyncio.run(generate(target, request, echo=True))
    if result.error is not None:
        print(f"generation failed: {result.error}", file=sys.stderr)
        return 1
    print(f"streamed {len(result.token_ids)} tokens in {len(result.chunks)} chunks", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
