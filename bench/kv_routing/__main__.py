"""``python -m bench.kv_routing --quick|--full [--policies ...] [--out DIR]`` (bench/README.md,
"KV-cache-aware routing"). Writes ``<out>/kv_routing.json`` and ``<out>/kv_routing.md``."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.kv_routing import micro
from bench.kv_routing.fleet import Completed, Fleet, FleetSpec, features, run_multi_turn, run_shared
from bench.kv_routing.oracle import best_hits
from bench.kv_routing.sim import simulate_multi_turn, simulate_shared
from bench.kv_routing.workloads import MultiTurn, SharedPrefix, multi_turn, shared_prefix

ALL_POLICIES = ("random", "round-robin", "load", "approx", "kv")
RESULTS = Path(__file__).resolve().parent.parent / "results"


@dataclass(frozen=True)
class Profile:
    name: str
    shared: SharedPrefix
    multi: MultiTurn
    fleet: FleetSpec
    micro_prompts: tuple[int, ...]
    micro_workers: tuple[int, ...]
    micro_rounds: int
    memory_blocks: int


def _fleet(capacity_blocks: int, **kw: Any) -> FleetSpec:
    # prefill 40 us per uncached token: a 2,176-token prompt costs 87 ms (about 25k tokens/s
    # across the fleet, a mid-range GPU's prefill), so that at the rate this 2-core machine
    # can drive through the real fleet (60 requests/s, `--full`) the fleet under `load`
    # routing is busy, as the issue asks (about 85 % of the time: its 44 % hits leave ~1,200
    # tokens to prefill a request); at 35 us it is 76 % busy, at 20 us half idle
    # (bench/README.md has all three).
    # One request generated at a time per engine and a short answer, so a worker's time goes
    # mostly to prefill and a miss delays the requests queued behind it, as on a GPU busy with
    # prefills.
    base = FleetSpec(
        workers=4, block_size=16, capacity_blocks=capacity_blocks, prefill_us_per_token=40.0,
        max_num_seqs=1, token_latency_ms=1.0, max_tokens=8,
    )  # fmt: skip
    return replace(base, **kw)


def _half_shared(spec: SharedPrefix, block: int = 16) -> int:
    """Blocks for about half the workload's distinct prefixes."""
    return math.ceil(spec.groups / 2) * math.ceil(spec.prefix_tokens / block)


def _half_multi(spec: MultiTurn, answer: int, block: int = 16) -> int:
    """Blocks for about half the conversations at their full length."""
    full = spec.system_tokens + spec.turns * (spec.user_tokens + answer)
    return math.ceil(spec.conversations / 2) * math.ceil(full / block)


def profile(name: str) -> Profile:
    if name == "smoke":
        shared = SharedPrefix(groups=4, prefix_tokens=64, question_tokens=16, requests=12, rate=50.0)
        multi = MultiTurn(conversations=3, turns=2, system_tokens=64, user_tokens=16, rate=20.0)
        return Profile(name, shared, multi, _fleet(_half_shared(shared), workers=1, max_tokens=4),
                       (256,), (2,), 1, 1_024)  # fmt: skip
    if name == "quick":
        shared = SharedPrefix(groups=16, prefix_tokens=2048, question_tokens=128, requests=240, rate=40.0)
        multi = MultiTurn(conversations=24, turns=4, system_tokens=1024, user_tokens=64, rate=6.0)
        return Profile(name, shared, multi, _fleet(_half_shared(shared)),
                       (1024, 8192, 32768), (4, 16, 64), 3, 100_000)  # fmt: skip
    shared = SharedPrefix(groups=64, prefix_tokens=2048, question_tokens=128, requests=1024, rate=60.0)
    multi = MultiTurn(conversations=64, turns=6, system_tokens=1024, user_tokens=64, rate=8.0)
    return Profile(name, shared, multi, _fleet(_half_shared(shared)),
                   (1024, 2048, 8192, 16384, 32768), (1, 4, 16, 64), 7, 1_000_000)  # fmt: skip


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(
    done: Sequence[Completed], counts: dict[str, int], wall: float, block: int, workers: int
) -> dict[str, Any]:
    ok = [c for c in done if c.error is None]
    prompt = sum(len(c.prompt) for c in ok)
    cached = sum(c.cached_tokens for c in ok)
    ttft = [c.ttft_s * 1e3 for c in ok if c.ttft_s is not None]
    bound = best_hits(((c.prompt, c.output) for c in ok), block)
    per_worker = sorted(counts.values(), reverse=True) + [0] * max(0, workers - len(counts))
    hit = cached / prompt if prompt else 0.0
    return {
        "requests": len(done),
        "errors": len(done) - len(ok),
        "error_samples": sorted({c.error for c in done if c.error is not None})[:3],
        "hit_rate": round(hit, 4),
        "best_hit_rate": round(bound.hit_rate, 4),
        "hit_vs_best": round(hit / bound.hit_rate, 3) if bound.hit_rate else None,
        "ttft_p50_ms": _round(_pct(ttft, 0.5)),
        "ttft_p90_ms": _round(_pct(ttft, 0.9)),
        "output_tokens_per_s": round(sum(len(c.output) for c in ok) / wall, 1) if wall > 0 else None,
        "requests_per_worker": per_worker,
        "spread_max_over_min": round(per_worker[0] / per_worker[-1], 2)
        if per_worker and per_worker[-1]
        else None,
        "wall_s": round(wall, 2),
    }


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def run_fleet(
    prof: Profile, policies: Sequence[str], workloads: Sequence[str], replicas: Sequence[int]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for workload in workloads:
        if workload == "shared":
            fleet_spec = prof.fleet
            requests = shared_prefix(prof.shared)
        else:
            fleet_spec = _multi_spec(prof)
            conversations = multi_turn(prof.multi)
        for n in replicas:
            # Several frontends matter only to the policies with an index: kv shares the
            # workers' map, approx builds one per frontend from its own decisions.
            for policy in policies if n == 1 else [p for p in policies if p in ("kv", "approx")]:
                spec = replace(fleet_spec, replicas=n)
                load_before = _load()
                with Fleet(spec, policy, f"{workload}-{policy}-{n}") as fleet:
                    cpu_before = fleet.cpu_seconds()
                    if workload == "shared":
                        done, counts, wall = asyncio.run(run_shared(fleet, requests))
                    else:
                        done, counts, wall = asyncio.run(run_multi_turn(fleet, conversations))
                    cpu_after = fleet.cpu_seconds()
                row = {
                    "workload": workload,
                    "policy": policy,
                    "replicas": n,
                    **summarize(done, counts, wall, spec.block_size, spec.workers),
                    "load_before": load_before,
                    "load_after": _load(),
                    "capacity_blocks": spec.capacity_blocks,
                    "cpu_s": {role: round(cpu_after[role] - cpu_before[role], 2) for role in cpu_after},
                    "sidecar_events": spec.sidecar_events,
                }
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    return rows


def _multi_spec(prof: Profile) -> FleetSpec:
    return replace(prof.fleet, capacity_blocks=_half_multi(prof.multi, prof.fleet.max_tokens))


def run_sim(prof: Profile, policies: Sequence[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    requests, conversations = shared_prefix(prof.shared), multi_turn(prof.multi)
    for workload in ("shared", "multi"):
        for policy in policies:
            if workload == "shared":
                result = simulate_shared(prof.fleet, policy, requests)
            else:
                result = simulate_multi_turn(_multi_spec(prof), policy, conversations)
            row = {"workload": workload, "policy": policy, "replicas": 1}
            rows.append({**row, **result.row(prof.fleet.block_size)})
    return rows


def run_micro(prof: Profile) -> dict[str, Any]:
    decisions = [
        micro.decision_cost(tokens, workers, rounds=prof.micro_rounds)
        for tokens in prof.micro_prompts
        for workers in prof.micro_workers
    ]
    if (8192, 16) not in {(d["prompt_tokens"], d["workers"]) for d in decisions} and prof.name != "smoke":
        decisions.append(micro.decision_cost(8192, 16, rounds=prof.micro_rounds))
    return {"decisions": decisions, "memory": micro.index_memory(prof.memory_blocks)}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""


def markdown(report: dict[str, Any]) -> str:
    fleet, feats = report["fleet"], report["features"]
    lines = [
        f"# KV-cache-aware routing ({report['profile']}, {report['date']}, commit {report['commit']}, "
        f"load average {report['load_start']} at start)",
        "",
        *([report["note"], ""] if report.get("note") else []),
        f"Fleet: {fleet['workers']} testkit vLLM workers, blocks of {fleet['block_size']}, "
        f"{fleet['prefill_us_per_token']:g} µs prefill per uncached token, {fleet['max_num_seqs']} "
        f"request(s) generated at a time per worker, {fleet['max_tokens']} output tokens at "
        f"{fleet['token_latency_ms']:g} ms. Policies the frontend offers: {', '.join(feats['policies'])}; "
        f"sidecar KV flags: {', '.join(feats['sidecar_kv_flags']) or 'none'}.",
        "",
        "| workload | policy | frontends | hit rate | best | kv/best | TTFT p50 ms | TTFT p90 ms | out tok/s "
        "| requests per worker | max/min | errors | load before→after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["fleet_runs"]:
        cells = [
            r["workload"], r["policy"], r["replicas"], f"{r['hit_rate']:.1%}", f"{r['best_hit_rate']:.1%}",
            r["hit_vs_best"], r["ttft_p50_ms"], r["ttft_p90_ms"], r["output_tokens_per_s"],
            " / ".join(map(str, r["requests_per_worker"])), r["spread_max_over_min"], r["errors"],
            f"{r['load_before'][0]}→{r['load_after'][0]}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    if report.get("sim_runs"):
        lines += [
            "",
            "Simulated (`sim.py`: the same workloads and fleet, the real router, no processes):",
            "",
            "| workload | policy | hit rate | best | kv/best | TTFT p50 ms | TTFT p90 ms | out tok/s "
            "| requests per worker | max/min |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in report["sim_runs"]:
            cells = [
                r["workload"], r["policy"], f"{r['hit_rate']:.1%}", f"{r['best_hit_rate']:.1%}",
                r["hit_vs_best"], r["ttft_p50_ms"], r["ttft_p90_ms"], r["output_tokens_per_s"],
                " / ".join(map(str, r["requests_per_worker"])), r["spread_max_over_min"],
            ]  # fmt: skip
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    if report.get("micro"):
        lines += [
            "",
            "Routing decision, CPU µs per call (min over rounds): the whole `Router.choose` of a "
            "request message's prompt (`prompt_of`, as the frontend routes), its keys "
            "(`block_keys`) and its walk (`BlockIndex.match`); and `Router.choose` given the "
            "token ids as a Python list instead (reading 8,192 Python ints costs about 57 µs); "
            "`Router.choose` with routing approx (it also stores the prompt's blocks, and expires "
            "an earlier store)",
            "",
            "| prompt tokens | workers | choose | keys | walk | choose from a list | choose, approx |",
            "|---|---|---|---|---|---|---|",
        ]
        for d in report["micro"]["decisions"]:
            cells = [
                d["prompt_tokens"],
                d["workers"],
                d["choose_us"],
                d["keys_us"],
                d["walk_us"],
                d.get("choose_from_list_us", "-"),
                d.get("approx_choose_us", "-"),
            ]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        m = report["micro"]["memory"]
        lines += [
            "",
            f"Index memory per million blocks ({m['blocks']} measured, one holder each): "
            f"{m['tracemalloc_mib_per_million']} MiB by tracemalloc, "
            f"{m['estimate_mib_per_million']} MiB by the index's own estimate.",
        ]
    lines += ["", "Targets:", ""] + [f"- {t}" for t in report["targets"]]
    return "\n".join(lines) + "\n"


def _verdict(met: bool) -> str:
    return "MET" if met else "MISSED"


def targets(report: dict[str, Any]) -> list[str]:
    """One line per target of issue 20: MET, MISSED or NOT RUN, with the figures; the fleet's
    first, then the simulation's (prefixed "sim")."""
    out = _targets(report["fleet_runs"], report.get("micro", {}).get("decisions", []), "")
    if report.get("sim_runs"):
        out += _targets(report["sim_runs"], [], "sim: ", replicas=False)
    return out


def _targets(
    rows: list[dict[str, Any]], decisions: list[dict[str, Any]], prefix: str, replicas: bool = True
) -> list[str]:
    out: list[str] = []
    runs = {(r["workload"], r["policy"], r["replicas"]): r for r in rows}
    for workload in ("shared", "multi"):
        kv = runs.get((workload, "kv", 1))
        if kv is not None and kv["hit_vs_best"] is not None:
            out.append(
                f"{_verdict(kv['hit_vs_best'] >= 0.9)}: {workload}: kv hit rate {kv['hit_rate']:.1%}, "
                f"best {kv['best_hit_rate']:.1%} (target: at least 90 % of best)"
            )
        else:
            out.append(f"NOT RUN: {workload}: kv hit rate within 10 % of best")
    kv, load = runs.get(("shared", "kv", 1)), runs.get(("shared", "load", 1))
    if kv and load and kv["ttft_p90_ms"] and load["ttft_p90_ms"]:
        ratio = load["ttft_p90_ms"] / kv["ttft_p90_ms"]
        out.append(
            f"{_verdict(ratio >= 3)}: shared: TTFT p90 of load / of kv = {ratio:.2f} (target: 3 or more)"
        )
    else:
        out.append("NOT RUN: shared: TTFT p90 of kv 3x better than load")
    for (workload, policy, n), r in sorted(runs.items()):
        if policy == "kv":
            s = r["spread_max_over_min"]
            out.append(
                f"{_verdict(s is not None and s <= 1.5)}: {workload}, kv, {n} frontend(s): "
                f"busiest / least busy worker's requests = {s} (target: 1.5 at most)"
            )
    for d in decisions:
        if d["prompt_tokens"] == 8192 and d["workers"] == 16:
            out.append(
                f"{_verdict(d['choose_us'] < 100)}: a decision for 8,192 tokens over 16 workers "
                f"costs {d['choose_us']} µs (target: under 100)"
            )
    for workload in ("shared", "multi") if replicas else ():
        one, two = runs.get((workload, "kv", 1)), runs.get((workload, "kv", 2))
        if one and two:
            out.append(
                f"{_verdict(two['hit_rate'] >= one['hit_rate'] * 0.99)}: {workload}, kv: two frontends "
                f"{two['hit_rate']:.1%} hit rate, one {one['hit_rate']:.1%} (target: no hits lost)"
            )
        elif workload == "shared":
            out.append("NOT RUN: two frontend replicas lose no hits against one")
    return [line.replace(": ", ": " + prefix, 1) if prefix else line for line in out]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_routing", description=__doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="profile", const="quick")
    size.add_argument("--full", action="store_const", dest="profile", const="full")
    size.add_argument(
        "--smoke", action="store_const", dest="profile", const="smoke", help="tiny: for the test"
    )
    parser.add_argument(
        "--policies", default=",".join(ALL_POLICIES), help="comma-separated (unavailable ones are skipped)"
    )
    parser.add_argument("--workloads", default="shared,multi")
    parser.add_argument("--replicas", default="1", help="frontend counts to run, comma-separated (e.g. 1,2)")
    parser.add_argument("--no-micro", action="store_true")
    parser.add_argument(
        "--no-sidecar-events",
        action="store_true",
        help="sidecars not subscribed to KV events (A/B of their cost)",
    )
    parser.add_argument("--no-fleet", action="store_true")
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=None,
        help="the engines' simulated prefill per uncached prompt token (default: the profile's)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for kv_routing.{json,md}")
    parser.add_argument("--name", default="kv_routing", help="file name stem")
    parser.add_argument(
        "--note", default="", help="a line for the report (e.g. where the code under test came from)"
    )
    args = parser.parse_args(argv)
    prof = profile(args.profile or "quick")
    if args.no_sidecar_events:
        prof = replace(prof, fleet=replace(prof.fleet, sidecar_events=False))
    if args.prefill_us_per_token is not None:
        prof = replace(prof, fleet=replace(prof.fleet, prefill_us_per_token=args.prefill_us_per_token))
    feats = features()
    wanted = [p for p in args.policies.split(",") if p]
    policies = [p for p in wanted if p in feats["policies"]]
    skipped = [p for p in wanted if p not in policies]
    report: dict[str, Any] = {
        "profile": prof.name,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load_start": _load()[0],
        "note": args.note,
        "features": feats,
        "skipped_policies": skipped,
        "fleet": asdict(prof.fleet),
        "workloads": {"shared": asdict(prof.shared), "multi": asdict(prof.multi)},
        "fleet_runs": [],
    }
    report["sim_runs"] = run_sim(prof, [p for p in wanted if p in ALL_POLICIES])
    if not args.no_micro:
        report["micro"] = run_micro(prof)
    if not args.no_fleet:
        report["fleet_runs"] = run_fleet(
            prof,
            policies,
            [w for w in args.workloads.split(",") if w],
            [int(n) for n in args.replicas.split(",")],
        )
    report["load_end"] = _load()[0]
    report["targets"] = targets(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
