"""The frontend benchmark: what the HTTP hop adds in front of a sidecar.

``python -m bench.frontend --quick`` (about a minute) or ``--full`` (3 rounds, medians).
Starts, on loopback, a testkit vLLM engine (fast: no token latency, one token per chunk) and
``sidecar-vllm`` pinned to CPU 0 with the load generators, and two ``sidecar-frontend``
processes pinned to CPU 1 (one with ``--sglang-incremental-streaming-output``, one without),
so each frontend's CPU comes from /proc alone. Runs:

- ``grpc-direct``: a client reading the sidecar's ``sidecar.v1`` stream (``bench.loadgen``);
- ``vllm``, ``sglang-incremental``, ``sglang-cumulative``: SSE through a frontend
  (``bench.http_loadgen``), each at 256 streams (throughput, frontend CPU per token), at
  1 stream with 4-token requests (TTFT; added TTFT = its p50 minus grpc-direct's), and at
  16 streams with 256- and 2,048-token outputs (does CPU per token grow with the length?).

Scaling (``--scaling``, also part of ``--quick``/``--full``): one frontend over 1, 2 and 4
workers (each a testkit engine and its sidecar on CPU 0), vLLM streaming at 256 streams: the
frontend's CPU per token should not grow with the number of workers; and the routing choice
alone (``Registry.pick``, power of two choices) timed in-process over 1 to 1,024 workers.

Results: ``<out>/frontend.json`` and ``<out>/frontend.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from bench import plan
from bench.procs import LoadGen, Proc, free_port, wait_grpc_ready, wait_http_ready
from sidecar_frontend.registry import Registry, Worker, WorkerState
from sidecar_frontend.worker_events import WorkerEvents

__all__ = ["main"]

FORMATS = {
    "vllm": {"format": "vllm", "cumulative": False, "frontend": "incremental"},
    "sglang-incremental": {"format": "sglang", "cumulative": False, "frontend": "incremental"},
    "sglang-cumulative": {"format": "sglang", "cumulative": True, "frontend": "cumulative"},
}


@dataclass(frozen=True)
class Profile:
    rounds: int
    warmup_s: float
    window_s: float
    long_window_s: float


QUICK = Profile(rounds=1, warmup_s=0.5, window_s=1.5, long_window_s=2.5)
FULL = Profile(rounds=3, warmup_s=1.0, window_s=3.0, long_window_s=5.0)


class Bench:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.procs: list[Proc] = []
        self.sidecar = ""
        self.urls: dict[str, str] = {}
        self.pids: dict[str, int] = {}
        self.engine_pid = 0

    def start(self) -> None:
        engine_addr = f"127.0.0.1:{free_port()}"
        spec = plan.EngineSpec("vllm", chunk_tokens=1)
        engine = Proc("fe-engine", plan.engine_argv(spec, engine_addr, None, False), plan.ENGINE_CORE).start()
        self.procs.append(engine)
        self.engine_pid = engine.pid
        wait_grpc_ready(engine, engine_addr, 60)
        self.sidecar = f"127.0.0.1:{free_port()}"
        hop = plan.HopSpec("sidecar", spec)
        sidecar = Proc("fe-sidecar", plan.hop_argv(hop, self.sidecar, engine_addr, None), plan.ENGINE_CORE)
        self.procs.append(sidecar.start())
        wait_grpc_ready(sidecar, self.sidecar, 60)
        self.pids["sidecar"] = sidecar.pid
        for mode in ("incremental", "cumulative"):
            port = free_port()
            argv = [
                str(Path(plan._script("sidecar-frontend"))),
                "--listen",
                f"127.0.0.1:{port}",
                "--worker",
                self.sidecar,
                "--log-level",
                "warning",
                "--request-timeout-secs",
                "0",
            ]
            if mode == "incremental":
                argv.append("--sglang-incremental-streaming-output")
            proc = Proc(f"fe-frontend-{mode}", argv, plan.HOP_CORE).start()
            self.procs.append(proc)
            url = f"http://127.0.0.1:{port}"
            wait_http_ready(proc, url + "/health", 60)
            self.urls[mode] = url
            self.pids[mode] = proc.pid

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def grpc(self, loadgen: LoadGen, concurrency: int, max_tokens: int, window: float) -> dict[str, Any]:
        command = {
            "api": "sidecar",
            "target": self.sidecar,
            "concurrency": concurrency,
            "max_tokens": max_tokens,
            "warmup_s": self.profile.warmup_s,
            "window_s": window,
            "hop_pid": self.pids["sidecar"],
            "engine_pid": self.engine_pid,
            "channels": 4,
        }
        return loadgen.run(command, window + 60)

    def http(
        self, loadgen: LoadGen, path: str, concurrency: int, max_tokens: int, window: float
    ) -> dict[str, Any]:
        spec = FORMATS[path]
        mode = str(spec["frontend"])
        command = {
            "url": self.urls[mode],
            "format": spec["format"],
            "cumulative": spec["cumulative"],
            "concurrency": concurrency,
            "max_tokens": max_tokens,
            "warmup_s": self.profile.warmup_s,
            "window_s": window,
            "hop_pid": self.pids[mode],
            "engine_pid": self.engine_pid,
        }
        return loadgen.run(command, window + 60)


SCALING_WORKERS = (1, 2, 4)


def _frontend_argv(port: int, workers: list[str], *extra: str) -> list[str]:
    argv = [str(Path(plan._script("sidecar-frontend"))), "--listen", f"127.0.0.1:{port}"]
    for worker in workers:
        argv += ["--worker", worker]
    return [*argv, "--log-level", "warning", "--request-timeout-secs", "0", *extra]


def run_scaling(profile: Profile, add: Any) -> dict[str, Any]:
    """Frontend CPU per token at 256 vLLM streams over 1, 2 and 4 workers."""
    procs: list[Proc] = []
    http_gen = LoadGen(plan.ENGINE_CORE, module="bench.http_loadgen")
    rows: dict[str, dict[str, Any]] = {}
    try:
        sidecars: list[str] = []
        engine_pids: list[int] = []
        spec = plan.EngineSpec("vllm", chunk_tokens=1)
        for n in range(max(SCALING_WORKERS)):
            engine_addr = f"127.0.0.1:{free_port()}"
            engine = Proc(
                f"sc-engine-{n}", plan.engine_argv(spec, engine_addr, None, False), plan.ENGINE_CORE
            )
            procs.append(engine.start())
            wait_grpc_ready(engine, engine_addr, 60)
            engine_pids.append(engine.pid)
            address = f"127.0.0.1:{free_port()}"
            hop = plan.HopSpec("sidecar", spec)
            sidecar = Proc(
                f"sc-sidecar-{n}", plan.hop_argv(hop, address, engine_addr, None), plan.ENGINE_CORE
            )
            procs.append(sidecar.start())
            wait_grpc_ready(sidecar, address, 60)
            sidecars.append(address)
        for count in SCALING_WORKERS:
            port = free_port()
            frontend = Proc(
                f"sc-frontend-{count}", _frontend_argv(port, sidecars[:count]), plan.HOP_CORE
            ).start()
            try:
                url = f"http://127.0.0.1:{port}"
                wait_http_ready(frontend, url + "/health", 60)
                command = {
                    "url": url,
                    "format": "vllm",
                    "cumulative": False,
                    "concurrency": 256,
                    "max_tokens": 128,
                    "warmup_s": profile.warmup_s,
                    "window_s": profile.window_s,
                    "hop_pid": frontend.pid,
                    "engine_pid": engine_pids[0],
                }
                key = f"scaling-{count}w|256x128"
                rows[key] = add(key, http_gen.run(command, profile.window_s + 60))
            finally:
                frontend.stop()
    finally:
        http_gen.close()
        for proc in reversed(procs):
            proc.stop()
    return rows


def pick_cost_ns(sizes: tuple[int, ...] = (1, 4, 16, 64, 256, 1024), picks: int = 20000) -> dict[str, float]:
    """Nanoseconds per ``Registry.pick`` (no exclusions: every request's first choice)."""

    async def measure() -> dict[str, float]:
        costs: dict[str, float] = {}
        for size in sizes:
            workers = Registry(WorkerEvents())
            for n in range(size):
                address = f"10.0.{n // 250}.{n % 250}:50051"
                worker = Worker(address, "agg", None, None, state=WorkerState.SERVING)  # type: ignore[arg-type]
                workers.add(worker)
            started = time.perf_counter_ns()
            for _ in range(picks):
                workers.pick()
            costs[str(size)] = round((time.perf_counter_ns() - started) / picks, 1)
        return costs

    return anyio.run(measure)


def _cpu_us_per_token(result: dict[str, Any]) -> float | None:
    tokens = result.get("tokens") or 0
    hop = result.get("cpu_s", {}).get("hop")
    return None if not tokens or hop is None else hop / tokens * 1e6


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    messages = result.get("messages") or 0
    hop = result.get("cpu_s", {}).get("hop")
    return {
        "tokens_per_s": round(result.get("tokens_per_s", 0.0), 1),
        "hop_cpu_us_per_token": _round(_cpu_us_per_token(result)),
        # The sidecar merges chunks under load, so tokens per event vary: per event too.
        "hop_cpu_us_per_event": _round(hop / messages * 1e6) if messages and hop is not None else None,
        "tokens_per_event": _round(result["tokens"] / messages) if messages else None,
        "ttft_p50_ms": _round(result.get("ttft_ms", {}).get("p50")),
        "ttft_p99_ms": _round(result.get("ttft_ms", {}).get("p99")),
        "errors": result.get("errors", 0),
        "other_cpu_s": _round(result.get("cpu_s", {}).get("other")),
        "hop_peak_rss_kib": result.get("hop_peak_rss_kib"),
    }


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for key in rows[0]:
        values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        merged[key] = _round(statistics.median(values)) if values else rows[0][key]
    return merged


def run(profile: Profile, *, scaling_only: bool = False) -> dict[str, Any]:
    bench = Bench(profile)
    rows: dict[str, list[dict[str, Any]]] = {}

    def add(key: str, result: dict[str, Any]) -> dict[str, Any]:
        if "failed" in result:
            raise RuntimeError(f"{key}: {result['failed']}")
        rows.setdefault(key, []).append(_summary(result))
        print(f"  {key}: {rows[key][-1]}", flush=True)
        return rows[key][-1]

    if scaling_only:
        for _ in range(profile.rounds):
            run_scaling(profile, add)
        results = {key: _median(values) for key, values in rows.items()}
        return {"profile": profile, "results": results, **_scaling_report(rows)}

    grpc_gen = LoadGen(plan.ENGINE_CORE)
    http_gen = LoadGen(plan.ENGINE_CORE, module="bench.http_loadgen")
    try:
        bench.start()
        w, long_w = profile.window_s, profile.long_window_s
        for _ in range(profile.rounds):
            add("grpc-direct|256x128", bench.grpc(grpc_gen, 256, 128, w))
            add("grpc-direct|1x4", bench.grpc(grpc_gen, 1, 4, w))
            for path in FORMATS:
                add(f"{path}|256x128", bench.http(http_gen, path, 256, 128, w))
                add(f"{path}|1x4", bench.http(http_gen, path, 1, 4, w))
                add(f"{path}|16x256", bench.http(http_gen, path, 16, 256, long_w))
                add(f"{path}|16x2048", bench.http(http_gen, path, 16, 2048, long_w))
    finally:
        grpc_gen.close()
        http_gen.close()
        bench.stop()
    for _ in range(profile.rounds):
        run_scaling(profile, add)
    scaling = _scaling_report(rows)
    results = {key: _median(values) for key, values in rows.items()}
    direct_ttft = results["grpc-direct|1x4"]["ttft_p50_ms"]
    derived: dict[str, Any] = {}
    for path in FORMATS:
        ttft = results[f"{path}|1x4"]["ttft_p50_ms"]
        short = results[f"{path}|16x256"]["hop_cpu_us_per_token"]
        long = results[f"{path}|16x2048"]["hop_cpu_us_per_token"]
        derived[path] = {
            "added_ttft_ms": _round(ttft - direct_ttft) if ttft is not None and direct_ttft else None,
            "cpu_us_per_token_256": short,
            "cpu_us_per_token_2048": long,
            "growth_2048_vs_256": _round(long / short - 1.0, 3) if short and long else None,
        }
    return {"profile": profile, "results": results, "derived": derived, **scaling}


def _scaling_report(rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    per_token = {}
    for count in SCALING_WORKERS:
        values = rows.get(f"scaling-{count}w|256x128")
        if values:
            per_token[str(count)] = _median(values)["hop_cpu_us_per_token"]
    return {"scaling": {"cpu_us_per_token_by_workers": per_token, "pick_ns_by_workers": pick_cost_ns()}}


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        "| run | tokens/s | hop CPU µs/token | hop CPU µs/event | tokens/event | TTFT p50 ms | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, row in report["results"].items():
        lines.append(
            f"| {key} | {row['tokens_per_s']} | {row['hop_cpu_us_per_token']} "
            f"| {row['hop_cpu_us_per_event']} | {row['tokens_per_event']} | {row['ttft_p50_ms']} "
            f"| {row['errors']} |"
        )
    lines += [
        "",
        "| format | added TTFT ms (1 stream) | µs/token 256 | µs/token 2048 | growth |",
        "|---|---:|---:|---:|---:|",
    ]
    for path, d in report.get("derived", {}).items():
        growth = d["growth_2048_vs_256"]
        lines.append(
            f"| {path} | {d['added_ttft_ms']} | {d['cpu_us_per_token_256']} | {d['cpu_us_per_token_2048']} "
            f"| {'' if growth is None else f'{growth:+.1%}'} |"
        )
    scaling = report.get("scaling")
    if scaling:
        by_workers = scaling["cpu_us_per_token_by_workers"]
        lines += [
            "",
            "| workers | frontend CPU µs/token (vLLM, 256 streams) |",
            "|---:|---:|",
            *(f"| {count} | {value} |" for count, value in by_workers.items()),
            "",
            "| workers in the set | ns per routing choice (pick) |",
            "|---:|---:|",
            *(f"| {count} | {value} |" for count, value in scaling["pick_ns_by_workers"].items()),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.frontend", description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="one short round (default)")
    mode.add_argument("--full", action="store_true", help="3 rounds, medians")
    parser.add_argument(
        "--scaling", action="store_true", help="only the worker-count scaling runs and the routing cost"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/quick"))
    args = parser.parse_args(argv)
    profile = FULL if args.full else QUICK
    started = time.time()
    report = run(profile, scaling_only=args.scaling)
    report["profile"] = profile.__dict__
    report["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "frontend.json").write_text(json.dumps(report, indent=2) + "\n")
    table = _markdown(report)
    (args.out / "frontend.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
