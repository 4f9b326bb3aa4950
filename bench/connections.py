"""Many connections through one frontend: ``python -m bench.connections [--streams N]``.

Starts, on loopback, testkit vLLM engines (paced: one token every ``--token-latency-ms``, up
to 20,000 requests running each) with ``sidecar-vllm`` beside each, and one
``sidecar-frontend`` over them, started with a soft open files limit of 1,024 so that its own
raise to the hard limit shows. This process is the load generator (its own open files limit
raised to the hard limit first: each connection is one file on both sides). Then:

1. *base*: the frontend's resident memory (VmRSS; with ``--processes``, every process's)
   after a few requests;
2. *idle*: N connections, each opened with one ``GET /health`` and then left idle
   (keep-alive): memory per idle connection = (idle - base) / N;
3. *streams*: N streaming generate requests at once, one on each of those connections, each
   of ``--tokens`` tokens; once every one has its first event (all N in flight), memory per
   in-flight stream = (streams - idle) / N, the largest reading while all N are in flight;
4. every stream read to its end: an error is any status but 200, a broken or cut stream, a
   stream without ``[DONE]`` or without its every token (target: zero).

Writes ``<out>/connections_<N>.json`` and ``.md`` (default out: bench/results/connections/).
The figures are this machine's: they say what one frontend holds per connection, not how
fast it serves (bench.full_path does that).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.procs import LOG_DIR, Proc, free_port, wait_grpc_ready, wait_http_ready

__all__ = ["Settings", "main", "run"]

RESULTS = Path(__file__).resolve().parent / "results" / "connections"
PROMPT = [101, 202, 303, 404]
# The frontend starts with this soft limit, far below what the streams need, so its raise shows.
FRONTEND_SOFT_NOFILE = 1024


@dataclass(frozen=True)
class Settings:
    streams: int = 10_000
    # Long enough that the first streams are still running when the last one starts: a
    # sidecar busy relaying tokens takes new calls slowly (issue 29), so the tokens are slow
    # and the calls spread over several sidecars.
    tokens: int = 40
    token_latency_ms: int = 4000
    workers: int = 4
    processes: int = 1
    # Bound on each phase (connecting, all in flight, all finished), seconds.
    phase_timeout: float = 600.0


QUICK = Settings(streams=500, tokens=5, token_latency_ms=400, workers=1)


def _script(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                found += [int(p) for p in f.read().split()]
    return found


def _soft_nofile(pid: int) -> int | None:
    with open(f"/proc/{pid}/limits", encoding="ascii") as f:
        for line in f:
            if line.startswith("Max open files"):
                word = line.split()[3]
                return None if word == "unlimited" else int(word)
    return None


@dataclass
class _Tally:
    first_events: int = 0
    finished: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    all_in_flight: asyncio.Event = field(default_factory=asyncio.Event)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what)


class Fleet:
    """The engines, their sidecars and the frontend."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.procs: list[Proc] = []
        self.frontend: Proc | None = None
        self.url = ""
        self.sidecar_pids: list[int] = []

    def start(self) -> None:
        s = self.settings
        workers: list[str] = []
        for index in range(s.workers):
            engine_addr = f"127.0.0.1:{free_port()}"
            engine = Proc(
                f"conn-engine-{index}",
                [
                    _script("testkit-engine"),
                    "vllm",
                    "--listen",
                    engine_addr,
                    "--max-running",
                    "20000",
                    "--total-kv-tokens",
                    "100000000",
                    "--token-latency-ms",
                    str(s.token_latency_ms),
                ],
                None,
            ).start()
            self.procs.append(engine)
            wait_grpc_ready(engine, engine_addr, 60)
            address = f"127.0.0.1:{free_port()}"
            sidecar = Proc(
                f"conn-sidecar-{index}",
                [
                    _script("sidecar-vllm"),
                    "--grpc-endpoint",
                    engine_addr,
                    "--listen",
                    address,
                    "--log-level",
                    "warning",
                ],
                None,
            ).start()
            self.procs.append(sidecar)
            wait_grpc_ready(sidecar, address, 60)
            self.sidecar_pids.append(sidecar.pid)
            workers.append(address)
        port = free_port()
        argv = [
            _script("sidecar-frontend"),
            "--listen",
            f"127.0.0.1:{port}",
            "--log-format",
            "json",
            "--request-timeout-secs",
            "0",
            "--processes",
            str(s.processes),
        ]
        for worker in workers:
            argv += ["--worker", worker]
        self.frontend = Proc("conn-frontend", argv, None)
        self.frontend.popen = _start_with_soft_nofile(self.frontend, FRONTEND_SOFT_NOFILE)
        self.procs.append(self.frontend)
        self.url = f"http://127.0.0.1:{port}"
        wait_http_ready(self.frontend, self.url + "/health", 60)

    def frontend_pids(self) -> list[int]:
        assert self.frontend is not None
        return [self.frontend.pid, *_children(self.frontend.pid)]

    def frontend_rss_kib(self) -> int:
        return sum(_rss_kib(pid) for pid in self.frontend_pids())

    def limits_line(self) -> dict[str, Any]:
        assert self.frontend is not None
        for line in self.frontend.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"connection limits"' in line:
                entry: dict[str, Any] = json.loads(line)
                return entry
        return {}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(grace=60.0)


def _start_with_soft_nofile(proc: Proc, soft: int) -> subprocess.Popen[bytes]:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    proc.log_path = LOG_DIR / f"{proc.name}.log"

    def lower() -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, hard), hard))

    with open(proc.log_path, "wb") as log:
        return subprocess.Popen(
            proc.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=lower
        )


async def _stream(http: aiohttp.ClientSession, url: str, settings: Settings, tally: _Tally) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": settings.tokens}, "stream": True}
    started = time.perf_counter()
    first = True
    last: bytes = b""
    done = False
    try:
        async with http.post(url + "/generate", json=body) as response:
            if response.status != 200:
                tally.error(f"HTTP {response.status}: {(await response.read())[:200]!r}")
                return
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if first:
                    first = False
                    tally.ttft.append(time.perf_counter() - started)
                    tally.first_events += 1
                    if tally.first_events == settings.streams:
                        tally.all_in_flight.set()
                if payload == b"[DONE]":
                    done = True
                else:
                    last = payload
        if not done:
            tally.error("a stream ended without [DONE]")
        elif len(json.loads(last).get("output_ids") or ()) != settings.tokens:
            tally.error("a stream ended short of its tokens")
        else:
            tally.finished += 1
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:
        tally.error(f"{type(err).__name__}: {err}")
    finally:
        if first:
            # Never in flight: count it so the wait for all N does not hang on a failure.
            tally.first_events += 1
            if tally.first_events == settings.streams:
                tally.all_in_flight.set()


async def _measure(fleet: Fleet, settings: Settings) -> dict[str, Any]:
    n = settings.streams
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3600)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
    report: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        for _ in range(5):
            async with http.post(
                fleet.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
            ) as response:
                await response.read()
        await asyncio.sleep(1.0)
        base = fleet.frontend_rss_kib()

        # Idle: N connections at once, each one GET /health, then kept open unused.
        opened = time.perf_counter()
        idle_errors = 0

        async def health() -> None:
            nonlocal idle_errors
            try:
                async with http.get(fleet.url + "/health") as response:
                    await response.read()
                    if response.status != 200:
                        idle_errors += 1
            except aiohttp.ClientError:
                idle_errors += 1

        await asyncio.wait_for(asyncio.gather(*(health() for _ in range(n))), settings.phase_timeout)
        connect_secs = time.perf_counter() - opened
        await asyncio.sleep(2.0)
        idle = fleet.frontend_rss_kib()
        pooled = sum(len(v) for v in connector._conns.values())  # connections kept alive, idle

        # Streams: N at once over those connections; measured once all N are in flight.
        tally = _Tally()
        began = time.perf_counter()
        tasks = [asyncio.create_task(_stream(http, fleet.url, settings, tally)) for _ in range(n)]
        await asyncio.wait_for(tally.all_in_flight.wait(), settings.phase_timeout)
        in_flight_secs = time.perf_counter() - began
        readings = [fleet.frontend_rss_kib()]
        finished_at_reading = tally.finished + tally.errors
        # A few more readings while every stream still runs (the first ones end tokens x
        # latency after their first token at the earliest).
        horizon = max(0.0, settings.tokens * settings.token_latency_ms / 1000 - in_flight_secs) / 2
        for _ in range(4):
            await asyncio.sleep(horizon / 4)
            if tally.finished + tally.errors:
                break
            readings.append(fleet.frontend_rss_kib())
        streaming = max(readings)
        sidecar_rss = sum(_rss_kib(pid) for pid in fleet.sidecar_pids)
        await asyncio.wait_for(asyncio.gather(*tasks), settings.phase_timeout)
        all_done_secs = time.perf_counter() - began

    assert fleet.frontend is not None
    limits = fleet.limits_line()
    ttft = sorted(tally.ttft)
    report.update(
        {
            "errors": tally.errors + idle_errors,
            "error_samples": tally.error_samples,
            "streams_finished": tally.finished,
            # Streams already ended when memory was first read with all N started: 0 for the
            # per-stream figure to hold N streams in flight.
            "ended_before_reading": finished_at_reading,
            "idle_connections_kept": pooled,
            "frontend_rss_kib": {"base": base, "idle": idle, "streams": streaming, "readings": readings},
            "frontend_kib_per_idle_connection": round((idle - base) / n, 2),
            "frontend_kib_per_stream": round((streaming - idle) / n, 2),
            "sidecars_rss_kib_streams": sidecar_rss,
            "connect_secs": round(connect_secs, 2),
            "all_in_flight_secs": round(in_flight_secs, 2),
            "all_finished_secs": round(all_done_secs, 2),
            "ttft_ms": {
                "p50": round(statistics.median(ttft) * 1000, 1) if ttft else None,
                "p99": round(ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] * 1000, 1) if ttft else None,
            },
            "frontend_open_files": {
                "started_with": FRONTEND_SOFT_NOFILE,
                "soft_now": _soft_nofile(fleet.frontend.pid),
                "logged": {
                    k: limits.get(k) for k in ("open_files", "open_files_hard", "open_files_raised_from")
                },
            },
            "listen_backlog": limits.get("listen_backlog"),
            "somaxconn": limits.get("somaxconn"),
        }
    )
    return report


def run(settings: Settings) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    needed = settings.streams + 200
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise SystemExit(
            f"the open files hard limit is {hard}; {settings.streams} streams need about {needed}"
        )
    fleet = Fleet(settings)
    try:
        fleet.start()
        measured = asyncio.run(_measure(fleet, settings))
    finally:
        fleet.stop()
    return {
        "settings": asdict(settings),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        "machine": {
            "cores": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
        },
        "load_generator_open_files": {"soft_before": soft, "soft": hard},
        **measured,
    }


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    rss = report["frontend_rss_kib"]
    files = report["frontend_open_files"]
    return "\n".join(
        [
            f"# {s['streams']:,} connections through one frontend ({report['date']})",
            "",
            f"{s['streams']:,} streams of {s['tokens']} tokens, one token every {s['token_latency_ms']} ms, "
            f"over {s['workers']} testkit engine(s) with a sidecar each; frontend processes: "
            f"{s['processes']}; {report['machine']['cores']} cores.",
            "",
            "| figure | value |",
            "|---|---:|",
            f"| errors | {report['errors']} |",
            f"| streams finished with every token | {report['streams_finished']:,} |",
            f"| streams already ended when memory was read (0: all in flight) "
            f"| {report['ended_before_reading']} |",
            f"| frontend RSS: base / {s['streams']:,} idle connections / {s['streams']:,} streams (MiB) "
            f"| {rss['base'] / 1024:.0f} / {rss['idle'] / 1024:.0f} / {rss['streams'] / 1024:.0f} |",
            f"| frontend memory per idle keep-alive connection "
            f"| {report['frontend_kib_per_idle_connection']} KiB |",
            f"| frontend memory per in-flight stream (beyond its connection) "
            f"| {report['frontend_kib_per_stream']} KiB |",
            f"| time to open the connections / to have all streams in flight "
            f"| {report['connect_secs']} s / {report['all_in_flight_secs']} s |",
            f"| time to first token p50 / p99 "
            f"| {report['ttft_ms']['p50']} ms / {report['ttft_ms']['p99']} ms |",
            f"| frontend open files limit: started with / raised to "
            f"| {files['started_with']} / {files['soft_now']} |",
            f"| listen backlog (somaxconn) | {report['listen_backlog']} ({report['somaxconn']}) |",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.connections", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="500 short streams over one worker")
    parser.add_argument("--streams", type=int, default=None, help="concurrent connections and streams")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per stream")
    parser.add_argument("--token-latency-ms", type=int, default=None, help="the engines' pace")
    parser.add_argument("--workers", type=int, default=None, help="engines, each with its sidecar")
    parser.add_argument("--processes", type=int, default=None, help="the frontend's --processes")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the result files go")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else Settings()
    overrides = {
        key: value
        for key, value in (
            ("streams", args.streams),
            ("tokens", args.tokens),
            ("token_latency_ms", args.token_latency_ms),
            ("workers", args.workers),
            ("processes", args.processes),
        )
        if value is not None
    }
    settings = Settings(**{**asdict(base), **overrides})
    report = run(settings)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"connections_{settings.streams}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
