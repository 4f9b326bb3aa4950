"""Run one test many times while other processes keep every core busy, and record each outcome.

    python -m tools.repeat_under_load \\
        tests/process/test_fleet_faults.py::test_kill_and_drain_under_300_streams_then_restart \\
        --runs 100 --hogs 3 --out docs/results/kill_and_drain_under_load.json

A failure that shows once in tens of runs, and only when the machine is starved (as the
frontend's silent exit under load did), needs this: each run is a fresh pytest process with
``--hogs`` busy-looping processes beside it for its whole length. The JSON file lists every
run (passed or not, seconds, the last lines of a failed run's output) and the totals; the
command exits 1 when any run failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _hog() -> None:  # pragma: no cover - runs in a child, killed by the parent
    while True:
        pass


def run_once(test: str, hogs: int, timeout: float) -> dict[str, Any]:
    children = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(hogs)]
    for child in children:
        child.start()
    began = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", test],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        code, output = -1, f"timed out after {timeout} s"
    finally:
        for child in children:
            child.kill()
            child.join()
    result: dict[str, Any] = {"passed": code == 0, "seconds": round(time.monotonic() - began, 1)}
    if code != 0:
        result["exit"] = code
        result["tail"] = output.splitlines()[-200:]
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test", help="the pytest node id to run")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--hogs", type=int, default=3, help="busy-looping processes during each run")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file of results")
    args = parser.parse_args(argv)
    runs: list[dict[str, Any]] = []
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for number in range(1, args.runs + 1):
        result = run_once(args.test, args.hogs, args.timeout)
        runs.append(result)
        failed = sum(not r["passed"] for r in runs)
        print(
            f"run {number}/{args.runs}: {'passed' if result['passed'] else 'FAILED'} "
            f"in {result['seconds']} s ({failed} failed so far)",
            flush=True,
        )
        summary = {
            "test": args.test,
            "hogs": args.hogs,
            "runs": len(runs),
            "failed": failed,
            "started": started,
            "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "results": runs,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if any(not r["passed"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
