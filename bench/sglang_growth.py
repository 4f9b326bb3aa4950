"""``python -m bench.sglang_growth [--rounds N]``: does the SGLang gRPC hop's CPU per token grow
with the output when every engine message restates the whole output?

SGLang's default (cumulative) streaming sends, in every message, every output id and, with
logprobs on, every logprob entry so far. An engine in that mode (``bench/sglang_standin.py``:
one token per message, cheap per message) and the load generator run on CPU 0,
``sidecar-sglang --transport grpc`` on CPU 1. 2 streams ask for 256-token and then 2,048-token
outputs with logprobs (one alternative), alternating round by round. The engine is paced
(8 ms per token per stream by default) so that both lengths run at the same message rate:
unpaced, the engine slows down on long outputs (each message is bigger), and a hop that is
less busy pays more per message for reasons unrelated to length. The window (17 s) spans a
whole 2,048-token output of each stream. The hop's CPU per token is read from /proc. The
target: the 2,048-token figure within 10 % of the 256-token one.

Writes ``<out>/sglang_growth.json`` and ``.md``. ``--pythonpath DIR`` runs the sidecar from
another checkout (an export of an older commit), for before/after figures on one machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import plan
from bench.procs import LoadGen, Proc, free_port, wait_grpc_ready

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Few streams, so that a window spans whole 2,048-token outputs at a pace the engine keeps
# on this machine at both lengths.
STREAMS = 2
LENGTHS = (256, 2048)
LOGPROBS = 1
TARGET = 0.10


def _start(pythonpath: str | None, token_latency_ms: float) -> tuple[list[Proc], str, int, int]:
    grpc_addr = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "bench.sglang_standin", "--listen", grpc_addr]
    pace = ["--token-latency-ms", f"{token_latency_ms:g}"]
    engine = Proc("growth-engine", [*argv, *pace], plan.ENGINE_CORE).start()
    procs = [engine]
    wait_grpc_ready(engine, grpc_addr, 60)
    listen = f"127.0.0.1:{free_port()}"
    env_before = os.environ.get("PYTHONPATH")
    if pythonpath:
        # The console script imports the sidecar from this path first (the venv's editable
        # install comes later on sys.path).
        os.environ["PYTHONPATH"] = pythonpath
    try:
        hop = Proc(
            "growth-sidecar",
            [plan._script("sidecar-sglang"), "--transport", "grpc", "--grpc-endpoint", grpc_addr,
             "--listen", listen, "--log-level", "warning"],
            plan.HOP_CORE,
        ).start()  # fmt: skip
    finally:
        if env_before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_before
    procs.append(hop)
    wait_grpc_ready(hop, listen, 60)
    return procs, listen, hop.pid, engine.pid


def _per_token(result: dict[str, Any]) -> float | None:
    hop = result.get("cpu_s", {}).get("hop")
    tokens = result.get("tokens") or 0
    return hop / tokens * 1e6 if hop is not None and tokens else None


def run(
    rounds: int, warmup_s: float, window_s: float, pythonpath: str | None, token_latency_ms: float
) -> dict[str, Any]:
    procs, listen, hop_pid, engine_pid = _start(pythonpath, token_latency_ms)
    loadgen = LoadGen(plan.ENGINE_CORE)
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in LENGTHS}
    try:
        for r in range(rounds):
            order = LENGTHS if r % 2 == 0 else tuple(reversed(LENGTHS))
            for n in order:
                command = {
                    "api": "sidecar",
                    "target": listen,
                    "concurrency": STREAMS,
                    "max_tokens": n,
                    "warmup_s": warmup_s,
                    "window_s": window_s,
                    "hop_pid": hop_pid,
                    "engine_pid": engine_pid,
                    "logprobs": LOGPROBS,
                }
                result = loadgen.run(command, warmup_s + window_s + 60)
                result["per_token_us"] = _per_token(result)
                runs[n].append(result)
                other = result["cpu_s"].get("other", 0.0) / result["window_s"]
                print(
                    f"  round {r + 1}/{rounds} {STREAMS}x{n}: {result['tokens_per_s']:,.0f} tokens/s, "
                    f"hop {result['per_token_us'] or 0:.1f} µs/token, errors {result['errors']}, "
                    f"other CPU {other:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(0.25)
    finally:
        loadgen.close()
        for proc in reversed(procs):
            proc.stop()
    summary: dict[str, Any] = {}
    for n, results in runs.items():
        figures = [x["per_token_us"] for x in results if x["per_token_us"] is not None]
        summary[str(n)] = {
            "per_token_us_median": round(statistics.median(figures), 2) if figures else None,
            "per_token_us_runs": [round(f, 2) for f in figures],
            "tokens_per_s_median": round(statistics.median(x["tokens_per_s"] for x in results), 1),
            "tokens_per_msg_median": round(
                statistics.median(x["tokens"] / x["messages"] for x in results if x["messages"]), 2
            ),
            "errors": sum(x["errors"] for x in results),
            "other_cpu_median": round(
                statistics.median(x["cpu_s"]["other"] / x["window_s"] for x in results), 2
            ),
        }
    short, long = summary["256"]["per_token_us_median"], summary["2048"]["per_token_us_median"]
    growth = long / short - 1.0 if short and long else None
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "case": f"sglang grpc cumulative, logprobs={LOGPROBS}, {STREAMS} streams, K=1, "
        f"engine paced at {token_latency_ms:g} ms/token",
        "rounds": rounds,
        "warmup_s": warmup_s,
        "window_s": window_s,
        "sidecar_pythonpath": pythonpath,
        "results": summary,
        "growth_2048_vs_256": None if growth is None else round(growth, 3),
        "target": f"|growth| <= {TARGET:.0%}",
        "verdict": "PASS" if growth is not None and abs(growth) <= TARGET else "MISS",
    }


def markdown(doc: dict[str, Any]) -> str:
    r = doc["results"]
    growth = doc["growth_2048_vs_256"]
    return "\n".join(
        [
            f"SGLang gRPC, cumulative streaming, logprobs on ({doc['case']}; medians of {doc['rounds']} "
            f"rounds, {doc['window_s']} s windows, {doc['date']}):",
            "",
            "| output | hop µs/token | tokens/s | tokens/msg | other CPU |",
            "|---|---|---|---|---|",
            *(
                f"| {n} | {r[n]['per_token_us_median']} | {r[n]['tokens_per_s_median']:,.0f} "
                f"| {r[n]['tokens_per_msg_median']} | {r[n]['other_cpu_median']} |"
                for n in ("256", "2048")
            ),
            "",
            f"growth 2,048 vs 256: {'' if growth is None else f'{growth:+.1%}'} "
            f"(target {doc['target']}): {doc['verdict']}",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sglang_growth", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds before each window")
    parser.add_argument("--window", type=float, default=17.0, help="seconds measured per run")
    parser.add_argument("--token-latency-ms", type=float, default=8.0,
                        help="engine pace per stream (0: as fast as it can)")  # fmt: skip
    parser.add_argument("--pythonpath", help="run the sidecar from this checkout instead")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="sglang_growth", help="file name of the results")
    args = parser.parse_args(argv)
    doc = run(args.rounds, args.warmup, args.window, args.pythonpath, args.token_latency_ms)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    text = markdown(doc)
    (args.out / f"{args.name}.md").write_text(text)
    print(text)
    return 0  # a MISS is a finding, reported like the main bench's targets, not a failed run


if __name__ == "__main__":
    sys.exit(main())
