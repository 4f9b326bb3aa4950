"""The load generator of ``bench.full_path``: its own process (pinned to CPU 0 beside the
engine), so its CPU never counts against either proxy. Same protocol as ``bench.loadgen``: one
JSON command per stdin line, one JSON result per stdout line.

A run is closed loop: ``concurrency`` clients each send a request (``bench.full_path_wire``),
read its whole answer and send the next, all starting together, as a trainer's rollouts do.
After ``warmup_s`` a measurement window of ``window_s`` opens: tokens, finished requests, times
to first token and request latencies count inside it, and every process's CPU is read at its
edges (a proxy's CPU is its whole process tree, so a frontend's worker processes count). Errors
count from the first request on, warm-up included, by kind, with a few samples of each; a
request still running when the window closes is cancelled and counts as nothing.

Run as ``python -m bench.full_path_loadgen`` (``bench.full_path`` does).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.full_path_wire import (
    ErrorKind,
    SseLines,
    http_error,
    parse_event,
    parse_unary,
    request_body,
    stream_outcome,
)
from bench.loadgen import percentile, serve_commands
from bench.procstat import cpu_seconds, machine_busy_seconds, peak_rss_kib, reset_peak_rss

__all__ = ["Command", "main", "process_tree", "run"]

_SAMPLES_PER_KIND = 3
_PAUSE_AFTER_ERROR_S = 0.01


@dataclass(frozen=True)
class Command:
    url: str  # the proxy's base URL
    stream: bool
    concurrency: int
    max_tokens: int
    warmup_s: float
    window_s: float
    model: str
    proxy_pids: dict[str, int] = field(default_factory=dict)  # name -> pid (its whole tree counts)
    engine_pid: int | None = None
    prompt_len: int = 16
    # Each client sends this header with its own value (``rollout-<client>``), as a trainer
    # marks the turns of one rollout session (bench.rollout); None: no such header.
    session_header: str | None = None


@dataclass
class _Tally:
    began: float
    start: float = float("inf")
    end: float = float("inf")
    tokens: int = 0
    events: int = 0
    requests: int = 0
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    errors_in_window: Counter[str] = field(default_factory=Counter)
    samples: dict[str, list[str]] = field(default_factory=dict)
    failing_clients: set[int] = field(default_factory=set)
    first_error_s: float | None = None
    waiting_since: dict[int, float] = field(default_factory=dict)  # client -> sent, no token yet

    def inside(self, now: float) -> bool:
        return self.start <= now < self.end

    def error(self, client: int, kind: str, detail: str, now: float) -> None:
        self.errors[kind] += 1
        if self.inside(now):
            self.errors_in_window[kind] += 1
        samples = self.samples.setdefault(kind, [])
        if len(samples) < _SAMPLES_PER_KIND:
            samples.append(detail[:300])
        self.failing_clients.add(client)
        if self.first_error_s is None:
            self.first_error_s = now - self.began


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process descending from it (from each /proc/<pid>/stat's parent)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                raw = f.read()
        except OSError:
            continue
        # The fields after the command name's closing ')': state, then the parent's pid.
        parent = int(raw[raw.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, ()))
    return tree


def _tree_cpu(pid: int) -> float:
    total = 0.0
    for member in process_tree(pid):
        try:
            total += cpu_seconds(member)
        except (OSError, ValueError):
            continue  # it exited between the listing and the read
    return total


def _tree_peak_rss_kib(pid: int) -> int:
    total = 0
    for member in process_tree(pid):
        try:
            total += peak_rss_kib(member) or 0
        except OSError:
            continue
    return total


async def _read_stream(
    response: aiohttp.ClientResponse, cmd: Command, tally: _Tally, sent: float, client: int
) -> str | None:
    """Read one SSE answer; the error kind it amounts to (None: whole), counted as it goes."""
    clock = time.perf_counter
    lines = SseLines()
    seen = 0
    finished = done = False
    async for data in response.content.iter_any():
        now = clock()
        for payload in lines.feed(data):
            event = parse_event(payload)
            if event.done:
                done = True
                continue
            if event.error is not None:
                tally.error(client, ErrorKind.SSE_ERROR_EVENT, event.error, now)
                return ErrorKind.SSE_ERROR_EVENT
            if event.aborted is not None:
                tally.error(client, ErrorKind.ABORT_FINISH, f"after {seen} tokens: {event.aborted}", now)
                return ErrorKind.ABORT_FINISH
            if event.completion_tokens is not None and event.completion_tokens > seen:
                if seen == 0:
                    tally.waiting_since.pop(client, None)
                    if tally.inside(now):
                        tally.ttft.append(now - sent)
                if tally.inside(now):
                    tally.tokens += event.completion_tokens - seen
                    tally.events += 1
                seen = event.completion_tokens
            finished = finished or event.finished
    kind = stream_outcome(finished, seen, cmd.max_tokens, done)
    if kind is not None:
        tally.error(
            client, kind, f"{seen} of {cmd.max_tokens} tokens, finish={finished}, done={done}", clock()
        )
    return kind


async def _client(
    client: int, cmd: Command, http: aiohttp.ClientSession, tally: _Tally, stop: asyncio.Event
) -> None:
    clock = time.perf_counter
    headers = {"Content-Type": "application/json"}
    if cmd.session_header:
        headers[cmd.session_header] = f"rollout-{client}"
    url = cmd.url + "/generate"
    seq = 0
    while not stop.is_set():
        body = request_body(cmd.model, client, seq, cmd.max_tokens, cmd.stream, cmd.prompt_len)
        seq += 1
        sent = clock()
        tally.waiting_since[client] = sent
        failed: str | None = None
        try:
            async with http.post(url, data=body, headers=headers) as response:
                if response.status != 200:
                    text = (await response.read())[:200].decode(errors="replace")
                    failed = http_error(response.status)
                    tally.error(client, failed, text, clock())
                elif cmd.stream:
                    failed = await _read_stream(response, cmd, tally, sent, client)
                else:
                    answer = parse_unary(await response.read(), cmd.max_tokens)
                    now = clock()
                    tally.waiting_since.pop(client, None)
                    if answer.error is not None:
                        failed = answer.error
                        tally.error(client, failed, answer.detail, now)
                    elif tally.inside(now):
                        tally.tokens += answer.tokens
                        tally.events += 1
        except aiohttp.ClientError as err:
            if stop.is_set():
                return
            failed = ErrorKind.CONNECTION
            tally.error(client, failed, f"{type(err).__name__}: {err}", clock())
        tally.waiting_since.pop(client, None)
        now = clock()
        if failed is None and tally.inside(now):
            tally.requests += 1
            tally.latency.append(now - sent)
        if failed is not None:
            await asyncio.sleep(_PAUSE_AFTER_ERROR_S)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 2)


async def run(cmd: Command) -> dict[str, Any]:
    tally = _Tally(began=time.perf_counter())
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        for pid in cmd.proxy_pids.values():
            for member in process_tree(pid):
                reset_peak_rss(member)
        tasks = [asyncio.create_task(_client(c, cmd, http, tally, stop)) for c in range(cmd.concurrency)]
        await asyncio.sleep(cmd.warmup_s)
        pids = {**cmd.proxy_pids, **({"engine": cmd.engine_pid} if cmd.engine_pid else {})}
        cpu0 = {name: _tree_cpu(pid) for name, pid in pids.items()}
        client0 = cpu_seconds(os.getpid())
        busy0, steal0 = machine_busy_seconds()
        tally.start = time.perf_counter()
        tally.end = tally.start + cmd.window_s
        await asyncio.sleep(cmd.window_s)
        cpu1 = {name: _tree_cpu(pid) for name, pid in pids.items()}
        client1 = cpu_seconds(os.getpid())
        busy1, steal1 = machine_busy_seconds()
        closed = time.perf_counter()
        elapsed = closed - tally.start
        waiting = list(tally.waiting_since.values())
        peak_rss = {name: _tree_peak_rss_kib(pid) for name, pid in cmd.proxy_pids.items()}
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    cpu = {name: cpu1[name] - cpu0[name] for name in cpu1}
    cpu["client"] = client1 - client0
    cpu["other"] = max(0.0, (busy1 - busy0) - sum(cpu.values()))
    cpu["steal"] = steal1 - steal0
    return {
        "window_s": round(elapsed, 3),
        "tokens": tally.tokens,
        "events": tally.events,
        "requests": tally.requests,
        "tokens_per_s": tally.tokens / elapsed,
        "requests_per_s": tally.requests / elapsed,
        "cpu_s": {name: round(value, 4) for name, value in cpu.items()},
        "ttft_ms": {"p50": _ms(percentile(tally.ttft, 50)), "p99": _ms(percentile(tally.ttft, 99))},
        "latency_ms": {"p50": _ms(percentile(tally.latency, 50)), "p99": _ms(percentile(tally.latency, 99))},
        "ttft_samples": len(tally.ttft),
        "errors": dict(tally.errors),
        "errors_in_window": dict(tally.errors_in_window),
        "error_samples": tally.samples,
        "clients_with_errors": len(tally.failing_clients),
        "first_error_s": None if tally.first_error_s is None else round(tally.first_error_s, 2),
        "waiting_at_close": len(waiting),
        "oldest_wait_at_close_s": round(closed - min(waiting), 2) if waiting else None,
        "proxy_peak_rss_kib": peak_rss,
    }


def main() -> None:
    serve_commands(lambda fields: run(Command(**fields)))


if __name__ == "__main__":
    main()
