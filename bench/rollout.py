"""``python -m bench.rollout``: a trainer's rollout burst through the frontend (issue 28).

A trainer sends thousands of non-streaming token-in/token-out requests at once, each rollout
session marking its turns with a header, and sends the next turn when an answer comes. This
runs that load (``--concurrency`` clients, default 2,000, closed loop) through three routers in
front of the same fleet of ``--engines`` stand-in vLLM gRPC engines (``bench.full_path_engine``:
it answers at once and does no other work, so the figures are the routers' own cost):

* ``ours-1``: ``sidecar-frontend`` (one process) and one ``sidecar-vllm`` per engine;
* ``ours-2``: the same with ``--processes 2`` (two frontend processes on one port);
* ``smg``: SMG (PyPI ``smg``, in ``.venv-smg/``) with every engine as a worker.

The engines and the load generator run on CPU 0, the routers on CPU 1 (``taskset``), as in
``bench.full_path``. Each side runs once per pair, in an order that alternates by pair; every
run starts fresh processes. Figures (``bench.rollout_stats``): requests/s, tokens/s, latency
p50 / p99, the routers' CPU per token (all their processes) and the frontend's alone, errors by
kind. Results: ``<out>/rollout.json`` and ``rollout.md`` (``rollout_quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import smg
from bench.full_path import (
    ENGINE_CPUS,
    MODEL,
    PROMPT_TOKENS,
    PROXY_CPUS,
    READY_S,
    SETTLE_S,
    _cpu_list,
    _git,
    _machine,
    _pinned,
    _script,
    _smoke,
    _wait_quiet,
)
from bench.full_path_stats import run_row
from bench.full_path_wire import request_body
from bench.procs import LoadGen, Proc, free_port, pin_prefix, wait_grpc_ready
from bench.rollout_stats import SIDES, markdown, ratios, summarize, targets

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "rollout"
SESSION_HEADER = "X-SMG-Routing-Key"
RATIO_METRICS = ("requests_per_s", "latency_p99_ms", "proxy_cpu_us_per_token")


@dataclass(frozen=True)
class Profile:
    name: str
    pairs: int
    concurrency: int
    warmup_s: float
    window_s: float
    quiet_wait_s: float


# At 2,000 concurrent requests of 128 tokens a request takes seconds through a path doing tens
# of thousands of tokens/s: the warm-up lets every client's first request through.
FULL = Profile("full", pairs=2, concurrency=2000, warmup_s=15.0, window_s=40.0, quiet_wait_s=10.0)
QUICK = Profile("quick", pairs=1, concurrency=200, warmup_s=2.0, window_s=4.0, quiet_wait_s=2.0)


@dataclass
class _Stack:
    procs: list[Proc]
    url: str
    proxy_pids: dict[str, int]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


class _Bench:
    def __init__(self, args: argparse.Namespace, profile: Profile, tokenizer: Path) -> None:
        self.args = args
        self.profile = profile
        self.tokenizer = tokenizer
        self.smg_executable: Path | None = None
        self.notes: list[str] = []

    def _engines(self, procs: list[Proc]) -> list[str]:
        addresses = []
        for index in range(self.args.engines):
            address = f"127.0.0.1:{free_port()}"
            argv = [sys.executable, "-m", "bench.full_path_engine", "--listen", address]
            argv += ["--model-path", str(self.tokenizer), "--served-model-name", MODEL]
            engine = _pinned(f"rollout-engine-{index}", argv, self.args.engine_cpus).start()
            procs.append(engine)
            wait_grpc_ready(engine, address, READY_S)
            addresses.append(address)
        return addresses

    def start(self, side: str) -> _Stack:
        procs: list[Proc] = []
        try:
            engines = self._engines(procs)
            if side == "smg":
                return self._start_smg(procs, engines)
            return self._start_ours(procs, engines, 2 if side == "ours-2" else 1)
        except BaseException:
            for proc in reversed(procs):
                proc.stop()
            raise

    def _start_ours(self, procs: list[Proc], engines: list[str], processes: int) -> _Stack:
        cpus = self.args.proxy_cpus
        pids: dict[str, int] = {}
        sidecars = []
        for index, engine in enumerate(engines):
            address = f"127.0.0.1:{free_port()}"
            argv = [_script("sidecar-vllm"), "--grpc-endpoint", engine, "--listen", address]
            sidecar = _pinned(f"rollout-sidecar-{index}", [*argv, "--log-level", "warning"], cpus).start()
            procs.append(sidecar)
            wait_grpc_ready(sidecar, address, READY_S)
            sidecars.append(address)
            pids[f"sidecar-{index}"] = sidecar.pid
        port = free_port()
        argv = [
            _script("sidecar-frontend"), "--listen", f"127.0.0.1:{port}", "--worker", ",".join(sidecars),
            "--log-level", "warning", "--request-timeout-secs", "0", "--processes", str(processes),
        ]  # fmt: skip
        frontend = _pinned("rollout-frontend", argv, cpus).start()
        procs.append(frontend)
        url = f"http://127.0.0.1:{port}"
        _smoke(url, READY_S, frontend)
        return _Stack(procs, url, {"frontend": frontend.pid, **pids})

    def _start_smg(self, procs: list[Proc], engines: list[str]) -> _Stack:
        assert self.smg_executable is not None
        port = free_port()
        argv = smg.smg_fleet_argv(self.smg_executable, port, engines, self.tokenizer, free_port())
        router = _pinned("rollout-smg", argv, self.args.proxy_cpus).start()
        procs.append(router)
        url = f"http://127.0.0.1:{port}"
        _smoke(url, READY_S, router)
        return _Stack(procs, url, {"smg": router.pid})

    def run(self, loadgen: LoadGen, side: str) -> dict[str, Any]:
        profile = self.profile
        waited = _wait_quiet(profile.quiet_wait_s)
        stack = self.start(side)
        try:
            command = {
                "url": stack.url,
                "stream": False,
                "concurrency": profile.concurrency,
                "max_tokens": self.args.max_tokens,
                "warmup_s": profile.warmup_s,
                "window_s": profile.window_s,
                "model": MODEL,
                "proxy_pids": stack.proxy_pids,
                "prompt_len": PROMPT_TOKENS,
                "session_header": SESSION_HEADER,
            }
            result = loadgen.run(command, profile.warmup_s + profile.window_s + 120.0)
        finally:
            stack.stop()
        if "failed" in result:
            raise RuntimeError(f"{side}: the load generator failed: {result['failed']}")
        result["quiet_wait_s"] = waited
        time.sleep(SETTLE_S)
        return result


def side_row(result: dict[str, Any], proxies: list[str]) -> dict[str, Any]:
    """``run_row``'s figures of one run, plus the frontend's own CPU per token."""
    row = run_row(result, proxies)
    row["frontend_cpu_us_per_token"] = row["proxy_cpu_us_per_token_by_process"].get("frontend")
    return row


def _run_pairs(bench: _Bench, loadgen: LoadGen, sides: list[str]) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for pair in range(bench.profile.pairs):
        print(f"pair {pair + 1}/{bench.profile.pairs}", file=sys.stderr, flush=True)
        order = sides if pair % 2 == 0 else list(reversed(sides))
        for side in order:
            result = bench.run(loadgen, side)
            row = side_row(result, list(result["cpu_s"].keys() - {"engine", "client", "other", "steal"}))
            runs.append({"pair": pair, "side": side, "row": row, "result": result})
            errors = f", errors {row['errors_by_kind']}" if row["errors"] else ""
            print(
                f"  pair {pair + 1} {side}: {row['requests_per_s']:,.1f} requests/s, "
                f"{row['tokens_per_s']:,.0f} tokens/s, latency p99 {row['latency_p99_ms']} ms, "
                f"proxy {row['proxy_cpu_us_per_token']} µs/token "
                f"(frontend {row['frontend_cpu_us_per_token']}), other {row['other_cores']} cores{errors}",
                file=sys.stderr,
                flush=True,
            )
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rollout",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 200 clients, short windows, one pair"
    )
    parser.add_argument("--pairs", type=int, help="runs of every side (default 2)")
    parser.add_argument("--concurrency", type=int, help="concurrent requests (default 2,000)")
    parser.add_argument("--engines", type=int, default=2, help="stand-in engines in the fleet (default 2)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default 128)")
    parser.add_argument("--only", choices=SIDES, action="append", help="run this side (repeatable)")
    parser.add_argument("--engine-cpus", default=ENGINE_CPUS, help="taskset list for engines and client")
    parser.add_argument("--proxy-cpus", default=PROXY_CPUS, help="taskset list for the routers")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON and the table go")
    args = parser.parse_args(argv)
    profile = QUICK if args.quick else FULL
    if args.pairs:
        profile = Profile(**{**profile.__dict__, "pairs": args.pairs})
    if args.concurrency:
        profile = Profile(**{**profile.__dict__, "concurrency": args.concurrency})
    sides = args.only or list(SIDES)
    pinned = bool(pin_prefix(0)) and (os.cpu_count() or 1) >= 2
    if not pinned:
        args.engine_cpus = args.proxy_cpus = ""
    started = time.time()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rollout_tokenizer_") as tokenizer_dir:
        tokenizer = smg.write_tokenizer(Path(tokenizer_dir))
        bench = _Bench(args, profile, tokenizer)
        smg_info: dict[str, Any] = {}
        if "smg" in sides:
            bench.smg_executable = smg.ensure_installed()
            smg_info = {"version": smg.smg_version(bench.smg_executable)}
        if profile.name == "quick":
            bench.notes.append("quick profile: a smoke run, not the issue's figures")
        loadgen = LoadGen(_cpu_list(args.engine_cpus) if pinned else None, module="bench.full_path_loadgen")
        try:
            runs = _run_pairs(bench, loadgen, sides)
        finally:
            loadgen.close()
    summary = summarize(runs)
    doc: dict[str, Any] = {
        "date": dt.datetime.fromtimestamp(started, dt.UTC).isoformat(timespec="seconds"),
        "profile": profile.name,
        "pairs": profile.pairs,
        "concurrency": profile.concurrency,
        "engines": args.engines,
        "sides": sides,
        "window": {"warmup_s": profile.warmup_s, "window_s": profile.window_s},
        "request": {
            "endpoint": "POST /generate (SGLang native), stream false",
            "prompt_tokens": PROMPT_TOKENS,
            "max_tokens": args.max_tokens,
            "session_header": SESSION_HEADER,
            "example": json.loads(request_body(MODEL, 0, 0, args.max_tokens, False, PROMPT_TOKENS)),
        },
        "pinning": (
            f"engines + load generator on CPU {args.engine_cpus}, routers on CPU {args.proxy_cpus} (taskset)"
            if pinned
            else "no pinning (taskset or a second core missing)"
        ),
        "machine": _machine(),
        "bench_git": _git(ROOT),
        "smg": smg_info,
        "summary": summary,
        "ratios": {
            side: {metric: ratios(runs, side, metric) for metric in RATIO_METRICS}
            for side in ("ours-1", "ours-2")
        },
        "runs": runs,
        "notes": bench.notes,
        "elapsed_s": round(time.monotonic() - began, 1),
    }
    doc["targets"] = [t.__dict__ for t in targets(summary, profile.concurrency)]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "rollout" if profile.name == "full" else f"rollout_{profile.name}"
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
    table = markdown(doc)
    (args.out / f"{stem}.md").write_text(table)
    print(table)
    print(f"(took {doc['elapsed_s']} s; results in {args.out}/{stem}.json and .md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
