"""``python -m bench.overload [--quick] [--duration S]``: the frontend under overload (issue 27).

A fleet on loopback: three testkit vLLM engines of a realistic, small capacity (a decode step
that grows with the running batch, a bounded engine queue), each behind its ``sidecar-vllm``,
and one ``sidecar-frontend`` over them, run twice in turn: with its defaults (admission on)
and with ``--no-admission`` (every request straight to a worker, the frontend's former
behaviour). A frontend without admission yet is run once, as "off".

Per configuration: a calibration (closed loop, exactly the fleet's running slots) that checks
the capacity computed from the engine settings; the quiet tenant alone on the idle fleet (the
TTFT baseline); then two scenarios at 0.5, 1, 2, 4 and 8 times the capacity (``--quick``: 1
and 4): *flood*, a flooding tenant's Poisson arrivals while a quiet tenant (its own header
value) sends one streamed request a second, and *priority*, the same with 5 % of the flood's
requests high priority (vLLM's ``priority: -1``).

``--pythonpath DIR`` runs every process of the fleet from another checkout's code (an export
of a commit, first on their ``PYTHONPATH``): figures before and after a change, or a stable
commit while the working tree is being edited.

Results: ``bench/results/overload/overload_<date>_<commit>[_quick][_runN].json`` and ``.md`` (or
``--out DIR``), with PASS/FAIL per row for the issue's targets. bench/README.md, "Overload",
says why the fleet is shaped as it is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import json
import os
import random
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.__main__ import _git, _machine, _wait_quiet
from bench.overload_client import HIGH_PRIORITY, TENANT_HEADER, Client, RequestShape
from bench.overload_fleet import CpuMeter, Fleet, QueuePoller, frontend_flags
from bench.overload_plan import (
    FULL,
    QUICK,
    QUIET,
    Arrival,
    FleetShape,
    Profile,
    Scenario,
    schedule,
    steady_times,
)
from bench.overload_stats import compare, evaluate, markdown, summarize_level

__all__ = ["main", "run"]

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "overload"


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The client's own cyclic collector off while it measures a level: a pass (26-42 ms at 8x,
    seen with a ``gc.callbacks`` hook) stops the loop that reads first tokens, and would count as
    the frontend's latency. A level's garbage is a few MB; it is collected when the level ends."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


SCENARIOS: tuple[Scenario, ...] = ("flood", "priority")
# Past these, a level may be measuring this machine's CPU rather than the frontend (a note
# says which level): the whole machine in cores, the client's own process, its sending lag.
_BUSY_MACHINE_CORES = 1.4
_BUSY_CLIENT_CORES = 0.7
_LATE_DISPATCH_MS = 20.0
_CALIBRATION_WARMUP_S = 1.0
# After a level's last arrival, a request with no answer after this many service times leaves.
ANSWER_GRACE_SERVICES = 2.0  # the closed loop's streams start over its first second


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class _Config:
    """One frontend configuration's runs, inside one event loop."""

    def __init__(
        self, fleet: Fleet, profile: Profile, admission: bool, seed: int, quiet_wait_s: float
    ) -> None:
        self.fleet = fleet
        self.quiet_wait_s = quiet_wait_s
        self.profile = profile
        self.shape = fleet.shape
        self.seed = seed
        self.request = RequestShape(
            self.shape.prompt_tokens, self.shape.output_tokens, send_priority=admission
        )
        # Long enough for a request at the back of a full engine queue (admission off) to start.
        self.answer_grace_s = ANSWER_GRACE_SERVICES * self.shape.service_secs

    async def run(self) -> dict[str, Any]:
        async with (
            QueuePoller(self.fleet.sidecars) as poller,
            Client(self.fleet.url, self.request, self.seed) as client,
        ):
            calibration = await self._calibrate(client)
            _progress(f"  calibration: {calibration['measured_rps']} requests/s "
                      f"(computed {calibration['computed_rps']})")  # fmt: skip
            quiet = steady_times(self.profile.quiet_rps, self.profile.baseline_s, 0.0)
            baseline = await self._level(client, poller, [Arrival(t, QUIET) for t in quiet],
                                         self.profile.baseline_s, warmup_s=0.0)  # fmt: skip
            _progress(f"  idle: quiet TTFT {baseline['by_kind'][QUIET]}")
            rows: list[dict[str, Any]] = []
            for scenario in SCENARIOS:
                for load in self.profile.loads:
                    flood_rps = load * self.shape.capacity_rps
                    rng = random.Random(f"{self.seed}|{scenario}|{load}")
                    arrivals = schedule(flood_rps, self.profile.quiet_rps, self.profile.duration_s, scenario,
                                        self.profile.high_fraction, rng)  # fmt: skip
                    row = await self._level(
                        client, poller, arrivals, self.profile.duration_s, self.profile.warmup_s
                    )
                    row = {"scenario": scenario, "load": load, "flood_rps": round(flood_rps, 2), **row}
                    rows.append(row)
                    _progress(_line(row))
        return {"calibration": calibration, "baseline": baseline, "rows": rows}

    async def _calibrate(self, client: Client) -> dict[str, Any]:
        duration = self.profile.calibration_s
        warmup = min(_CALIBRATION_WARMUP_S, duration / 2)
        meter = CpuMeter(self.fleet.pids())
        meter.start(time.perf_counter())
        outcomes = await client.closed_loop(self.shape.slots, duration, (warmup, duration))
        cpu = meter.read(time.perf_counter())
        tokens = sum(o.tokens_in_window for o in outcomes)
        measured = tokens / (duration - warmup) / self.shape.output_tokens
        return {
            "streams": self.shape.slots,
            "computed_rps": round(self.shape.capacity_rps, 2),
            "measured_rps": round(measured, 2),
            "measured_over_computed": round(measured / self.shape.capacity_rps, 3),
            "requests": len(outcomes),
            "not_completed": sum(not o.completed for o in outcomes),
            "cpu_cores": cpu,
        }

    async def _level(
        self, client: Client, poller: QueuePoller, arrivals: list[Arrival], duration_s: float, warmup_s: float
    ) -> dict[str, Any]:
        """One level: the arrivals, CPU read over the measured window, the engines' queues over
        the whole level (its drain included)."""
        waited = await asyncio.to_thread(_wait_quiet, self.quiet_wait_s)
        poller.take()
        meter = CpuMeter(self.fleet.pids())
        t0 = time.perf_counter()
        window = (warmup_s, duration_s)

        async def measure_cpu() -> dict[str, float]:
            await asyncio.sleep(max(0.0, t0 + window[0] - time.perf_counter()))
            meter.start(time.perf_counter())
            await asyncio.sleep(max(0.0, t0 + window[1] - time.perf_counter()))
            return meter.read(time.perf_counter())

        cpu_task = asyncio.create_task(measure_cpu())
        with _collector_paused():
            outcomes = await client.open_loop(arrivals, t0, window, self.answer_grace_s, self.profile.drain_s)
        cpu = await cpu_task
        marks = poller.take()
        row = summarize_level(outcomes, window)
        row.update({
            "elapsed_s": round(time.perf_counter() - t0, 1),
            "quiet_wait_s": waited,
            "engine_queue_hwm": marks["waiting"],
            "engine_running_hwm": marks["running"],
            "engine_queue_bound": self.shape.engine_queue,
            "failed_load_polls": marks["failed_polls"],
            "cpu_cores": cpu,
        })  # fmt: skip
        return row


def _line(row: dict[str, Any]) -> str:
    quiet = row["by_kind"].get(QUIET, {})
    high = row["by_kind"].get("high")
    high_text = f", high p99 {high['ttft_p99_ms']} ms" if high else ""
    return (
        f"  {row['scenario']} {row['load']:g}x: quiet TTFT p50/p99 {quiet.get('ttft_p50_ms')}/"
        f"{quiet.get('ttft_p99_ms')} ms{high_text}, goodput {row['goodput_tokens_per_s']} tokens/s, "
        f"refusals {row['refusals']}, lost {row['lost']}, queue {row['engine_queue_hwm']}, "
        f"machine {row['cpu_cores']['machine']} cores, took {row['elapsed_s']} s"
    )


def _saturation_notes(config: str, result: dict[str, Any]) -> list[str]:
    """Levels where this machine, not the frontend, may have set the figures: the machine busy
    (the benchmark's own processes or something else), the client's process busy, or the
    client sending late."""
    notes = []
    for row in result["rows"]:
        cpu = row["cpu_cores"]
        lag = row["dispatch_lag_p99_ms"] or 0.0
        if (
            cpu["machine"] > _BUSY_MACHINE_CORES
            or cpu["client"] > _BUSY_CLIENT_CORES
            or lag > _LATE_DISPATCH_MS
        ):
            notes.append(
                f"{config} {row['scenario']} {row['load']:g}x: machine {cpu['machine']} cores busy, "
                f"{cpu['benchmark']} of them the benchmark's, {cpu['other']} something else's; client "
                f"{cpu['client']}, dispatch lag p99 {lag} ms: latencies may carry this machine's contention"
            )
    return notes


def run(
    profile: Profile,
    shape: FleetShape,
    configs: list[str],
    seed: int,
    quiet_wait_s: float = 0.0,
    admission_flags: Sequence[str] = (),
) -> dict[str, Any]:
    fleet = Fleet(shape)
    results: dict[str, Any] = {}
    try:
        fleet.start_workers()
        for config in configs:
            argv = fleet.start_frontend(config == "on", admission_flags if config == "on" else ())
            _progress(f"admission {config}: {' '.join(argv[1:])}")
            try:
                result = asyncio.run(_Config(fleet, profile, config == "on", seed, quiet_wait_s).run())
            finally:
                fleet.stop_frontend()
            results[config] = {"frontend_argv": argv[1:], **result}
    finally:
        fleet.stop()
    return results


def _result_name(date: str, commit: str, profile: Profile) -> str:
    suffix = "" if profile.name == "full" else f"_{profile.name}"
    return f"overload_{date}_{commit[:7]}{suffix}"


def _free_name(directory: Path, name: str) -> str:
    """``name``, or ``name_run2``, ``_run3``...: a second run of the same commit on the same day
    (another ``--admission-flags``, or the same again) never overwrites the first one's files."""
    taken = {p.stem for p in directory.glob(f"{name}*")}
    if name not in taken:
        return name
    run = 2
    while f"{name}_run{run}" in taken:
        run += 1
    return f"{name}_run{run}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: short levels at 1x and 4x")
    parser.add_argument(
        "--duration", type=float, help="seconds of arrivals per load level (full: 16, quick: 3)"
    )
    parser.add_argument("--loads", type=lambda v: tuple(float(x) for x in v.split(",")),
                        help="load levels as multiples of capacity, comma-separated")  # fmt: skip
    parser.add_argument(
        "--configs",
        type=lambda v: v.split(","),
        default=None,
        help="on,off (default: on,off if the frontend has --no-admission, else off)",
    )
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--quiet-wait", type=float, default=0.0,
                        help="before each level, wait at most this long for a nearly idle machine "
                        "(default 0; each level records its wait)")  # fmt: skip
    parser.add_argument("--admission-flags", type=shlex.split, default=[],
                        help="more flags for the admission-on frontend, e.g. '--max-queue-depth 64' "
                        "(default: none, its defaults)")  # fmt: skip
    parser.add_argument("--pythonpath", help="run the fleet's processes from this checkout's code "
                        "(an export of another commit), put first on their PYTHONPATH")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the .json and .md go")
    args = parser.parse_args(argv)

    if args.pythonpath:
        # Every child process inherits it; the installed console scripts then import its code.
        os.environ["PYTHONPATH"] = args.pythonpath
    profile = QUICK if args.quick else FULL
    if args.duration:
        profile = replace(
            profile, duration_s=args.duration, warmup_s=min(profile.warmup_s, args.duration / 4)
        )
    if args.loads:
        profile = replace(profile, loads=args.loads)
    shape = FleetShape()
    admission = "--no-admission" in frontend_flags()
    configs = args.configs or (["on", "off"] if admission else ["off"])
    if not set(configs) <= {"on", "off"}:
        parser.error("--configs takes on, off or on,off")
    notes = []
    if not admission:
        notes.append(
            "the frontend has no --no-admission yet: it runs as today's frontend, admission off only"
        )
        configs = [c for c in configs if c == "off"] or ["off"]
    notes.append(
        f"high-priority requests carry vLLM's priority {HIGH_PRIORITY} with admission on; with it off they "
        "carry none (nothing would read it, and sidecar-vllm refuses a priority the vLLM wire cannot carry)"
    )
    started = time.monotonic()
    code = _git()
    date = dt.datetime.now(dt.UTC)
    results = run(profile, shape, configs, args.seed, args.quiet_wait, args.admission_flags)
    targets = [
        t for config, result in results.items() for t in evaluate(config, result["rows"], result["baseline"])
    ]
    for config, result in results.items():
        notes += _saturation_notes(config, result)
    doc: dict[str, Any] = {
        "date": date.isoformat(timespec="seconds"),
        "git": code,
        "machine": _machine(),
        "profile": asdict(profile),
        "fleet": {
            **asdict(shape),
            "capacity_rps": round(shape.capacity_rps, 2),
            "service_secs": round(shape.service_secs, 3),
            "engine_idle_ttft_ms": round(shape.idle_ttft_secs * 1000, 1),
            "max_num_queued_reqs": shape.max_num_queued_reqs,
        },
        "pythonpath": args.pythonpath,
        "tenant_header": TENANT_HEADER,
        "admission_available": admission,
        "calibrated_rps": {config: r["calibration"]["measured_rps"] for config, r in results.items()},
        "configs": results,
        "targets": [asdict(t) for t in targets],
        "comparison": compare(results["on"]["rows"], results["off"]["rows"]) if len(results) == 2 else [],
        "notes": notes,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = _free_name(args.out, _result_name(date.strftime("%Y-%m-%d"), code["commit"], profile))
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = markdown(doc)
    (args.out / f"{name}.md").write_text(text)
    print(text)
    print(f"(took {doc['elapsed_s']} s; results in {args.out / name}.json and .md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
