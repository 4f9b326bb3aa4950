"""Turning raw loadgen results into medians, target verdicts and a markdown table."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Target", "evaluate_targets", "key", "markdown", "references", "row_figures", "summarize"]

_METRICS = (
    "tokens_per_s",
    "hop_cpu_us_per_token",
    "hop_cpu_us_per_msg",
    "hop_cpu_us_per_request",
    "tokens_per_msg",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "gap_p50_ms",
    "gap_p99_ms",
    "hop_peak_rss_mib",
    "hop_core_util",
    "engine_core_util",
    "other_cpu_util",
)


def key(path: str, engine: str, chunk_tokens: int, concurrency: int) -> str:
    return f"{path}|{engine}|K{chunk_tokens}|c{concurrency}"


def row_figures(raw: dict[str, Any]) -> dict[str, float | None]:
    """The per-run figures derived from one loadgen answer."""
    window = raw["window_s"]
    tokens = raw["tokens"]
    messages = raw["messages"]
    cpu = raw["cpu_s"]
    hop = cpu.get("hop")
    if hop is not None and hop <= 0 and tokens:
        hop = None  # tokens went through a hop that used no CPU: a failed reading, not a figure
    rss = raw.get("hop_peak_rss_kib")
    # The engine and the client share one core: their sum says whether that core, rather
    # than the hop, was the bottleneck of a run.
    core0 = cpu.get("engine", 0.0) + cpu.get("client", 0.0)
    return {
        "tokens_per_s": tokens / window,
        "hop_cpu_us_per_token": hop / tokens * 1e6 if hop is not None and tokens else None,
        "hop_cpu_us_per_msg": hop / messages * 1e6 if hop is not None and messages else None,
        "tokens_per_msg": tokens / messages if messages else None,
        # Meaningful for short requests (the TTFT test), where set-up dominates.
        "hop_cpu_us_per_request": hop / raw["requests"] * 1e6
        if hop is not None and raw["requests"]
        else None,
        "ttft_p50_ms": raw["ttft_ms"]["p50"],
        "ttft_p99_ms": raw["ttft_ms"]["p99"],
        "gap_p50_ms": raw["gap_ms"]["p50"],
        "gap_p99_ms": raw["gap_ms"]["p99"],
        "hop_peak_rss_mib": rss / 1024.0 if rss else None,
        "hop_core_util": hop / window if hop is not None else None,
        "engine_core_util": core0 / window,
        "other_cpu_util": (cpu.get("other", 0.0) + cpu.get("steal", 0.0)) / window,
    }


_PER_RUN = (
    "tokens_per_s",
    "hop_cpu_us_per_token",
    "tokens_per_msg",
    "ttft_p50_ms",
    "gap_p99_ms",
    "other_cpu_util",
)


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of each figure, the key figures of every run (in round order, so
    two paths can be compared round by round), and the error count."""
    figures = [row_figures(s) for s in samples if "failed" not in s]
    out: dict[str, Any] = {"runs": len(figures), "failed_runs": len(samples) - len(figures)}
    per_run = [None if "failed" in s else row_figures(s) for s in samples]
    out["per_run"] = {m: [None if f is None else f[m] for f in per_run] for m in _PER_RUN}
    for metric in _METRICS:
        values = [v for f in figures if (v := f[metric]) is not None]
        out[metric] = statistics.median(values) if values else None
    out["errors"] = sum(s.get("errors", 0) for s in samples)
    out["error_samples"] = [e for s in samples for e in s.get("error_samples", [])][:3]
    out["failures"] = [s["failed"] for s in samples if "failed" in s][:3]
    return out


@dataclass(frozen=True)
class Target:
    name: str
    measured: float | None
    limit: float
    kind: str  # "max": measured <= limit passes; "min": measured >= limit passes
    detail: str
    spread: tuple[float, float] | None = None  # min and max over rounds, when paired

    @property
    def verdict(self) -> str:
        if self.measured is None:
            return "N/A"
        ok = self.measured <= self.limit if self.kind == "max" else self.measured >= self.limit
        return "PASS" if ok else "MISS"

    def line(self) -> str:
        shown = "n/a" if self.measured is None else f"{self.measured:.3g}"
        op = "<=" if self.kind == "max" else ">="
        spread = "" if self.spread is None else f"; rounds {self.spread[0]:.3g}..{self.spread[1]:.3g}"
        return f"{self.verdict}: {self.name}: {shown} {op} {self.limit:g} ({self.detail}{spread})"


Paired = tuple[float | None, tuple[float, float] | None]


def _paired(table: dict[str, Any], a: str, b: str, metric: str, ratio: bool) -> Paired:
    """Median over rounds of a/b (or a-b) of one figure, and its range.

    Pairing within a round cancels most of the drift of a shared machine: the two runs of a
    round are seconds apart, while rounds are minutes apart.
    """
    xs = table.get(a, {}).get("per_run", {}).get(metric, [])
    ys = table.get(b, {}).get("per_run", {}).get(metric, [])
    values = [
        (x / y if ratio else x - y)
        for x, y in zip(xs, ys, strict=False)
        if x is not None and y is not None and (y or not ratio)
    ]
    if not values:
        return None, None
    return statistics.median(values), (min(values), max(values))


def _ratio(results: dict[str, Any], a: str, b: str, metric: str) -> Paired:
    return _paired(results, a, b, metric, ratio=True)


def _diff(latency: dict[str, Any], a: str, b: str, metric: str) -> Paired:
    return _paired(latency, a, b, metric, ratio=False)


def evaluate_targets(results: dict[str, Any], latency: dict[str, Any]) -> list[Target]:
    side256, bare256 = key("sidecar", "vllm", 1, 256), key("bare-proxy", "vllm", 1, 256)
    side16, bare16 = key("sidecar", "vllm", 1, 16), key("bare-proxy", "vllm", 1, 16)
    http16, grpc16 = key("sidecar-http", "sglang", 1, 16), key("sidecar-grpc", "sglang", 1, 16)
    cpu, tps = "hop_cpu_us_per_token", "tokens_per_s"

    def target(name: str, paired: Paired, limit: float, kind: str, detail: str) -> Target:
        return Target(name, paired[0], limit, kind, detail, paired[1])

    return [
        target("256 streams K=1 CPU/token, sidecar / bare proxy",
               _ratio(results, side256, bare256, cpu), 0.7, "max", "vLLM"),
        target("256 streams K=1 tokens/s, sidecar / bare proxy",
               _ratio(results, side256, bare256, tps), 1.3, "min", "vLLM"),
        target("16 streams K=1 CPU/token, sidecar / bare proxy",
               _ratio(results, side16, bare16, cpu), 1.1, "max", "vLLM"),
        target("16 streams K=1 tokens/s, sidecar / bare proxy",
               _ratio(results, side16, bare16, tps), 0.9, "min", "vLLM"),
        target("1 stream added TTFT p50 (ms), sidecar - direct",
               _diff(latency, "ttft|sidecar", "ttft|direct", "ttft_p50_ms"), 2.0, "max", "vLLM, fast engine"),
        target("16 paced streams added p99 gap (ms), sidecar - direct",
               _diff(latency, "paced|sidecar", "paced|direct", "gap_p99_ms"), 2.0, "max", "vLLM, paced"),
        target("SGLang CPU/token, HTTP / gRPC (16 streams K=1)",
               _ratio(results, http16, grpc16, cpu), 2.0, "max", "sidecar-sglang"),
    ]  # fmt: skip


def references(results: dict[str, Any], latency: dict[str, Any]) -> list[str]:
    """Where the sidecar's cost sits between "any hop" and "any converting hop" (not targets)."""
    lines = []
    for k, c in ((1, 16), (1, 256), (8, 256)):
        bare, floor, side = (key(p, "vllm", k, c) for p in ("bare-proxy", "convert-floor", "sidecar"))
        for name, a, b in (
            ("convert-floor / bare-proxy", floor, bare),
            ("sidecar / convert-floor", side, floor),
        ):
            value, spread = _ratio(results, a, b, "hop_cpu_us_per_token")
            if value is not None and spread is not None:
                lines.append(f"K={k}, {c} streams, CPU/token {name}: {value:.3g} {_range(spread)}")
    value, spread = _diff(latency, "ttft|sidecar", "ttft|convert-floor", "ttft_p50_ms")
    if value is not None and spread is not None:
        lines.append(f"1 stream TTFT p50, sidecar - convert-floor: {value:.3g} ms {_range(spread)}")
    return lines


def _range(spread: tuple[float, float]) -> str:
    return f"(rounds {spread[0]:.3g}..{spread[1]:.3g})"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _table(rows: Iterable[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = [
        "| path | engine | K | streams | tokens/s | hop CPU µs/token | hop CPU µs/msg | tokens/msg "
        "| TTFT p50/p99 ms | gap p50/p99 ms | hop peak RSS MiB | hop core | engine+client core | other |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        path, engine, k, c = name.split("|")
        lines.append(
            f"| {path} | {engine} | {k[1:]} | {c[1:]} | {_fmt(r['tokens_per_s'], 0)} "
            f"| {_fmt(r['hop_cpu_us_per_token'])} | {_fmt(r['hop_cpu_us_per_msg'])} "
            f"| {_fmt(r['tokens_per_msg'], 2)} "
            f"| {_fmt(r['ttft_p50_ms'], 2)} / {_fmt(r['ttft_p99_ms'], 2)} "
            f"| {_fmt(r['gap_p50_ms'], 2)} / {_fmt(r['gap_p99_ms'], 2)} | {_fmt(r['hop_peak_rss_mib'])} "
            f"| {_fmt(r['hop_core_util'], 2)} | {_fmt(r['engine_core_util'], 2)} "
            f"| {_fmt(r['other_cpu_util'], 2)} |" + (f" errors: {r['errors']}" if r["errors"] else "")
        )
    return lines


def markdown(doc: dict[str, Any], targets: list[Target]) -> str:
    m = doc["machine"]
    out = [
        f"## Benchmark: {doc['profile']} run, {doc['date']}",
        "",
        f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), Python {m['python']}, grpcio {m['grpcio']}, "
        f"{m['kernel']}. Engines: {doc['engines']}. Pinning: {doc['pinning']}. "
        f"Code: {doc['git']['commit'][:10]}{' + uncommitted changes' if doc['git']['dirty'] else ''}. "
        f"Each figure is the median of {doc['rounds']} alternating run(s); window {doc['window_s']} s "
        f"after {doc['warmup_s']} s warm-up, requests of {doc['max_tokens']} tokens (ignore_eos).",
        "",
        *_table(sorted(doc["results"].items(), key=lambda kv: _order(kv[0]))),
        "",
        "Paths: direct = client to the engine's native API; bare-proxy = bench/bare_proxy.py (raw bytes, "
        "no decoding); convert-floor = bench/convert_floor.py (decode, convert, encode in one task: the "
        "floor of a converting hop); sidecar = sidecar-vllm; sidecar-grpc/-http = sidecar-sglang. "
        "µs/msg is per message the client received; tokens/msg > K means the hop coalesced. "
        "Core columns are CPU-seconds per second: the hop (CPU 1), engine + load generator (CPU 0), "
        "and other = anything else on the machine (including steal) during the window.",
        "",
        "Added latency (vLLM): 1 stream TTFT on the fast engine; 16 streams on an engine paced at "
        f"{doc['paced_ms']:g} ms/token.",
        "",
        "| path | test | TTFT p50/p99 ms | gap p50/p99 ms | hop CPU µs/request | runs |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, r in sorted(doc["latency"].items()):
        test, path = name.split("|")
        out.append(
            f"| {path} | {test} | {_fmt(r['ttft_p50_ms'], 2)} / {_fmt(r['ttft_p99_ms'], 2)} "
            f"| {_fmt(r['gap_p50_ms'], 2)} / {_fmt(r['gap_p99_ms'], 2)} "
            f"| {_fmt(r['hop_cpu_us_per_request'], 0)} | {r['runs']} |"
        )
    out += [
        "",
        "Targets (median over rounds of the per-round ratio or difference, with its range):",
        "",
        *(f"- {t.line()}" for t in targets),
        "",
    ]
    refs = references(doc["results"], doc["latency"])
    if refs:
        out += ["Reference ratios (not targets):", "", *(f"- {line}" for line in refs), ""]
    if doc.get("notes"):
        out += ["Notes:", "", *(f"- {n}" for n in doc["notes"]), ""]
    return "\n".join(out)


_PATH_ORDER = {
    "direct": 0,
    "bare-proxy": 1,
    "convert-floor": 2,
    "sidecar": 3,
    "sidecar-grpc": 4,
    "sidecar-http": 5,
}


def _order(name: str) -> tuple[int, int, int, int]:
    path, engine, k, c = name.split("|")
    return (engine != "vllm", int(k[1:]), int(c[1:]), _PATH_ORDER.get(path, 9))
