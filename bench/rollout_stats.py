"""The figures of ``bench.rollout`` (pure: result dicts in, values and text out).

A side is one way of putting a router in front of the same fleet: our frontend as one process,
our frontend as two processes on one port (``--processes 2``), and SMG. Each side runs once per
pair; the figures are the median over the pairs with their range, and the ratios are each of
our sides over SMG's within a pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.full_path_stats import cell, spread

__all__ = ["SIDES", "SIDE_NAMES", "Target", "markdown", "ratios", "summarize", "targets"]

SIDES = ("ours-1", "ours-2", "smg")
SIDE_NAMES = {
    "ours-1": "frontend (1 process) + sidecars",
    "ours-2": "frontend (`--processes 2`) + sidecars",
    "smg": "SMG",
}
_SPREAD = (
    "requests_per_s",
    "tokens_per_s",
    "latency_p50_ms",
    "latency_p99_ms",
    "proxy_cpu_us_per_token",
    "frontend_cpu_us_per_token",
    "proxy_cores",
    "other_cores",
    "errors",
)
_RATIOS = ("requests_per_s", "latency_p99_ms", "proxy_cpu_us_per_token")


@dataclass(frozen=True)
class Target:
    name: str
    value: str
    verdict: str  # PASS | MISS | n/a


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per side: each figure's median, min and max over its runs, and its errors by kind summed."""
    summary: dict[str, Any] = {}
    for side in SIDES:
        rows = [r["row"] for r in runs if r["side"] == side]
        if not rows:
            continue
        figures: dict[str, Any] = {"runs": len(rows)}
        for metric in _SPREAD:
            values = [float(r[metric]) for r in rows if isinstance(r.get(metric), int | float)]
            figures[metric] = spread(values)
        kinds: dict[str, int] = {}
        for row in rows:
            for kind, count in row["errors_by_kind"].items():
                kinds[kind] = kinds.get(kind, 0) + int(count)
        figures["errors_by_kind"] = kinds
        figures["errors_total"] = sum(kinds.values())
        summary[side] = figures
    return summary


def ratios(runs: list[dict[str, Any]], side: str, metric: str) -> dict[str, float] | None:
    """``side`` over SMG's for ``metric``, one value per pair that ran both, as a spread."""
    by_pair: dict[int, dict[str, Any]] = {}
    for run in runs:
        by_pair.setdefault(run["pair"], {})[run["side"]] = run["row"].get(metric)
    values = []
    for sides in by_pair.values():
        ours, theirs = sides.get(side), sides.get("smg")
        if isinstance(ours, int | float) and isinstance(theirs, int | float) and theirs:
            values.append(ours / theirs)
    return spread(values)


def targets(summary: dict[str, Any], concurrency: int) -> list[Target]:
    """Issue 28's one target for this benchmark: no error on any of our sides."""
    found = []
    for side in ("ours-1", "ours-2"):
        figures = summary.get(side)
        if figures is None:
            continue
        errors = int(figures["errors_total"])
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(figures["errors_by_kind"].items()))
        found.append(
            Target(
                f"{SIDE_NAMES[side]}, {concurrency:,} concurrent non-streaming requests: no error",
                f"{errors} in {figures['runs']} run(s)" + (f" ({kinds})" if kinds else ""),
                "PASS" if errors == 0 else "MISS",
            )
        )
    return found


def _ratio_text(spread: dict[str, float]) -> str:
    if spread["min"] == spread["max"]:
        return f"{spread['median']:.2f}x"
    return f"{spread['median']:.2f}x ({spread['min']:.2f}-{spread['max']:.2f})"


def markdown(doc: dict[str, Any]) -> str:
    """The result table: one row per side, then our sides over SMG's, then the targets."""
    summary = doc["summary"]
    lines = [
        f"# bench.rollout, {doc['date']} ({doc['profile']}, {doc['pairs']} pair(s))",
        "",
        f"{doc['concurrency']:,} concurrent non-streaming SGLang `/generate` requests (token ids in, "
        f"{doc['request']['prompt_tokens']} prompt ids, {doc['request']['max_tokens']} output tokens), "
        f"each client one rollout session (`{doc['request']['session_header']}`), through each side "
        f"to {doc['engines']} stand-in vLLM gRPC engines. {doc['pinning']}. SMG: "
        f"{(doc.get('smg') or {}).get('version', 'not run')}. Figures: median (min-max) over the runs; "
        "proxy CPU is every process of the side (frontend processes and sidecars, or SMG).",
        "",
        "| side | requests/s | tokens/s | latency p50 / p99 ms | proxy CPU µs/token | frontend CPU µs/token "
        "| proxy cores | errors | other cores |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for side in SIDES:
        figures = summary.get(side)
        if figures is None:
            continue
        errors = (
            "0"
            if not figures["errors_total"]
            else f"**{figures['errors_total']}** ("
            + ", ".join(f"{k} {v}" for k, v in sorted(figures["errors_by_kind"].items()))
            + ")"
        )
        lines.append(
            f"| {SIDE_NAMES[side]} | {cell(figures['requests_per_s'], 1)} "
            f"| {cell(figures['tokens_per_s'])} "
            f"| {cell(figures['latency_p50_ms'])} / {cell(figures['latency_p99_ms'])} "
            f"| {cell(figures['proxy_cpu_us_per_token'], 1)} "
            f"| {cell(figures['frontend_cpu_us_per_token'], 1)} "
            f"| {cell(figures['proxy_cores'], 2)} | {errors} | {cell(figures['other_cores'], 2)} |"
        )
    ratio_lines = []
    for side in ("ours-1", "ours-2"):
        parts = [
            f"{label} {_ratio_text(doc['ratios'][side][metric])}"
            for metric, label in (
                ("requests_per_s", "requests/s"),
                ("latency_p99_ms", "latency p99"),
                ("proxy_cpu_us_per_token", "CPU per token"),
            )
            if doc["ratios"].get(side, {}).get(metric)
        ]
        if parts:
            ratio_lines.append(f"- {SIDE_NAMES[side]} / SMG: " + "; ".join(parts) + ".")
    if ratio_lines:
        lines += ["", *ratio_lines]
    lines += ["", "| target | value | verdict |", "|---|---|---|"]
    lines += [f"| {t['name']} | {t['value']} | {t['verdict']} |" for t in doc["targets"]]
    if doc.get("notes"):
        lines += ["", "Notes:", *(f"- {note}" for note in doc["notes"])]
    return "\n".join(lines) + "\n"
