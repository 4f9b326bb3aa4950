"""CPU per token of both hops (frontend and sidecar) at 256 streams, and their flame graphs.

``python -m bench.pertoken [--rounds N] [--out FILE] [--flame DIR]`` starts what
``bench.frontend`` starts (a fast testkit vLLM engine, one token per chunk, and ``sidecar-vllm``
on CPU 0 with the load generator; two ``sidecar-frontend`` processes on CPU 1, SGLang
incremental and cumulative) and runs only its rows of 256 streams of 128 tokens, reading the
sidecar's CPU in the same window as the frontend's (``bench.http_loadgen``'s ``sidecar_pid``).
The sidecar shares CPU 0 with the engine and the load generator, so its tokens/s is not its
own limit; its CPU per token is.

``--flame DIR``: after the measured rounds, one longer run per format during which py-spy
samples the frontend and the sidecar (``DIR/<format>-{frontend,sidecar}.speedscope.json``,
open them at speedscope.app; py-spy must be installed: it is a dev dependency). A profiled run
is slower (py-spy stops the process for each sample): its figures are not measurements.

``--summarize FILE``: the medians of the runs an ``--out FILE`` collected, as a table.

``--pythonpath DIR``: every started process imports our packages from DIR first (an export of
an older commit), for before/after figures alternated in one sitting.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import plan
from bench.frontend import FORMATS, Bench, Profile
from bench.procs import LoadGen
from bench.procstat import machine_busy_seconds

__all__ = ["main"]


def _row(result: dict[str, Any]) -> dict[str, Any]:
    if "failed" in result:
        raise RuntimeError(str(result["failed"]))
    tokens = result.get("tokens") or 0
    events = result.get("messages") or 0
    cpu = result.get("cpu_s", {})

    def per_token(key: str) -> float | None:
        value = cpu.get(key)
        return None if not tokens or value is None else round(value / tokens * 1e6, 2)

    return {
        "tokens_per_s": round(result.get("tokens_per_s", 0.0), 1),
        "frontend_us_per_token": per_token("hop"),
        "sidecar_us_per_token": per_token("sidecar"),
        "tokens_per_event": round(tokens / events, 2) if events else None,
        "ttft_p50_ms": result.get("ttft_ms", {}).get("p50"),
        "errors": result.get("errors", 0),
        "other_cpu_s": round(cpu.get("other", 0.0), 2),
    }


def _wait_quiet(max_s: float, busy_limit: float = 0.3, probe_s: float = 0.5) -> float:
    """Wait (at most ``max_s``) until the machine is nearly idle (below ``busy_limit`` cores
    busy); the seconds waited. Each run records it; its "other" CPU shows what remained."""
    began = time.monotonic()
    while max_s > 0:
        busy0, _ = machine_busy_seconds()
        time.sleep(probe_s)
        busy1, _ = machine_busy_seconds()
        if (busy1 - busy0) / probe_s < busy_limit or time.monotonic() - began >= max_s:
            break
    return round(time.monotonic() - began, 2)


def _command(bench: Bench, path: str, window: float, warmup: float) -> dict[str, Any]:
    spec = FORMATS[path]
    mode = str(spec["frontend"])
    return {
        "url": bench.urls[mode],
        "format": spec["format"],
        "cumulative": spec["cumulative"],
        "concurrency": 256,
        "max_tokens": 128,
        "warmup_s": warmup,
        "window_s": window,
        "hop_pid": bench.pids[mode],
        "engine_pid": bench.engine_pid,
        "sidecar_pid": bench.pids["sidecar"],
    }


def _flame(bench: Bench, gen: LoadGen, paths: list[str], out: Path, seconds: float) -> None:
    spy = shutil.which("py-spy") or str(Path(plan._script("py-spy")))
    out.mkdir(parents=True, exist_ok=True)
    for path in paths:
        mode = str(FORMATS[path]["frontend"])
        targets = {"frontend": bench.pids[mode], "sidecar": bench.pids["sidecar"]}
        command = _command(bench, path, seconds + 2.0, 1.0)
        # py-spy starts after the warm-up (it reads symbols first) and stops within the window.
        spies = []
        for name, pid in targets.items():
            argv = [
                spy,
                "record",
                "--pid",
                str(pid),
                "--rate",
                "200",
                "--duration",
                f"{seconds:g}",
                "--format",
                "speedscope",
                "--output",
                str(out / f"{path}-{name}.speedscope.json"),
            ]
            spies.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        result = _row(gen.run(command, seconds + 60))
        for spied in spies:
            _, err = spied.communicate(timeout=60)
            if spied.returncode != 0:
                raise RuntimeError(f"py-spy failed: {err.decode(errors='replace')[-500:]}")
        print(f"  flame {path}: {result}", flush=True)


def summarize(path: Path) -> str:
    """A markdown table of the runs in ``path`` (one JSON object a line): per label and
    format, every run's figures and their medians."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = [
        "| label | format | runs | frontend µs/token | sidecar µs/token | tokens/event | other CPU s |",
        "|---|---|---:|---|---|---|---|",
    ]
    keys = dict.fromkeys((r["label"], r["path"]) for r in rows)
    for label, fmt in sorted(keys, key=lambda k: (k[1], k[0])):
        mine = [r for r in rows if (r["label"], r["path"]) == (label, fmt)]

        def cell(key: str, runs: list[dict[str, Any]] = mine) -> str:
            values = [r[key] for r in runs]
            listed = ", ".join(f"{v:g}" for v in values)
            return f"**{statistics.median(values):g}** ({listed})"

        lines.append(
            f"| {label} | {fmt} | {len(mine)} | {cell('frontend_us_per_token')} "
            f"| {cell('sidecar_us_per_token')} | {cell('tokens_per_event')} | {cell('other_cpu_s')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pertoken", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--window", type=float, default=3.0, help="seconds measured per run")
    known = ",".join(FORMATS)
    parser.add_argument("--formats", default=known, help=f"comma-separated, of {known}")
    parser.add_argument("--out", type=Path, help="append the runs, one JSON object a line")
    parser.add_argument("--label", default="", help="recorded with each run (e.g. a commit)")
    parser.add_argument("--flame", type=Path, help="record py-spy flame graphs into this folder")
    parser.add_argument("--flame-seconds", type=float, default=8.0)
    parser.add_argument("--pythonpath", type=Path, help="import our packages from here first")
    parser.add_argument(
        "--quiet-wait", type=float, default=0.0, help="seconds to wait for an idle machine before a run"
    )
    parser.add_argument("--summarize", type=Path, help="print the medians of a runs file, run nothing")
    args = parser.parse_args(argv)
    if args.summarize is not None:
        print(summarize(args.summarize), end="")
        return 0
    paths = [p for p in args.formats.split(",") if p]
    bench = Bench(Profile(rounds=args.rounds, warmup_s=1.0, window_s=args.window, long_window_s=args.window))
    # The load generator is this checkout's (started first); only the measured processes
    # take --pythonpath.
    gen = LoadGen(plan.ENGINE_CORE, module="bench.http_loadgen")
    if args.pythonpath is not None:
        first = str(args.pythonpath.resolve())
        os.environ["PYTHONPATH"] = f"{first}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    runs: list[dict[str, Any]] = []
    try:
        bench.start()
        for round_no in range(args.rounds):
            for path in paths:
                waited = _wait_quiet(args.quiet_wait)
                row = _row(gen.run(_command(bench, path, args.window, 1.0), args.window + 60))
                row["quiet_wait_s"] = waited
                date = time.strftime("%Y-%m-%dT%H:%M:%S")
                row.update(path=path, round=round_no, label=args.label, date=date)
                runs.append(row)
                print(f"  {path}: {row}", flush=True)
        if args.flame is not None:
            _flame(bench, gen, paths, args.flame, args.flame_seconds)
    finally:
        gen.close()
        bench.stop()
    if args.out is not None:
        with args.out.open("a") as f:
            for row in runs:
                f.write(json.dumps(row) + "\n")
    for path in paths:
        mine = [r for r in runs if r["path"] == path]
        if mine:
            fe = statistics.median(r["frontend_us_per_token"] for r in mine)
            sc = statistics.median(r["sidecar_us_per_token"] for r in mine)
            print(f"{path}: median µs/token frontend {fe:.1f}, sidecar {sc:.1f} ({len(mine)} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
