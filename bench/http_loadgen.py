"""The HTTP load generator for the frontend benchmark: its own process, so its CPU never
counts against the frontend. Same protocol and method as ``bench.loadgen`` (one JSON command
per stdin line, one JSON result per stdout line; closed loop; a measurement window; streams
cancelled when it closes), over the frontend's SSE responses.

Tokens per event: vLLM chunks carry ``choices[].token_ids`` (new tokens); SGLang incremental
events carry the new ``output_ids``; SGLang cumulative events carry everything so far, so the
new tokens are the growth since the previous event.

Run as ``python -m bench.http_loadgen`` (the frontend bench does, pinned with taskset).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.loadgen import _ms, _Tally, percentile, serve_commands
from bench.procstat import cpu_seconds, machine_busy_seconds, peak_rss_kib, reset_peak_rss

__all__ = ["HttpCommand", "main", "run"]

_PROMPT_BASE = 1000


@dataclass(frozen=True)
class HttpCommand:
    url: str  # the frontend's base URL
    format: str  # "sglang" | "vllm"
    concurrency: int
    max_tokens: int
    warmup_s: float
    window_s: float
    cumulative: bool = False  # SGLang events repeat the output so far
    hop_pid: int | None = None
    engine_pid: int | None = None
    prompt_len: int = 16
    # The sidecar behind the frontend: its CPU in the same window (``cpu_s["sidecar"]``).
    sidecar_pid: int | None = None


def _body(cmd: HttpCommand, worker: int, seq: int) -> tuple[str, bytes]:
    prompt = [_PROMPT_BASE + (worker * 7 + seq + i) % 500 for i in range(cmd.prompt_len)]
    if cmd.format == "vllm":
        body: dict[str, Any] = {
            "token_ids": prompt,
            "sampling_params": {"max_tokens": cmd.max_tokens, "ignore_eos": True},
            "stream": True,
        }
        return "/inference/v1/generate", json.dumps(body).encode()
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": cmd.max_tokens, "ignore_eos": True},
        "stream": True,
    }
    return "/generate", json.dumps(body).encode()


def _new_tokens(cmd: HttpCommand, payload: bytes, seen: int) -> int:
    """Tokens this event adds (SGLang cumulative: growth over ``seen``)."""
    event = json.loads(payload)
    if cmd.format == "vllm":
        return sum(len(c.get("token_ids") or ()) for c in event.get("choices") or ())
    ids = event.get("output_ids") or ()
    return len(ids) - seen if cmd.cumulative else len(ids)


async def _stream_worker(
    worker: int, cmd: HttpCommand, http: aiohttp.ClientSession, tally: _Tally, stop: asyncio.Event
) -> None:
    clock = time.perf_counter
    seq = 0
    headers = {"Content-Type": "application/json"}
    while not stop.is_set():
        path, body = _body(cmd, worker, seq)
        seq += 1
        started = clock()
        prev: float | None = None
        seen = 0
        try:
            async with http.post(cmd.url + path, data=body, headers=headers) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:200]!r}")
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    now = clock()
                    n = _new_tokens(cmd, line[6:], seen)
                    seen += n
                    if n <= 0:
                        continue
                    if tally.start <= now < tally.end:
                        tally.tokens += n
                        tally.messages += 1
                        if prev is None:
                            tally.ttft.append(now - started)
                        else:
                            tally.gaps.append(now - prev)
                    prev = now
            if tally.start <= clock() < tally.end:
                tally.requests += 1
        except (aiohttp.ClientError, RuntimeError, ValueError) as err:
            if not stop.is_set():
                tally.errors += 1
                if len(tally.error_samples) < 3:
                    tally.error_samples.append(f"{type(err).__name__}: {err}")
                await asyncio.sleep(0.01)


async def run(cmd: HttpCommand) -> dict[str, Any]:
    tally = _Tally()
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        tasks = [
            asyncio.create_task(_stream_worker(w, cmd, http, tally, stop)) for w in range(cmd.concurrency)
        ]
        if cmd.hop_pid:
            reset_peak_rss(cmd.hop_pid)
        await asyncio.sleep(cmd.warmup_s)
        pids = {
            "hop": cmd.hop_pid,
            "engine": cmd.engine_pid,
            "sidecar": cmd.sidecar_pid,
            "client": os.getpid(),
        }
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
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu1}
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
        "hop_peak_rss_kib": peak_rss_kib(cmd.hop_pid) if cmd.hop_pid else None,
    }


def main() -> None:
    serve_commands(lambda fields: run(HttpCommand(**fields)))


if __name__ == "__main__":
    main()
