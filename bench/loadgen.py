"""The client load generator: its own process, so its CPU never counts against the hop.

It reads one JSON command per line on stdin and answers one JSON result per line on stdout.
A run is closed-loop: ``concurrency`` streams each issue requests back to back. After a
warm-up (so every stream is in steady state) a measurement window opens; only tokens,
messages, first tokens and gaps seen inside it count, and the hop's and engine's CPU are
read from /proc at its edges. When it closes, the streams are cancelled (the hop then
aborts on the engine), which keeps the drain of long requests out of every figure.

Run as ``python -m bench.loadgen`` (the harness does, pinned with taskset).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2

from bench.procstat import cpu_seconds, machine_busy_seconds, peak_rss_kib, reset_peak_rss
from sidecar_common.api import sidecar_pb2

__all__ = ["Command", "main", "percentile", "run", "serve_commands"]

_METHODS = {"vllm": "/vllm.grpc.engine.VllmEngine/Generate", "sidecar": "/sidecar.v1.Worker/Generate"}
_PROMPT_BASE = 1000


@dataclass(frozen=True)
class Command:
    api: str  # "vllm": the engine's native API (direct or bare proxy); "sidecar": sidecar.v1
    target: str
    concurrency: int
    max_tokens: int
    warmup_s: float
    window_s: float
    hop_pid: int | None = None
    engine_pid: int | None = None
    channels: int = 1
    prompt_len: int = 16
    logprobs: int | None = None  # sidecar API only: ask for output logprobs (N alternatives)


@dataclass
class _Tally:
    start: float = 0.0
    end: float = float("inf")
    tokens: int = 0
    messages: int = 0
    requests: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no samples."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def _request(api: str, worker: int, seq: int, cmd: Command) -> bytes:
    prompt = [_PROMPT_BASE + (worker * 7 + seq + i) % 500 for i in range(cmd.prompt_len)]
    rid = f"bench-{worker}-{seq}"
    if api == "vllm":
        native: bytes = vllm_engine_pb2.GenerateRequest(
            request_id=rid,
            tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
            sampling_params=vllm_engine_pb2.SamplingParams(
                max_tokens=cmd.max_tokens, ignore_eos=True, top_p=1.0, repetition_penalty=1.0, n=1
            ),
            stream=True,
        ).SerializeToString()
        return native
    request = sidecar_pb2.PreprocessedRequest(
        request_id=rid,
        token_ids=prompt,
        stop_conditions=sidecar_pb2.StopConditions(max_tokens=cmd.max_tokens, ignore_eos=True),
    )
    if cmd.logprobs is not None:
        request.output_options.logprobs = cmd.logprobs
    return request.SerializeToString()


def _vllm_tokens(raw: bytes) -> int:
    msg = vllm_engine_pb2.GenerateResponse.FromString(raw)
    # The servicer's `complete` restates the last chunk's tokens: count chunks only.
    return len(msg.chunk.token_ids) if msg.WhichOneof("response") == "chunk" else 0


def _sidecar_tokens(raw: bytes) -> int:
    return len(sidecar_pb2.LLMEngineOutput.FromString(raw).token_ids)


_COUNTERS: dict[str, Callable[[bytes], int]] = {"vllm": _vllm_tokens, "sidecar": _sidecar_tokens}


async def _stream_worker(
    worker: int, cmd: Command, methods: list[Any], tally: _Tally, stop: asyncio.Event
) -> None:
    count = _COUNTERS[cmd.api]
    clock = time.perf_counter
    seq = 0
    while not stop.is_set():
        request = _request(cmd.api, worker, seq, cmd)
        method = methods[(worker + seq) % len(methods)]
        seq += 1
        started = clock()
        prev: float | None = None
        call = method(request)
        try:
            async for raw in call:
                now = clock()
                n = count(raw)
                if n == 0:
                    continue
                inside = tally.start <= now < tally.end
                if inside:
                    tally.tokens += n
                    tally.messages += 1
                    if prev is None:
                        tally.ttft.append(now - started)
                    else:
                        tally.gaps.append(now - prev)
                prev = now
            if tally.start <= clock() < tally.end:
                tally.requests += 1
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED or not stop.is_set():
                tally.errors += 1
                if len(tally.error_samples) < 3:
                    tally.error_samples.append(f"{err.code().name}: {err.details()}")
                await asyncio.sleep(0.01)
        finally:
            call.cancel()


def _channel_options(index: int) -> list[tuple[str, Any]]:
    # Separate subchannel pools give each channel its own TCP connection.
    return [("grpc.use_local_subchannel_pool", 1), ("bench.channel", index)]


async def run(cmd: Command) -> dict[str, Any]:
    channels = [
        grpc.aio.insecure_channel(cmd.target, options=_channel_options(i)) for i in range(cmd.channels)
    ]
    methods = [ch.unary_stream(_METHODS[cmd.api], None, None) for ch in channels]
    tally = _Tally()
    stop = asyncio.Event()
    try:
        await asyncio.gather(*(asyncio.wait_for(ch.channel_ready(), 10.0) for ch in channels))
        tasks = [
            asyncio.create_task(_stream_worker(w, cmd, methods, tally, stop)) for w in range(cmd.concurrency)
        ]
        if cmd.hop_pid:
            reset_peak_rss(cmd.hop_pid)
        await asyncio.sleep(cmd.warmup_s)
        pids = {"hop": cmd.hop_pid, "engine": cmd.engine_pid, "client": os.getpid()}
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items() if p}
        busy0, steal0 = machine_busy_seconds()
        tally.start = time.perf_counter()
        tally.end = tally.start + cmd.window_s
        await asyncio.sleep(cmd.window_s)
        cpu1 = {k: cpu_seconds(p) for k, p in pids.items() if p}
        busy1, steal1 = machine_busy_seconds()
        elapsed = time.perf_counter() - tally.start
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for ch in channels:
            await ch.close(None)
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu1}
    # CPU that none of the benchmark's processes used: someone else was busy on the machine.
    cpu["other"] = max(0.0, (busy1 - busy0) - sum(cpu.values()))
    cpu["steal"] = steal1 - steal0
    return {
        "window_s": elapsed,
        "tokens": tally.tokens,
        "messages": tally.messages,
        "requests": tally.requests,
        "errors": tally.errors,
        "error_samples": tally.error_samples,
        "tokens_per_s": tally.tokens / elapsed,
        "cpu_s": cpu,
        "ttft_ms": {"p50": _ms(percentile(tally.ttft, 50)), "p99": _ms(percentile(tally.ttft, 99))},
        "gap_ms": {"p50": _ms(percentile(tally.gaps, 50)), "p99": _ms(percentile(tally.gaps, 99))},
        "ttft_samples": len(tally.ttft),
        "gap_samples": len(tally.gaps),
        "hop_peak_rss_kib": peak_rss_kib(cmd.hop_pid) if cmd.hop_pid else None,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


async def _serve_stdin(run_one: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        try:
            result = await run_one(json.loads(line))
        except Exception as exc:  # report, keep serving: one failed run must not end the harness
            result = {"failed": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


def serve_commands(run_one: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    """Run one command per stdin line (JSON in, one JSON result line out) until stdin ends:
    the protocol every load generator of the bench speaks to its harness."""
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    asyncio.run(_serve_stdin(run_one))


def main() -> None:
    serve_commands(lambda fields: run(Command(**fields)))


if __name__ == "__main__":
    main()
