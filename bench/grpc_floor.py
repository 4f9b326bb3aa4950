"""``python -m bench.grpc_floor``: what grpc.aio itself costs per message and per call (issue 29).

The floor under both of our hops. A writer process (a grpc.aio server, generic handlers, raw
bytes) answers calls with ready-made messages; a reader process (a grpc.aio client) keeps N
calls going and reads every message. Neither does any work of its own per message beyond the
read or the write, so their CPU per message is what grpc.aio and the event loop charge for one
message: the sidecar pays the reader's price for every message its engine sends (one a token
for vLLM) and the writer's for every message it sends the frontend, which pays the reader's
again. Compare with `bench.full_path`'s CPU per token of our path and of SMG's.

Scenarios: ``stream`` (N concurrent calls of M messages each, read as they come, the shape of
a streamed generation) and ``unary`` (N concurrent calls of one message each, the shape of a
non-streaming request on both hops: the sidecar's and vLLM's Generate are server-streaming
calls). Variants: ``default``, and ``no-ee-client`` with ``GRPC_EXPERIMENTS=-event_engine_client``
in both processes (grpc core's older TCP client; it changes only the client side, the reader).
For scale, the stream scenario also runs ``raw-tcp``: the same messages with no gRPC at all,
each one framed (stream id, length) and written with its own ``transport.write`` on one
loopback TCP connection as it is produced, N streams taking turns, read by an asyncio protocol
that parses every frame: what a hop of our own framing would cost per message.
Writer on CPU 0, reader on CPU 1 (``taskset``), the loop run as our programs run it. CPU is read from
/proc for both processes at the edges of a window after a warm-up. Each round runs every
(scenario, variant) once, in alternating order; figures are medians over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

import grpc

from bench.procs import Proc, free_port, pin_prefix, wait_grpc_ready
from bench.procstat import cpu_seconds
from sidecar_common.programs import run_event_loop

__all__ = ["Scenario", "main", "per_message", "summarize", "table"]

_METHOD: Final = "/bench.floor.Floor/Generate"
# About the size of one token's output message on either hop (a vLLM chunk of one token id
# with its counts, or a sidecar output carrying one or two ids).
PAYLOAD: Final = b"\x0a\x04\x08\xb1\x8e\x07\x10\x01\x18\x10\x20\x01" + b"\x00" * 20
_OPTIONS: Final = [
    ("grpc.max_concurrent_streams", 1 << 20),
    ("grpc.max_send_message_length", 1 << 24),
    ("grpc.max_receive_message_length", 1 << 24),
]
VARIANTS: Final = {"default": None, "no-ee-client": "-event_engine_client"}
RAW: Final = "raw-tcp"  # the stream scenario only
_FRAME: Final = struct.Struct("!IH")  # stream id, payload length
_RAW_HIGH_WATER: Final = 1 << 20  # the raw writer pauses past this much unsent


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    messages: int  # per call
    warmup_s: float
    window_s: float


def _scenarios(quick: bool, streams: int, unary: int, messages: int) -> list[Scenario]:
    warmup, window = (0.5, 1.5) if quick else (2.0, 5.0)
    found = [Scenario(f"stream-{streams}x{messages}", streams, messages, warmup, window)]
    if unary:
        found.append(Scenario(f"unary-{unary}", unary, 1, warmup, window))
    return found


# --- figures (pure) ------------------------------------------------------------------------


def per_message(raw: dict[str, Any]) -> dict[str, float]:
    """One run's figures: CPU µs per message and per call of each side, messages/s."""
    messages = raw["messages"]
    calls = raw["calls"]
    if messages <= 0 or calls <= 0 or raw["seconds"] <= 0:
        raise ValueError(f"a run that moved nothing: {raw}")
    return {
        "messages_per_s": messages / raw["seconds"],
        "calls_per_s": calls / raw["seconds"],
        "reader_us_per_message": raw["reader_cpu_s"] / messages * 1e6,
        "writer_us_per_message": raw["writer_cpu_s"] / messages * 1e6,
        "reader_us_per_call": raw["reader_cpu_s"] / calls * 1e6,
        "writer_us_per_call": raw["writer_cpu_s"] / calls * 1e6,
        "reader_cores": raw["reader_cpu_s"] / raw["seconds"],
        "writer_cores": raw["writer_cpu_s"] / raw["seconds"],
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Median of every figure over the rounds, by scenario then variant."""
    grouped: dict[tuple[str, str], list[dict[str, float]]] = {}
    for run in runs:
        grouped.setdefault((run["scenario"], run["variant"]), []).append(run["figures"])
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (scenario, variant), rows in grouped.items():
        out.setdefault(scenario, {})[variant] = {
            key: statistics.median(row[key] for row in rows) for key in rows[0]
        }
    return out


def table(summary: dict[str, dict[str, dict[str, float]]], rounds: int) -> str:
    lines = [
        f"Medians of {rounds} round(s). µs are CPU time of the whole process (every thread) "
        "per message read or written, and per call.",
        "",
        "| scenario | variant | messages/s | reader µs/message | writer µs/message "
        "| reader µs/call | writer µs/call | reader cores | writer cores |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scenario, variants in summary.items():
        for variant, f in variants.items():
            lines.append(
                f"| {scenario} | {variant} | {f['messages_per_s']:,.0f} | {f['reader_us_per_message']:.1f} "
                f"| {f['writer_us_per_message']:.1f} | {f['reader_us_per_call']:.1f} "
                f"| {f['writer_us_per_call']:.1f} | {f['reader_cores']:.2f} | {f['writer_cores']:.2f} |"
            )
    return "\n".join(lines)


# --- the two processes ---------------------------------------------------------------------


async def _window(
    scenario: Scenario, writer_pid: int, moved: Callable[[], tuple[int, int]]
) -> dict[str, Any]:
    """After the warm-up, the (messages, calls) ``moved`` counts over the window, and both
    processes' CPU at its edges."""
    await asyncio.sleep(scenario.warmup_s)
    (m0, c0), t0 = moved(), time.monotonic()
    r0, w0 = cpu_seconds(os.getpid()), cpu_seconds(writer_pid)
    await asyncio.sleep(scenario.window_s)
    (m1, c1), t1 = moved(), time.monotonic()
    r1, w1 = cpu_seconds(os.getpid()), cpu_seconds(writer_pid)
    return {
        "messages": m1 - m0,
        "calls": c1 - c0,
        "seconds": t1 - t0,
        "reader_cpu_s": r1 - r0,
        "writer_cpu_s": w1 - w0,
    }


async def _serve(port: int) -> None:
    async def generate(
        request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        (count,) = struct.unpack("!I", request)
        for _ in range(count):
            yield PAYLOAD

    class Handler(grpc.GenericRpcHandler):  # type: ignore[type-arg]
        def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
            if details.method != _METHOD:
                return None  # the health probe gets UNIMPLEMENTED: the port answers
            return grpc.unary_stream_rpc_method_handler(generate)

    server = grpc.aio.server(options=_OPTIONS)
    server.add_generic_rpc_handlers([Handler()])
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _read(port: int, writer_pid: int, scenario: Scenario) -> dict[str, Any]:
    messages = calls = 0
    request = struct.pack("!I", scenario.messages)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_OPTIONS) as channel:
        generate = channel.unary_stream(_METHOD, None, None)

        async def one_client() -> None:
            nonlocal messages, calls
            while True:
                call = generate(request)
                while (message := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
                    assert message == PAYLOAD
                    messages += 1
                calls += 1

        tasks = [asyncio.create_task(one_client()) for _ in range(scenario.concurrency)]
        try:
            return await _window(scenario, writer_pid, lambda: (messages, calls))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _serve_raw(port: int, streams: int) -> None:
    frames = [_FRAME.pack(stream, len(PAYLOAD)) + PAYLOAD for stream in range(streams)]

    class Writer(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            # uvloop's TCP transport is not registered as an asyncio.WriteTransport.
            self.transport = cast(asyncio.Transport, transport)
            self.transport.set_write_buffer_limits(high=_RAW_HIGH_WATER)
            self.room = asyncio.Event()
            self.room.set()
            self.task = asyncio.get_running_loop().create_task(self.write_forever())

        def pause_writing(self) -> None:
            self.room.clear()

        def resume_writing(self) -> None:
            self.room.set()

        def connection_lost(self, exc: Exception | None) -> None:
            self.task.cancel()

        async def write_forever(self) -> None:
            # Each stream has one message ready per loop turn, as a relay writes a token when
            # it comes; one write each, nothing gathered.
            while True:
                await self.room.wait()
                for frame in frames:
                    self.transport.write(frame)
                await asyncio.sleep(0)

    server = await asyncio.get_running_loop().create_server(Writer, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def _read_raw(port: int, writer_pid: int, scenario: Scenario) -> dict[str, Any]:
    messages = 0

    class Reader(asyncio.Protocol):
        def __init__(self) -> None:
            self.pending = bytearray()

        def data_received(self, data: bytes) -> None:
            nonlocal messages
            pending = self.pending
            pending += data
            at, end = 0, len(pending)
            while end - at >= _FRAME.size:
                _stream, length = _FRAME.unpack_from(pending, at)
                if end - at < _FRAME.size + length:
                    break
                payload = bytes(pending[at + _FRAME.size : at + _FRAME.size + length])
                assert payload == PAYLOAD
                at += _FRAME.size + length
                messages += 1
            del pending[:at]

    transport, _ = await asyncio.get_running_loop().create_connection(Reader, "127.0.0.1", port)
    try:
        # Calls are only a unit here: every stream's messages, M at a time.
        counts = await _window(scenario, writer_pid, lambda: (messages, messages // scenario.messages))
    finally:
        transport.close()
    counts["calls"] = max(1, counts["calls"])
    return counts


def _wait_port(proc: Proc, port: int, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited early:\n{proc.log_tail()}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{proc.name} not listening on {port} after {deadline_s:.0f}s")


# --- the harness ---------------------------------------------------------------------------


def _env_prefix(experiments: str | None) -> list[str]:
    return [] if experiments is None else ["env", f"GRPC_EXPERIMENTS={experiments}"]


def _one_run(scenario: Scenario, variant: str) -> dict[str, Any]:
    port = free_port()
    raw = variant == RAW
    experiments = None if raw else VARIANTS[variant]
    spec = json.dumps(scenario.__dict__)
    writer = Proc(
        f"grpc-floor-writer-{variant}",
        [*_env_prefix(experiments), sys.executable, "-m", "bench.grpc_floor",
         "--role", "raw-writer" if raw else "writer", "--port", str(port), "--scenario", spec],
        core=0,
    ).start()  # fmt: skip
    try:
        if raw:
            _wait_port(writer, port, 30.0)
        else:
            wait_grpc_ready(writer, f"127.0.0.1:{port}", 30.0)
        done = subprocess.run(
            [*pin_prefix(1), *_env_prefix(experiments), sys.executable, "-m", "bench.grpc_floor",
             "--role", "raw-reader" if raw else "reader", "--port", str(port),
             "--writer-pid", str(writer.pid), "--scenario", spec],
            capture_output=True, text=True, timeout=scenario.warmup_s + scenario.window_s + 60.0,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"the reader failed ({scenario.name}, {variant}):\n{done.stderr[-3000:]}")
        counts: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        writer.stop()
    return {"scenario": scenario.name, "variant": variant, "raw": counts, "figures": per_message(counts)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows, one round (a smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3; 1 with --quick)")
    parser.add_argument("--streams", type=int, default=256, help="concurrent streamed calls")
    parser.add_argument("--messages", type=int, default=128, help="messages per streamed call")
    parser.add_argument("--unary", type=int, default=2048, help="concurrent one-message calls (0: none)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/grpc_floor"))
    parser.add_argument(
        "--role", choices=["writer", "reader", "raw-writer", "raw-reader"], help=argparse.SUPPRESS
    )
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--writer-pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--scenario", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    # Both processes run their loop as our programs do (anyio on uvloop).
    if args.role in ("writer", "raw-writer"):
        concurrency = Scenario(**json.loads(args.scenario)).concurrency

        async def write() -> int:
            await (_serve(args.port) if args.role == "writer" else _serve_raw(args.port, concurrency))
            return 0

        return run_event_loop(write)
    if args.role in ("reader", "raw-reader"):
        scenario = Scenario(**json.loads(args.scenario))
        reader = _read if args.role == "reader" else _read_raw

        async def read() -> int:
            print(json.dumps(await reader(args.port, args.writer_pid, scenario)), flush=True)
            return 0

        return run_event_loop(read)

    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    scenarios = _scenarios(args.quick, args.streams, args.unary, args.messages)
    runs: list[dict[str, Any]] = []
    variants = [*VARIANTS, RAW]
    for round_no in range(rounds):
        order = variants if round_no % 2 == 0 else variants[::-1]
        for scenario in scenarios:
            for variant in order:
                if variant == RAW and scenario.messages == 1:
                    continue  # a call's own cost is gRPC's; the raw stream has no calls
                run = _one_run(scenario, variant)
                runs.append({**run, "round": round_no})
                f = run["figures"]
                print(
                    f"round {round_no + 1} {scenario.name} {variant}: {f['messages_per_s']:,.0f} messages/s, "
                    f"reader {f['reader_us_per_message']:.1f} µs/message, "
                    f"writer {f['writer_us_per_message']:.1f} µs/message",
                    flush=True,
                )
    summary = summarize(runs)
    name = "grpc_floor_quick" if args.quick else "grpc_floor"
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "grpcio": grpc.__version__,
        "python": sys.version.split()[0],
        "pinning": "writer on CPU 0, reader on CPU 1 (taskset)",
        "payload_bytes": len(PAYLOAD),
        "rounds": rounds,
        "scenarios": [s.__dict__ for s in scenarios],
        "summary": summary,
        "runs": runs,
    }
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    header = (
        f"# bench.grpc_floor, {doc['date']}\n\ngrpcio {doc['grpcio']}, Python {doc['python']}, "
        f"{doc['pinning']}, messages of {len(PAYLOAD)} bytes.\n\n"
    )
    (args.out / f"{name}.md").write_text(header + table(summary, rounds) + "\n")
    print(table(summary, rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
