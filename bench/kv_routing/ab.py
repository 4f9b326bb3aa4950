"""``python -m bench.kv_routing.ab --base COMMIT [--rounds N]``: the routing decision's cost at
another commit against the working tree's, in one process, alternating.

This machine's speed moves by up to 1.5x from one minute to the next (bench/README.md, "The
decision's cost"), so two runs minutes apart cannot tell a few per cent. Here both versions of
``sidecar_frontend/routing/{index,policy,router}.py`` are loaded side by side (the base's from
``git show``, into a throwaway package), and each round times the same calls of
``bench.kv_routing.micro.decision_setup`` on one then the other (which goes first alternates).
The figure of a round is the minimum over a few sub-rounds of ``time.process_time`` per call;
the report gives each version's median over rounds and the median of the per-round ratios
(working tree / base). The keys (``sidecar_common.kv_keys``) and ``choice.prompt_of`` are the
working tree's in both.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from bench.kv_routing import micro
from sidecar_frontend.routing import router as current_router

__all__ = ["load_routing_at", "main"]

_MODULES = ("index", "policy", "router")
_REPO = Path(__file__).resolve().parents[2]


def load_routing_at(commit: str, into: Path) -> ModuleType:
    """The router module of ``commit`` (with its own index and policy), importable from ``into``."""
    package = "_routing_at_" + "".join(c for c in commit if c.isalnum())
    folder = into / package
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text("")
    for name in _MODULES:
        text = subprocess.run(
            ["git", "show", f"{commit}:sidecar_frontend/routing/{name}.py"],
            cwd=_REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for other in _MODULES:
            text = text.replace(f"sidecar_frontend.routing.{other}", f"{package}.{other}")
        (folder / f"{name}.py").write_text(text)
    if str(into) not in sys.path:
        sys.path.insert(0, str(into))
    return importlib.import_module(f"{package}.router")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_routing.ab", description=__doc__)
    parser.add_argument("--base", required=True, help="the commit to compare the working tree with")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sub-rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=0.03, help="CPU seconds per sub-round")
    parser.add_argument(
        "--case",
        action="append",
        default=None,
        metavar="TOKENS:WORKERS",
        help="prompt tokens and workers (repeatable; default 8192:16, 8192:64, 1024:4)",
    )
    parser.add_argument(
        "--calls",
        default="whole,approx",
        help="which of micro.decision_setup's calls to time (whole, from_list, keys, walk, approx)",
    )
    args = parser.parse_args(argv)
    cases = [tuple(map(int, c.split(":"))) for c in args.case or ("8192:16", "8192:64", "1024:4")]
    names = [n for n in args.calls.split(",") if n]
    with tempfile.TemporaryDirectory() as tmp:
        base = load_routing_at(args.base, Path(tmp))
        print(f"base {args.base} against the working tree; {args.rounds} rounds, medians", flush=True)
        for tokens, workers in cases:
            versions = {
                "base": micro.decision_setup(tokens, workers, base),
                "new": micro.decision_setup(tokens, workers, current_router),
            }
            for name in names:
                calls = micro.calls_per_round(versions["base"][name], args.budget_s)
                figures: dict[str, list[float]] = {"base": [], "new": []}
                for i in range(args.rounds):
                    order = ("base", "new") if i % 2 == 0 else ("new", "base")
                    for version in order:
                        figures[version].append(
                            micro.best_us(versions[version][name], calls, args.sub_rounds)
                        )
                ratios = [n / b for n, b in zip(figures["new"], figures["base"], strict=True)]
                print(
                    f"{tokens:>6} tokens {workers:>3} workers {name:>9}: "
                    f"base {statistics.median(figures['base']):7.1f} µs, "
                    f"new {statistics.median(figures['new']):7.1f} µs, "
                    f"new/base median {statistics.median(ratios):.3f} "
                    f"(rounds {min(ratios):.3f}-{max(ratios):.3f})",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
