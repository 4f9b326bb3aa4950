"""``python -m bench [--quick | --full]``: one converting sidecar hop against a do-nothing proxy.

Paths, side by side in one run against the same testkit engine in a fast mode:

* ``direct``: the load generator speaks vLLM's native API to the engine (no hop);
* ``bare-proxy``: through bench/bare_proxy.py, which relays raw bytes without decoding;
* ``convert-floor`` (--full): bench/convert_floor.py, the least a converting hop can do;
* ``sidecar``: through ``sidecar-vllm`` (public API in, native API out);
* ``sidecar-grpc`` / ``sidecar-http``: ``sidecar-sglang`` over each native SGLang transport.

Engines and the load generator run on CPU 0, the hop on CPU 1, so the hop's CPU per token
is read cleanly from /proc. Results go to bench/results/latest.json and latest.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc

from bench import plan
from bench.procs import LoadGen, Proc, free_port, pin_prefix, wait_grpc_ready, wait_http_ready
from bench.procstat import machine_busy_seconds
from bench.report import evaluate_targets, key, markdown, summarize

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_READY_S = 60.0
_SETTLE_S = 0.25
_PARTS = ("vllm", "sglang", "latency")


class _Bench:
    def __init__(self, profile: plan.Profile, standin: bool, sglang: bool) -> None:
        self.profile = profile
        self.standin = standin
        self.sglang = sglang
        self.procs: list[Proc] = []
        self.engine_addr: dict[plan.EngineSpec, tuple[str, str | None, Proc]] = {}
        self.hop_addr: dict[plan.HopSpec, tuple[str, Proc]] = {}
        self.notes: list[str] = []
        self.quiet_wait_s = 0.0
        self.parts = set(_PARTS)
        self.samples: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.latency: dict[str, list[dict[str, Any]]] = defaultdict(list)

    # -- processes ---------------------------------------------------------------------
    def _engines(self) -> list[plan.EngineSpec]:
        specs = {plan.EngineSpec("vllm", k) for k, _ in self.profile.vllm_matrix}
        specs.add(plan.EngineSpec("vllm", 1, plan.PACED_MS))
        if self.sglang:
            specs |= {plan.EngineSpec("sglang", k) for k, _ in self.profile.sglang_matrix}
        return sorted(specs, key=lambda s: s.name)

    def _hops(self, have_vllm_sidecar: bool) -> list[plan.HopSpec]:
        hops: list[plan.HopSpec] = []
        for spec in self._engines():
            if spec.kind == "vllm":
                if not spec.token_latency_ms:
                    hops.append(plan.HopSpec("bare-proxy", spec))
                    if self.profile.floor:
                        hops.append(plan.HopSpec("convert-floor", spec))
                if have_vllm_sidecar:
                    hops.append(plan.HopSpec("sidecar", spec))
            else:
                hops += [plan.HopSpec("sidecar-grpc", spec), plan.HopSpec("sidecar-http", spec)]
        return hops

    def start(self, have_vllm_sidecar: bool) -> None:
        waits: list[tuple[Proc, str, str | None]] = []
        for spec in self._engines():
            grpc_addr = f"127.0.0.1:{free_port()}"
            http_addr = f"127.0.0.1:{free_port()}" if spec.kind == "sglang" else None
            proc = Proc(f"engine-{spec.name}", plan.engine_argv(spec, grpc_addr, http_addr, self.standin),
                        plan.ENGINE_CORE).start()  # fmt: skip
            self.procs.append(proc)
            self.engine_addr[spec] = (grpc_addr, http_addr, proc)
            waits.append((proc, grpc_addr, http_addr))
        for proc, grpc_addr, http_addr in waits:
            wait_grpc_ready(proc, grpc_addr, _READY_S)
            if http_addr:
                wait_http_ready(proc, f"http://{http_addr}/health", _READY_S)
        hop_waits: list[tuple[Proc, str]] = []
        for hop in self._hops(have_vllm_sidecar):
            grpc_addr, http_addr, _ = self.engine_addr[hop.engine]
            listen = f"127.0.0.1:{free_port()}"
            proc = Proc(f"hop-{hop.path}-{hop.engine.name}", plan.hop_argv(hop, listen, grpc_addr, http_addr),
                        plan.HOP_CORE).start()  # fmt: skip
            self.procs.append(proc)
            self.hop_addr[hop] = (listen, proc)
            hop_waits.append((proc, listen))
        for proc, listen in hop_waits:
            wait_grpc_ready(proc, listen, _READY_S)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    # -- runs --------------------------------------------------------------------------
    def _command(self, path: str, engine: plan.EngineSpec, concurrency: int, max_tokens: int,
                 window_s: float) -> dict[str, Any]:  # fmt: skip
        grpc_addr, _, engine_proc = self.engine_addr[engine]
        command: dict[str, Any] = {
            "concurrency": concurrency,
            "max_tokens": max_tokens,
            "warmup_s": self.profile.warmup_s,
            "window_s": window_s,
            "engine_pid": engine_proc.pid,
        }
        if path == "direct":
            return {**command, "api": "vllm", "target": grpc_addr, "hop_pid": None}
        listen, hop_proc = self.hop_addr[plan.HopSpec(path, engine)]
        api = "vllm" if path == "bare-proxy" else "sidecar"
        return {**command, "api": api, "target": listen, "hop_pid": hop_proc.pid}

    def _run(self, loadgen: LoadGen, command: dict[str, Any]) -> dict[str, Any]:
        waited = _wait_quiet(self.quiet_wait_s)
        result = loadgen.run(command, timeout_s=command["warmup_s"] + command["window_s"] + 30.0)
        result["quiet_wait_s"] = waited
        time.sleep(_SETTLE_S)  # let the cancelled streams' aborts finish before the next run
        return result

    def _paths(self, engine_kind: str, rotation: int) -> list[str]:
        if engine_kind == "vllm":
            paths = ["direct", "bare-proxy"] + [p for p in ("convert-floor", "sidecar") if self._has_hop(p)]
        else:
            paths = ["sidecar-grpc", "sidecar-http"]
        # Alternate the order round by round so no path always runs first (or last).
        shift = rotation % len(paths)
        return paths[shift:] + paths[:shift]

    def _has_hop(self, path: str) -> bool:
        return any(h.path == path for h in self.hop_addr)

    def rounds(self, loadgen: LoadGen) -> None:
        p = self.profile
        for r in range(p.rounds):
            print(f"round {r + 1}/{p.rounds}", file=sys.stderr, flush=True)
            matrices = [("vllm", p.vllm_matrix)] if "vllm" in self.parts else []
            if self.sglang and "sglang" in self.parts:
                matrices.append(("sglang", p.sglang_matrix))
            for kind, matrix in matrices:
                for k, c in matrix:
                    engine = plan.EngineSpec(kind, k)
                    for path in self._paths(kind, r):
                        cmd = self._command(path, engine, c, p.max_tokens, p.window_s)
                        result = self._run(loadgen, cmd)
                        self.samples[key(path, kind, k, c)].append(result)
                        _progress(key(path, kind, k, c), result)
            if "latency" in self.parts:
                self._latency_round(loadgen, r)

    def _latency_round(self, loadgen: LoadGen, r: int) -> None:
        p = self.profile
        paths = self._paths("vllm", r)
        fast, paced = plan.EngineSpec("vllm", 1), plan.EngineSpec("vllm", 1, plan.PACED_MS)
        # The bare proxy's TTFT is the floor of any grpc.aio hop: it tells the sidecar's own
        # share of the added latency from the share every Python hop pays.
        for path in paths:
            cmd = self._command(path, fast, 1, plan.TTFT_MAX_TOKENS, p.ttft_window_s)
            self.latency[f"ttft|{path}"].append(self._run(loadgen, cmd))
            _progress(f"ttft|{path}", self.latency[f"ttft|{path}"][-1])
        for path in (x for x in paths if x in ("direct", "sidecar")):
            cmd = self._command(path, paced, plan.PACED_STREAMS, plan.PACED_MAX_TOKENS, p.paced_window_s)
            self.latency[f"paced|{path}"].append(self._run(loadgen, cmd))
            _progress(f"paced|{path}", self.latency[f"paced|{path}"][-1])


def _wait_quiet(max_s: float, busy_limit: float = 0.3, probe_s: float = 0.25) -> float:
    """Wait (at most ``max_s``) until the machine is nearly idle before a run.

    Other work on a shared 2-core machine (a test suite, a type check) takes CPU from the
    pinned processes and scatters the figures; each run records what it waited, and the
    window's "other" CPU shows what it could not avoid.
    """
    began = time.monotonic()
    if max_s <= 0:
        return 0.0
    while True:
        busy0, _ = machine_busy_seconds()
        time.sleep(probe_s)
        busy1, _ = machine_busy_seconds()
        waited = time.monotonic() - began
        if (busy1 - busy0) / probe_s < busy_limit or waited >= max_s:
            return round(waited, 2)


def _progress(name: str, result: dict[str, Any]) -> None:
    if "failed" in result:
        print(f"  {name}: FAILED {result['failed']}", file=sys.stderr, flush=True)
        return
    hop = result["cpu_s"].get("hop")
    per_token = (
        f"{hop / result['tokens'] * 1e6:.1f} µs/token" if hop is not None and result["tokens"] else "-"
    )
    errors = f" errors={result['errors']} {result['error_samples'][:1]}" if result["errors"] else ""
    other = (result["cpu_s"].get("other", 0.0) + result["cpu_s"].get("steal", 0.0)) / result["window_s"]
    per_msg = result["tokens"] / result["messages"] if result["messages"] else 0.0
    print(
        f"  {name}: {result['tokens_per_s']:,.0f} tokens/s, hop {per_token}, {per_msg:.2f} tokens/msg, "
        f"other CPU {other:.2f}{errors}",
        file=sys.stderr,
        flush=True,
    )


def _git() -> dict[str, Any]:
    """The code measured: HEAD and any uncommitted change outside bench/ (the sidecars are an
    editable install, so a run measures the working tree, not the commit)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    dirty = [path for path in dirty if not path.startswith("bench/")]
    return {"commit": git("rev-parse", "HEAD").strip() or "unknown", "dirty": dirty}


def _machine() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="under a minute, one round (default)")
    mode.add_argument("--full", action="store_true", help="every config, medians of 5 alternating rounds")
    parser.add_argument("--rounds", type=int, help="override the profile's number of rounds")
    parser.add_argument("--engine", choices=("auto", "testkit", "standin"), default="auto",
                        help="vLLM engine: testkit (auto: when present) or the stand-in")  # fmt: skip
    parser.add_argument("--quiet-wait", type=float, help="max seconds to wait for an idle machine per run "
                        "(quick: 0.3, full: 5)")  # fmt: skip
    parser.add_argument("--only", type=lambda v: set(v.split(",")), default=set(_PARTS),
                        help=f"parts to run, of {','.join(_PARTS)} (default: all)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where latest.json/latest.md go")
    args = parser.parse_args(argv)

    profile = plan.FULL if args.full else plan.QUICK
    if args.rounds:
        profile = plan.Profile(**{**profile.__dict__, "rounds": args.rounds})
    have = plan.available()
    standin = args.engine == "standin" or (args.engine == "auto" and not have["testkit-vllm"])
    sglang = have["testkit-sglang"] and have["sidecar-sglang"]
    bench = _Bench(profile, standin, sglang)
    if not args.only <= set(_PARTS):
        parser.error(f"--only takes {','.join(_PARTS)}")
    bench.parts = args.only
    bench.quiet_wait_s = args.quiet_wait if args.quiet_wait is not None else (5.0 if args.full else 0.3)
    if standin:
        bench.notes.append("vLLM engine: bench/standin_engine.py (testkit vLLM engine not used)")
    bench.notes += [f"{name} not available in this checkout: skipped" for name, ok in have.items() if not ok]
    pinned = bool(pin_prefix(0)) and (os.cpu_count() or 1) >= 2
    code = _git()
    began = time.monotonic()
    loadgen = LoadGen(plan.ENGINE_CORE if pinned else None)
    try:
        bench.start(have["sidecar-vllm"])
        bench.rounds(loadgen)
    finally:
        loadgen.close()
        bench.stop()
    results = {name: summarize(runs) for name, runs in bench.samples.items()}
    latency = {name: summarize(runs) for name, runs in bench.latency.items()}
    targets = evaluate_targets(results, latency)
    doc: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "profile": profile.name,
        "rounds": profile.rounds,
        "warmup_s": profile.warmup_s,
        "window_s": profile.window_s,
        "max_tokens": profile.max_tokens,
        "paced_ms": plan.PACED_MS,
        "machine": _machine(),
        "git": code,
        "pinning": "engines + load generator on CPU 0, hop on CPU 1 (taskset -c)" if pinned else "none",
        "engines": "bench stand-in (vLLM)" if standin else "testkit (fast mode: no token latency)",
        "results": results,
        "latency": latency,
        "targets": [{**t.__dict__, "verdict": t.verdict} for t in targets],
        "notes": bench.notes,
        "elapsed_s": round(time.monotonic() - began, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    text = markdown(doc, targets)
    (args.out / "latest.md").write_text(text)
    print(text)
    print(f"(took {doc['elapsed_s']} s; results in {args.out}/latest.json and latest.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
