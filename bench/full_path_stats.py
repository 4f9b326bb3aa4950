"""The figures of ``bench.full_path``: per run, per scenario across pairs, ours over SMG's, the
targets of issue 29's "Must show" that this benchmark measures, and the Markdown table (pure:
result dicts in, values and text out).

A pair is one run of each side of one scenario, back to back; a ratio is ours / SMG's within a
pair, and a scenario's ratio is the median over its pairs (the range is shown beside it).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SIDES",
    "Scenario",
    "Target",
    "cell",
    "markdown",
    "pair_ratios",
    "run_row",
    "spread",
    "summarize",
    "targets",
]

SIDES = ("ours", "smg")
SIDE_NAMES = {"ours": "frontend + sidecar", "smg": "SMG"}
# Ours / SMG's, wanted at most (CPU per token) or at least (throughput).
CPU_RATIO_MAX = 1.5
THROUGHPUT_RATIO_MIN = 1.0


@dataclass(frozen=True)
class Scenario:
    name: str
    stream: bool
    concurrency: int
    warmup_s: float
    window_s: float

    @property
    def label(self) -> str:
        kind = "concurrent streams" if self.stream else "concurrent non-streaming requests"
        return f"{self.concurrency:,} {kind}"


@dataclass(frozen=True)
class Target:
    name: str
    value: str
    verdict: str  # PASS | MISS | n/a


def _per_token_us(seconds: float | None, tokens: int) -> float | None:
    return None if seconds is None or not tokens else round(seconds / tokens * 1e6, 2)


def run_row(result: dict[str, Any], proxies: list[str]) -> dict[str, Any]:
    """One run's figures: throughput, CPU per token of the side's proxies (together and each),
    the cores they used, latencies, errors by kind."""
    tokens = int(result["tokens"])
    window = float(result["window_s"])
    cpu = result["cpu_s"]
    proxy_cpu = sum(float(cpu.get(name, 0.0)) for name in proxies)
    errors: dict[str, int] = dict(result.get("errors") or {})
    return {
        "tokens_per_s": round(float(result["tokens_per_s"]), 1),
        "requests_per_s": round(float(result["requests_per_s"]), 2),
        "proxy_cpu_us_per_token": _per_token_us(proxy_cpu, tokens),
        "proxy_cpu_us_per_token_by_process": {name: _per_token_us(cpu.get(name), tokens) for name in proxies},
        "proxy_cores": round(proxy_cpu / window, 3) if window else None,
        "engine_cpu_us_per_token": _per_token_us(cpu.get("engine"), tokens),
        "client_cpu_us_per_token": _per_token_us(cpu.get("client"), tokens),
        "load_side_cores": round((float(cpu.get("engine", 0.0)) + float(cpu.get("client", 0.0))) / window, 3)
        if window
        else None,
        "other_cores": round((float(cpu.get("other", 0.0)) + float(cpu.get("steal", 0.0))) / window, 3)
        if window
        else None,
        "ttft_p50_ms": result["ttft_ms"]["p50"],
        "ttft_p99_ms": result["ttft_ms"]["p99"],
        "latency_p50_ms": result["latency_ms"]["p50"],
        "latency_p99_ms": result["latency_ms"]["p99"],
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
        "clients_with_errors": result.get("clients_with_errors", 0),
        "first_error_s": result.get("first_error_s"),
        "waiting_at_close": result.get("waiting_at_close", 0),
        "proxy_peak_rss_kib": result.get("proxy_peak_rss_kib", {}),
    }


_SPREAD = (
    "tokens_per_s",
    "requests_per_s",
    "proxy_cpu_us_per_token",
    "proxy_cores",
    "load_side_cores",
    "other_cores",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "latency_p99_ms",
    "errors",
)
_RATIOS = ("tokens_per_s", "requests_per_s", "proxy_cpu_us_per_token", "ttft_p99_ms", "latency_p99_ms")


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def pair_ratios(runs: list[dict[str, Any]], scenario: str, metric: str) -> list[float]:
    """Ours / SMG's for ``metric``, one value per pair that ran both sides of ``scenario``."""
    by_pair: dict[int, dict[str, Any]] = {}
    for run in runs:
        if run["scenario"] == scenario:
            by_pair.setdefault(run["pair"], {})[run["side"]] = run["row"].get(metric)
    ratios = []
    for sides in by_pair.values():
        ours, theirs = sides.get("ours"), sides.get("smg")
        if isinstance(ours, int | float) and isinstance(theirs, int | float) and theirs:
            ratios.append(round(ours / theirs, 3))
    return ratios


def summarize(runs: list[dict[str, Any]], scenarios: list[Scenario]) -> dict[str, Any]:
    """Per scenario: each side's figures (median, min, max over its runs), its errors by kind
    summed over the runs, and the ratios ours / SMG's (median and range over the pairs)."""
    summary: dict[str, Any] = {}
    for scenario in scenarios:
        entry: dict[str, Any] = {"label": scenario.label, "sides": {}, "ratios": {}}
        for side in SIDES:
            rows = [r["row"] for r in runs if r["scenario"] == scenario.name and r["side"] == side]
            if not rows:
                continue
            figures: dict[str, Any] = {"runs": len(rows)}
            for metric in _SPREAD:
                figures[metric] = spread(
                    [float(r[metric]) for r in rows if isinstance(r.get(metric), int | float)]
                )
            by_process: dict[str, list[float]] = {}
            for row in rows:
                for name, value in row["proxy_cpu_us_per_token_by_process"].items():
                    if isinstance(value, int | float):
                        by_process.setdefault(name, []).append(float(value))
            figures["proxy_cpu_us_per_token_by_process"] = {n: spread(v) for n, v in by_process.items()}
            kinds: dict[str, int] = {}
            for row in rows:
                for kind, count in row["errors_by_kind"].items():
                    kinds[kind] = kinds.get(kind, 0) + int(count)
            figures["errors_by_kind"] = kinds
            figures["errors_total"] = sum(kinds.values())
            entry["sides"][side] = figures
        for metric in _RATIOS:
            values = pair_ratios(runs, scenario.name, metric)
            if values:
                entry["ratios"][metric] = spread(values)
        summary[scenario.name] = entry
    return summary


def _median_ratio(summary: dict[str, Any], scenario: str, metric: str) -> dict[str, float] | None:
    spread: dict[str, float] | None = summary.get(scenario, {}).get("ratios", {}).get(metric)
    return spread


def _range_text(spread: dict[str, float]) -> str:
    if spread["min"] == spread["max"]:
        return f"{spread['median']:.2f}x"
    return f"{spread['median']:.2f}x (pairs {spread['min']:.2f}-{spread['max']:.2f})"


def targets(summary: dict[str, Any], scenarios: list[Scenario]) -> list[Target]:
    """Issue 29's targets this benchmark measures: CPU per token at the low stream count within
    1.5 x SMG's; at the high stream count and for non-streaming requests, no error on our side
    and throughput at least SMG's. A ratio with no SMG run to compare is n/a."""
    found: list[Target] = []
    streams = sorted((s for s in scenarios if s.stream), key=lambda s: s.concurrency)
    unary = [s for s in scenarios if not s.stream]
    if streams:
        low = streams[0]
        ratio = _median_ratio(summary, low.name, "proxy_cpu_us_per_token")
        found.append(
            Target(
                f"CPU per token of frontend + sidecar at {low.label}: at most {CPU_RATIO_MAX}x SMG's",
                _range_text(ratio) if ratio else "no SMG run",
                "n/a" if ratio is None else ("PASS" if ratio["median"] <= CPU_RATIO_MAX else "MISS"),
            )
        )
    for scenario in ([streams[-1]] if len(streams) > 1 else []) + unary:
        ours = summary.get(scenario.name, {}).get("sides", {}).get("ours")
        if ours is None:
            continue
        errors = int(ours["errors_total"])
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(ours["errors_by_kind"].items()))
        found.append(
            Target(
                f"{scenario.label}: zero errors on our side",
                f"{errors} in {ours['runs']} run(s)" + (f" ({kinds})" if kinds else ""),
                "PASS" if errors == 0 else "MISS",
            )
        )
        ratio = _median_ratio(summary, scenario.name, "tokens_per_s")
        found.append(
            Target(
                f"{scenario.label}: tokens/s at least SMG's",
                _range_text(ratio) if ratio else "no SMG run",
                "n/a" if ratio is None else ("PASS" if ratio["median"] >= THROUGHPUT_RATIO_MIN else "MISS"),
            )
        )
    return found


def cell(spread: dict[str, float] | None, digits: int = 0) -> str:
    if spread is None:
        return "-"
    fmt = f"{{:,.{digits}f}}"
    low, mid, high = (fmt.format(spread[k]) for k in ("min", "median", "max"))
    return mid if low == high else f"{mid} ({low}-{high})"


def _errors_cell(figures: dict[str, Any]) -> str:
    if not figures["errors_total"]:
        return "0"
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(figures["errors_by_kind"].items()))
    return f"**{figures['errors_total']}** ({kinds})"


def markdown(doc: dict[str, Any]) -> str:
    """The result table: one block per scenario (each side's medians with the range over its
    runs, then the ratio ours / SMG's), then one PASS/MISS line per target."""
    scenarios = [Scenario(**s) for s in doc["scenarios"]]
    ours = doc.get("ours") or {}
    ours_text = (
        f"`sidecar-frontend` + `sidecar-vllm` from `{ours['code']}`"
        + (f", `--processes {ours['processes']}`" if ours.get("processes") else "")
        if ours
        else "not run"
    )
    lines = [
        f"# bench.full_path, {doc['date']} ({doc['profile']}, {doc['pairs']} pair(s))",
        "",
        f"Ours: {ours_text}; SMG: {(doc.get('smg') or {}).get('version', 'not run')}. {doc['pinning']}. "
        "Each request: "
        f"{doc['request']['prompt_tokens']} prompt ids, {doc['request']['max_tokens']} output tokens, "
        "SGLang `/generate` on both sides. Figures: median (min-max) over the runs; CPU per token is the "
        "side's proxy processes only.",
        "",
    ]
    for scenario in scenarios:
        entry = doc["summary"].get(scenario.name)
        if not entry:
            continue
        lines += [
            f"## {scenario.label} ({scenario.warmup_s:g} s warm-up, {scenario.window_s:g} s window)",
            "",
            "| side | tokens/s | requests/s | proxy CPU µs/token | by process | proxy cores "
            "| TTFT p50 / p99 ms | latency p99 ms | errors | load side cores | other cores |",
            "|---|---:|---:|---:|---|---:|---:|---:|---|---:|---:|",
        ]
        for side in SIDES:
            figures = entry["sides"].get(side)
            if figures is None:
                continue
            by_process = ", ".join(
                f"{name} {cell(spread, 1)}"
                for name, spread in figures["proxy_cpu_us_per_token_by_process"].items()
            )
            ttft = (
                f"{cell(figures['ttft_p50_ms'])} / {cell(figures['ttft_p99_ms'])}" if scenario.stream else "-"
            )
            lines.append(
                f"| {SIDE_NAMES[side]} | {cell(figures['tokens_per_s'])} "
                f"| {cell(figures['requests_per_s'], 1)} "
                f"| {cell(figures['proxy_cpu_us_per_token'], 1)} | {by_process} "
                f"| {cell(figures['proxy_cores'], 2)} | {ttft} | {cell(figures['latency_p99_ms'])} "
                f"| {_errors_cell(figures)} | {cell(figures['load_side_cores'], 2)} "
                f"| {cell(figures['other_cores'], 2)} |"
            )
        ratios = entry["ratios"]
        if ratios:
            parts = [
                f"{label} {_range_text(ratios[metric])}"
                for metric, label in (
                    ("tokens_per_s", "tokens/s"),
                    ("proxy_cpu_us_per_token", "CPU per token"),
                    ("ttft_p99_ms", "TTFT p99"),
                    ("latency_p99_ms", "latency p99"),
                )
                if metric in ratios and (scenario.stream or metric != "ttft_p99_ms")
            ]
            lines += ["", "Ours / SMG's: " + "; ".join(parts) + "."]
        lines.append("")
    lines += ["## Targets (issue 29, Must show)", ""]
    lines += [f"- **{t['verdict']}** {t['name']}: {t['value']}" for t in doc["targets"]]
    notes = doc.get("notes") or []
    if notes:
        lines += ["", "Notes:", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"
