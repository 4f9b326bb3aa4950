"""``python -m bench.full_path``: our full path against SMG's, side by side in one run (issue 29).

* ours: HTTP client -> ``sidecar-frontend`` -> ``sidecar-vllm`` -> engine;
* SMG's: HTTP client -> ``smg`` (PyPI ``smg``, the Rust gateway, in ``.venv-smg/``) -> engine.

The engine is ``bench.full_path_engine``, a vLLM gRPC stand-in that answers at once and does
no other work, so the figures are the proxies' own cost. The engine and the load generator
(``bench.full_path_loadgen``) run on CPU 0, the proxies on CPU 1 (``taskset``), so each side's
CPU is read from /proc alone. Both sides get the same request, SGLang's ``/generate`` with
token ids (``bench.full_path_wire``).

Scenarios (``--full``, the default): 256 concurrent streams (throughput, CPU per token, time to
first token), 2,048 concurrent streams (the same, and errors), 2,048 concurrent non-streaming
requests (requests/s, tokens/s, CPU per token, p99 latency, errors). Each scenario runs once per
side per pair, the sides alternating which goes first; every run starts a fresh engine and
fresh proxies and waits (bounded) for an idle machine first. ``--quick`` is a smoke run: short
windows, one pair, fewer streams.

Results: ``<out>/full_path.json`` (``full_path_quick.json`` with ``--quick``) and the Markdown
table beside it, with ours / SMG's ratios and one PASS/MISS line per target of the issue that
this benchmark measures. ``--pythonpath DIR`` runs our processes from another checkout (a
``git worktree`` of an older commit) for before/after figures.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import smg
from bench.full_path_stats import SIDES, Scenario, markdown, run_row, summarize, targets
from bench.full_path_wire import SseLines, parse_event, request_body
from bench.procs import LoadGen, Proc, free_port, pin_prefix, wait_grpc_ready
from bench.procstat import machine_busy_seconds

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "full_path"
ENGINE_CPUS = "0"
PROXY_CPUS = "1"
MODEL = "bench-model"
PROMPT_TOKENS = 16
READY_S = 60.0
SETTLE_S = 1.0


@dataclass(frozen=True)
class Profile:
    name: str
    pairs: int
    streams: tuple[int, int]
    unary: int
    low_warmup_s: float
    low_window_s: float
    high_warmup_s: float
    high_window_s: float
    unary_warmup_s: float
    unary_window_s: float
    quiet_wait_s: float

    def scenarios(self) -> list[Scenario]:
        low, high = self.streams
        found = [Scenario(f"stream-{low}", True, low, self.low_warmup_s, self.low_window_s)]
        if high and high != low:
            found.append(Scenario(f"stream-{high}", True, high, self.high_warmup_s, self.high_window_s))
        if self.unary:
            found.append(
                Scenario(f"unary-{self.unary}", False, self.unary, self.unary_warmup_s, self.unary_window_s)
            )
        return found


# The high-concurrency windows are long: at 2,048 streams a 128-token request takes tens of
# seconds through a path doing ~8k tokens/s, and gRPC cancels a call left waiting 30 s.
FULL = Profile(
    name="full",
    pairs=3,
    streams=(256, 2048),
    unary=2048,
    low_warmup_s=3.0,
    low_window_s=10.0,
    high_warmup_s=10.0,
    high_window_s=40.0,
    unary_warmup_s=15.0,
    unary_window_s=40.0,
    quiet_wait_s=10.0,
)
QUICK = Profile(
    name="quick",
    pairs=1,
    streams=(256, 1024),
    unary=1024,
    low_warmup_s=1.0,
    low_window_s=3.0,
    high_warmup_s=2.0,
    high_window_s=4.0,
    unary_warmup_s=2.0,
    unary_window_s=4.0,
    quiet_wait_s=2.0,
)


@contextlib.contextmanager
def _pythonpath(directory: str | None) -> Iterator[None]:
    """PYTHONPATH for the processes started inside (Proc inherits this process's environment):
    ``directory`` first, so its packages win over this checkout's editable install."""
    before = os.environ.get("PYTHONPATH")
    if directory:
        os.environ["PYTHONPATH"] = directory + (os.pathsep + before if before else "")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def _script(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def _cpu_list(spec: str) -> int | None:
    """One CPU as an int (what LoadGen pins to); None for a list or nothing."""
    return int(spec) if spec.isdigit() else None


def _pinned(name: str, argv: list[str], cpus: str) -> Proc:
    """A process pinned to a CPU list (``taskset -c LIST`` execs it: the pid is the process's)."""
    prefix = ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []
    return Proc(name, [*prefix, *argv], None)


def _smoke(url: str, deadline_s: float, proc: Proc) -> None:
    """Wait until one short streamed request goes through the proxy whole (SMG loads its
    tokenizer and our frontend finds its worker after their ports open)."""
    body = request_body(MODEL, 0, 0, 4, True, PROMPT_TOKENS)
    end = time.monotonic() + deadline_s
    last = "not tried"
    while time.monotonic() < end:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited early:\n{proc.log_tail()}")
        request = urllib.request.Request(
            url + "/generate", data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=5.0) as response:
                events = [parse_event(p) for p in SseLines().feed(response.read() + b"\n")]
            counts = [e.completion_tokens for e in events if e.completion_tokens is not None]
            if (
                any(e.done for e in events)
                and any(e.finished for e in events)
                and counts
                and max(counts) == 4
            ):
                return
            last = f"answer without its 4 tokens: {events}"
        except (OSError, http.client.HTTPException) as err:
            last = str(err)
        time.sleep(0.2)
    raise RuntimeError(
        f"{proc.name} at {url}: no whole answer after {deadline_s:.0f}s ({last}):\n{proc.log_tail()}"
    )


@dataclass
class _Stack:
    """One side's processes for one run: the engine, then its proxies."""

    procs: list[Proc]
    url: str
    proxy_pids: dict[str, int]
    engine_pid: int

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


class _Bench:
    def __init__(self, args: argparse.Namespace, profile: Profile, tokenizer: Path) -> None:
        self.args = args
        self.profile = profile
        self.tokenizer = tokenizer
        self.smg_executable: Path | None = None
        self.processes_flag = False
        self.notes: list[str] = []

    # -- processes -------------------------------------------------------------------------
    def _engine(self, side: str) -> tuple[Proc, str]:
        address = f"127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "bench.full_path_engine", "--listen", address]
        argv += ["--model-path", str(self.tokenizer), "--served-model-name", MODEL]
        engine = _pinned(f"fp-{side}-engine", argv, self.args.engine_cpus).start()
        wait_grpc_ready(engine, address, READY_S)
        return engine, address

    def start(self, side: str) -> _Stack:
        engine, engine_address = self._engine(side)
        procs: list[Proc] = [engine]
        try:
            if side == "ours":
                return self._start_ours(procs, engine, engine_address)
            return self._start_smg(procs, engine, engine_address)
        except BaseException:
            for proc in reversed(procs):
                proc.stop()
            raise

    def _start_ours(self, procs: list[Proc], engine: Proc, engine_address: str) -> _Stack:
        cpus = self.args.proxy_cpus
        sidecar_address = f"127.0.0.1:{free_port()}"
        port = free_port()
        frontend_argv = [
            _script("sidecar-frontend"), "--listen", f"127.0.0.1:{port}", "--worker", sidecar_address,
            "--log-level", "warning", "--request-timeout-secs", "0", "--sglang-incremental-streaming-output",
        ]  # fmt: skip
        if self.args.processes and self.processes_flag:
            frontend_argv += ["--processes", str(self.args.processes)]
        with _pythonpath(self.args.pythonpath):
            sidecar_argv = [
                _script("sidecar-vllm"),
                "--grpc-endpoint",
                engine_address,
                "--listen",
                sidecar_address,
            ]
            sidecar = _pinned("fp-ours-sidecar", [*sidecar_argv, "--log-level", "warning"], cpus).start()
            procs.append(sidecar)
            wait_grpc_ready(sidecar, sidecar_address, READY_S)
            frontend = _pinned("fp-ours-frontend", frontend_argv, cpus).start()
            procs.append(frontend)
        url = f"http://127.0.0.1:{port}"
        _smoke(url, READY_S, frontend)
        return _Stack(procs, url, {"frontend": frontend.pid, "sidecar": sidecar.pid}, engine.pid)

    def _start_smg(self, procs: list[Proc], engine: Proc, engine_address: str) -> _Stack:
        assert self.smg_executable is not None
        port = free_port()
        argv = smg.smg_argv(self.smg_executable, port, engine_address, self.tokenizer, free_port())
        router = _pinned("fp-smg", argv, self.args.proxy_cpus).start()
        procs.append(router)
        url = f"http://127.0.0.1:{port}"
        _smoke(url, READY_S, router)
        return _Stack(procs, url, {"smg": router.pid}, engine.pid)

    # -- runs ------------------------------------------------------------------------------
    def run(self, loadgen: LoadGen, side: str, scenario: Scenario) -> dict[str, Any]:
        waited = _wait_quiet(
            self.profile.quiet_wait_s if self.args.quiet_wait is None else self.args.quiet_wait
        )
        stack = self.start(side)
        try:
            command = {
                "url": stack.url,
                "stream": scenario.stream,
                "concurrency": scenario.concurrency,
                "max_tokens": self.args.max_tokens,
                "warmup_s": scenario.warmup_s,
                "window_s": scenario.window_s,
                "model": MODEL,
                "proxy_pids": stack.proxy_pids,
                "engine_pid": stack.engine_pid,
                "prompt_len": PROMPT_TOKENS,
            }
            result = loadgen.run(command, scenario.warmup_s + scenario.window_s + 120.0)
        finally:
            stack.stop()
        if "failed" in result:
            raise RuntimeError(f"{side} {scenario.name}: the load generator failed: {result['failed']}")
        result["quiet_wait_s"] = waited
        time.sleep(SETTLE_S)
        return result


def _wait_quiet(max_s: float, busy_limit: float = 0.3, probe_s: float = 0.25) -> float:
    """Wait (at most ``max_s``) until the machine is nearly idle (below ``busy_limit`` cores)."""
    began = time.monotonic()
    while max_s > 0:
        busy0, _ = machine_busy_seconds()
        time.sleep(probe_s)
        busy1, _ = machine_busy_seconds()
        waited = time.monotonic() - began
        if (busy1 - busy0) / probe_s < busy_limit or waited >= max_s:
            return round(waited, 2)
    return 0.0


def _progress(pair: int, side: str, scenario: Scenario, row: dict[str, Any]) -> None:
    errors = f", errors {row['errors_by_kind']}" if row["errors"] else ""
    ttft = f", TTFT p50/p99 {row['ttft_p50_ms']}/{row['ttft_p99_ms']} ms" if scenario.stream else ""
    print(
        f"  pair {pair + 1} {scenario.name} {side}: {row['tokens_per_s']:,.0f} tokens/s, "
        f"{row['requests_per_s']:,.1f} requests/s, proxy {row['proxy_cpu_us_per_token']} µs/token "
        f"{row['proxy_cpu_us_per_token_by_process']}, {row['proxy_cores']} cores{ttft}, "
        f"latency p99 {row['latency_p99_ms']} ms, other {row['other_cores']} cores{errors}",
        file=sys.stderr,
        flush=True,
    )


DISTURBED_CORES = 0.25  # other work on the machine during a window past which a run is flagged


def _run_pairs(
    bench: _Bench, loadgen: LoadGen, scenarios: list[Scenario], sides: list[str]
) -> list[dict[str, Any]]:
    """Every scenario once per side per pair; the side that goes first alternates by pair."""
    runs: list[dict[str, Any]] = []
    pairs = bench.profile.pairs
    for pair in range(pairs):
        print(f"pair {pair + 1}/{pairs}", file=sys.stderr, flush=True)
        order = sides if pair % 2 == 0 else list(reversed(sides))
        for scenario in scenarios:
            for side in order:
                result = bench.run(loadgen, side, scenario)
                row = run_row(result, ["frontend", "sidecar"] if side == "ours" else ["smg"])
                runs.append(
                    {"pair": pair, "scenario": scenario.name, "side": side, "row": row, "result": result}
                )
                _progress(pair, side, scenario, row)
                other = row["other_cores"]
                if other is not None and other > DISTURBED_CORES:
                    bench.notes.append(
                        f"pair {pair + 1} {scenario.name} {side}: {other} cores of other work on the "
                        "machine during the window (disturbed)"
                    )
    return runs


def _git(directory: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout

    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return {
        "commit": git("rev-parse", "HEAD").strip() or "unknown",
        "dirty": [p for p in dirty if not p.startswith("bench/")],
    }


def _imported_from(pythonpath: str | None) -> str:
    """Where our processes' packages come from with this PYTHONPATH (the proof that a
    ``--pythonpath`` run measured the other checkout)."""
    code = "import sidecar_frontend, sidecar_vllm; print(sidecar_frontend.__file__.rsplit('/', 2)[0])"
    with _pythonpath(pythonpath):
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/"
        )
    return done.stdout.strip() or f"unknown ({done.stderr.strip()[-200:]})"


def _frontend_has_processes(pythonpath: str | None) -> bool:
    with _pythonpath(pythonpath):
        done = subprocess.run(
            [_script("sidecar-frontend"), "--help"], capture_output=True, text=True, timeout=60
        )
    return "--processes" in done.stdout


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
    }


def _parse_pair(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    return int(low), int(high or low)


def _profile(args: argparse.Namespace) -> Profile:
    profile = QUICK if args.quick else FULL
    if args.pairs:
        profile = replace(profile, pairs=args.pairs)
    if args.streams:
        profile = replace(profile, streams=args.streams)
    if args.unary is not None:
        profile = replace(profile, unary=args.unary)
    return profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.full_path",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick", action="store_true", help="smoke run: short windows, one pair, 256/1,024 streams"
    )
    mode.add_argument(
        "--full", action="store_true", help="the measurement (default): 3 pairs, 256/2,048 streams"
    )
    parser.add_argument("--pairs", type=int, help="pairs of runs (one per side) per scenario")
    parser.add_argument("--only", choices=SIDES, help="run one side only (no ratios)")
    parser.add_argument(
        "--pythonpath", help="run our processes from this checkout (its code first on PYTHONPATH)"
    )
    parser.add_argument(
        "--processes", type=int, help="sidecar-frontend --processes N, when the frontend has it"
    )
    parser.add_argument("--streams", type=_parse_pair, help="LOW,HIGH concurrent streams (default 256,2048)")
    parser.add_argument("--unary", type=int, help="concurrent non-streaming requests (0: none; default 2048)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default 128)")
    parser.add_argument(
        "--quiet-wait", type=float, help="max seconds to wait for an idle machine before each run"
    )
    parser.add_argument(
        "--engine-cpus",
        default=ENGINE_CPUS,
        help="taskset list for the engine and the load generator (default 0; the load "
        "generator is pinned only to a single CPU)",
    )
    parser.add_argument("--proxy-cpus", default=PROXY_CPUS, help="taskset list for the proxies (default 1)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON and the table go")
    args = parser.parse_args(argv)
    if args.pythonpath:
        args.pythonpath = str(Path(args.pythonpath).resolve())
    profile = _profile(args)
    scenarios = profile.scenarios()
    sides = [args.only] if args.only else list(SIDES)
    pinned = bool(pin_prefix(0)) and (os.cpu_count() or 1) >= 2
    if not pinned:
        args.engine_cpus = args.proxy_cpus = ""

    started = time.time()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="full_path_tokenizer_") as tokenizer_dir:
        tokenizer = smg.write_tokenizer(Path(tokenizer_dir))
        bench = _Bench(args, profile, tokenizer)
        smg_info: dict[str, Any] = {}
        if "smg" in sides:
            bench.smg_executable = smg.ensure_installed()
            smg_info = {"version": smg.smg_version(bench.smg_executable), "argv": "smg launch " + " ".join(
                smg.smg_argv(Path("smg"), 0, "ENGINE", Path("TOKENIZER"), 0)[2:])}  # fmt: skip
        ours_info: dict[str, Any] = {}
        if "ours" in sides:
            bench.processes_flag = _frontend_has_processes(args.pythonpath)
            if args.processes and not bench.processes_flag:
                bench.notes.append(
                    f"--processes {args.processes} asked, but this sidecar-frontend has no such flag"
                )
            code_dir = Path(args.pythonpath) if args.pythonpath else ROOT
            ours_info = {
                "code": args.pythonpath or str(ROOT),
                "git": _git(code_dir),
                "imported_from": _imported_from(args.pythonpath),
                "processes": args.processes if args.processes and bench.processes_flag else None,
            }
        if profile.name == "quick":
            bench.notes.append(
                "quick profile: a smoke run, not the issue's figures (short windows, fewer streams)"
            )
        loadgen = LoadGen(_cpu_list(args.engine_cpus) if pinned else None, module="bench.full_path_loadgen")
        try:
            runs = _run_pairs(bench, loadgen, scenarios, sides)
        finally:
            loadgen.close()
    summary = summarize(runs, scenarios)
    found = targets(summary, scenarios)
    doc: dict[str, Any] = {
        "date": dt.datetime.fromtimestamp(started, dt.UTC).isoformat(timespec="seconds"),
        "profile": profile.name,
        "pairs": profile.pairs,
        "sides": sides,
        "scenarios": [asdict(s) for s in scenarios],
        "request": {
            "endpoint": "POST /generate (SGLang native), same body on both sides",
            "prompt_tokens": PROMPT_TOKENS,
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "example": json.loads(request_body(MODEL, 0, 0, args.max_tokens, True, PROMPT_TOKENS)),
        },
        "pinning": (
            f"engine + load generator on CPU {args.engine_cpus}, proxies on CPU {args.proxy_cpus} (taskset)"
            if pinned
            else "none (taskset or a second core missing)"
        ),
        "engine": "bench/full_path_engine.py (vLLM gRPC stand-in, answers at once, pre-serialized messages)",
        "machine": _machine(),
        "bench_git": _git(ROOT),
        "ours": ours_info,
        "smg": smg_info,
        "summary": summary,
        "targets": [asdict(t) for t in found],
        "runs": runs,
        "notes": bench.notes,
        "elapsed_s": round(time.monotonic() - began, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "full_path" if profile.name == "full" else f"full_path_{profile.name}"
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
    table = markdown(doc)
    (args.out / f"{stem}.md").write_text(table)
    print(table)
    print(f"(took {doc['elapsed_s']} s; results in {args.out}/{stem}.json and .md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
