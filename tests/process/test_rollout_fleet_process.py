"""A rollout fleet as an RL trainer drives it (issue 28, the first "Must show"), with real
processes: three bare testkit SGLang HTTP engines and one testkit SGLang engine behind its own
``sidecar-sglang``, registered through ``POST /workers`` (bearer token) on ``sidecar-frontend
--route-latest-weights``; 500 concurrent non-streaming multi-turn sessions (``X-SMG-Routing-Key``,
``X-Resume-On-Abort: true``, routed experts asked from where the previous turn ended) while,
every 5 s, the trainer pauses every engine at the engine (abort, retract, in place, abort),
sets a new weight version on each and continues them.

What must hold (``rollout_checks.py``): every request is answered 200 with ``finish_reason``
length and exactly its budget of output ids, the ids the engine makes for that sequence (a
generation aborted by a pause and resumed included: its budget is not miscounted); its
weight-version spans tile the output, rise, and never start on a version older than the newest
every engine had when it was sent; its routed experts are the engine's for the whole sequence;
every request of a session reached one engine (the engines' own books say which), and the
frontend moved no session (nothing is saturated: each engine runs up to 256 requests, 500
sessions share four). A sample of answers is asked again of an unpaused reference engine, so
the generator the checks compute with is the one the engines run.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import re
import struct
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from testkit.generator import ModelSpec
from testkit.routed_experts import ExpertsShape

from tests.e2e_helpers import ROOT, WAIT, child_env, free_port, script, stop
from tests.process.rollout_checks import (
    Published,
    TurnRecord,
    answer_problems,
    expected_experts,
    expected_output,
    legs_by_rid,
    session_problems,
    span_problems,
)
from tests.process.rollout_trainer import RolloutSettings, run_rollout
from tests.process.test_membership_process import call

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow(90), pytest.mark.cpu_hog]

TOKEN = "rollout-admin-token"
LAUNCH_VERSION = "v0"
SHAPE = ExpertsShape(num_layers=3, top_k=2, num_experts=16)
MODEL = ModelSpec()  # the testkit SGLang engine's defaults: vocabulary, EOS 2, context 4096
SETTINGS = RolloutSettings()
SAMPLE_EVERY = 97  # one answer in this many is asked again of the reference engine


def engine_argv(port: int, token_latency_ms: float) -> list[str]:
    return [
        script("testkit-engine"),
        "sglang",
        "--http-listen",
        f"127.0.0.1:{port}",
        "--grpc-listen",
        "off",
        "--weight-version",
        LAUNCH_VERSION,
        "--enable-return-routed-experts",
        "--num-hidden-layers",
        str(SHAPE.num_layers),
        "--num-experts-per-tok",
        str(SHAPE.top_k),
        "--num-experts",
        str(SHAPE.num_experts),
        # Generations last long enough (12 tokens) that the pauses catch many mid-way.
        "--token-latency-ms",
        str(token_latency_ms),
    ]


@contextmanager
def running(argv: list[str], log: Path) -> Iterator[subprocess.Popen[str]]:
    """A child whose output goes to ``log`` (read on failure; a pipe nobody reads would fill)."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=child_env()
        )
    try:
        yield proc
    finally:
        stop(proc)


def until(ready: Callable[[], bool], what: str, proc: subprocess.Popen[str], log: Path) -> None:
    """Poll ``ready`` (a real process: no event to wait on) until true, bounded."""
    deadline = time.monotonic() + WAIT
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"{what}: exited {proc.returncode}: {log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"{what} within {WAIT}s: {log.read_text()[-3000:]}"
        time.sleep(0.1)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def lists_workers(frontend: str) -> bool:
    try:
        return call("GET", frontend + "/workers", token=TOKEN)[0] == 200
    except OSError:
        return False


def until_row(frontend: str, url: str, matches: Callable[[dict[str, Any]], bool]) -> None:
    """GET /workers until the worker's row ``matches`` (bounded)."""
    deadline = time.monotonic() + WAIT
    while True:
        listed = get_json_admin(frontend + "/workers")
        rows = [row for row in listed["workers"] if row["url"] == url]
        if rows and matches(rows[0]):
            return
        assert time.monotonic() < deadline, f"never so: {rows}"
        time.sleep(0.1)  # a real process's state: there is no event to wait on


def get_json_admin(url: str) -> Any:
    status, body = call("GET", url, token=TOKEN)
    assert status == 200, f"GET {url}: {status} {body}"
    return body


def get_json(url: str) -> Any:
    status, body = call("GET", url)
    assert status == 200, f"GET {url}: {status} {body}"
    return body


def metric_values(metrics_url: str, name: str) -> dict[str, float]:
    """Each sample of ``name`` by its label text."""
    with urllib.request.urlopen(metrics_url + "/metrics", timeout=WAIT) as response:
        text = response.read().decode()
    return {
        m.group(1) or "": float(m.group(2)) for m in re.finditer(rf"^{name}(\{{.*?\}})? (\S+)$", text, re.M)
    }


def listed(problems: list[str], limit: int = 15) -> str:
    return f"{len(problems)} problems:\n" + "\n".join(problems[:limit])


def test_a_rollout_fleet_paused_and_updated_by_its_trainer(tmp_path: Path) -> None:
    with ExitStack() as stack:
        engine_ports = [free_port() for _ in range(5)]
        engines = [f"http://127.0.0.1:{port}" for port in engine_ports]
        for i, port in enumerate(engine_ports):
            # The last one is the reference: never paused, never registered, no latency.
            log = tmp_path / f"engine{i}.log"
            proc = stack.enter_context(running(engine_argv(port, 0 if i == 4 else 30), log))
            until(partial(answers, engines[i] + "/ping"), f"engine {i}", proc, log)
        fleet, reference = engines[:4], engines[4]

        sidecar_port = free_port()
        sidecar_argv = [
            script("sidecar-sglang"),
            "--transport",
            "http",
            "--http-endpoint",
            fleet[3],
            "--listen",
            f"127.0.0.1:{sidecar_port}",
            "--log-format",
            "json",
        ]
        stack.enter_context(running(sidecar_argv, tmp_path / "sidecar.log"))

        port, metrics_port = free_port(), free_port()
        frontend, metrics = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
        frontend_log = tmp_path / "frontend.log"
        frontend_argv = [
            script("sidecar-frontend"),
            "--listen",
            f"127.0.0.1:{port}",
            "--log-format",
            "json",
            "--metrics-port",
            str(metrics_port),
            "--metrics-host",
            "127.0.0.1",
            "--route-latest-weights",
            "--admin-token",
            TOKEN,
            "--paused-hold-secs",
            "120",
        ]
        proc = stack.enter_context(running(frontend_argv, frontend_log))
        until(partial(lists_workers, frontend), "the frontend", proc, frontend_log)

        # The trainer registers its workers: three bare engines and one sidecar.
        bodies = [{"url": url} for url in fleet[:3]]
        bodies.append({"url": f"grpc://127.0.0.1:{sidecar_port}", "worker_type": "regular"})
        assert call("POST", frontend + "/workers", bodies[0])[0] == 401, "an admin call without the token"
        for body in bodies:
            status, accepted = call("POST", frontend + "/workers", body, token=TOKEN)
            assert status == 202, accepted
        for body in bodies:  # serving at its launch version (until then it is pending)
            until_row(
                frontend,
                body["url"],
                lambda row: (row["state"], row["weight_version"]) == ("serving", LAUNCH_VERSION),
            )

        rollout = asyncio.run(run_rollout(frontend, fleet, SETTINGS))
        turns = rollout.turns
        assert rollout.pauser_problems == [], listed(rollout.pauser_problems)
        assert [p.version for p in rollout.published] == [
            f"v{i + 1}" for i in range(len(SETTINGS.pause_modes))
        ]

        # Which engine each request reached, from the engines' books (a resumed one: each leg).
        received = {url: get_json(url + "/testkit/state")["received"] for url in fleet}
        legs = legs_by_rid(received)
        resumed = [t for t in turns if len(legs.get(t.rid, [])) > 1]
        # Kept beside the processes' logs, for reading a failure.
        kept = {
            "turns": [dataclasses.asdict(t) for t in turns],
            "legs": legs,
            "published": rollout.published,
        }
        (tmp_path / "rollout.json").write_text(json.dumps(kept, default=dataclasses.asdict))
        moved = metric_values(metrics, "frontend_sessions_moved_total")
        started = metric_values(metrics, "frontend_sessions_started_total")
        print(
            f"{len(turns)} turns of {SETTINGS.sessions} sessions, {len(resumed)} resumed; "
            f"published {[(p.version, round(p.answered_at - p.asked_at, 3)) for p in rollout.published]}; "
            f"per engine {[len(r) for r in received.values()]}; moved {moved}; started {started}"
        )

        sample = turns[::SAMPLE_EVERY]
        assert len(sample) >= 10, f"only {len(turns)} turns"
        for record in sample:
            reference_problems = answer_problems(asked_again(reference, record), MODEL, SHAPE)
            assert reference_problems == [], "the checks' generator is not the engine's: " + listed(
                reference_problems
            )
        assert resumed, "no generation was aborted by a pause and resumed: the abort pauses caught none"

        newest = rollout.published[-1].version
        assert get_json_admin(frontend + "/weight_version")["weight_version"] == newest
        for body in bodies:
            until_row(frontend, body["url"], lambda row: row["weight_version"] == newest)

        # Every property at once, so that a failure names all that broke.
        broken = {
            "every request is answered 200, length, its budget of exactly the engine's ids and "
            "the engine's routed experts": [p for t in turns for p in answer_problems(t, MODEL, SHAPE)],
            "weight-version spans tile the output, rise, and none is older than the newest "
            "published before the request": [
                p for t in turns for p in span_problems(t, rollout.published, LAUNCH_VERSION)
            ],
            # Nothing saturates (each engine runs up to 256, the sessions are 500 over four and
            # think between turns): every move is a failure.
            "every request of a session reaches one engine": session_problems(turns, legs),
            "the frontend moved no session and forgot none": [
                f"{name} {value:g}" for name, value in moved.items() if value
            ]
            + ([] if sum(started.values()) == SETTINGS.sessions else [f"sessions started {started}"]),
        }
        failing = {what: problems for what, problems in broken.items() if problems}
        if failing:
            pytest.fail("\n\n".join(f"{what}: {listed(problems)}" for what, problems in failing.items()))


def asked_again(reference: str, record: TurnRecord) -> TurnRecord:
    """``record``'s request asked of the reference engine, its answer in ``record``'s place."""
    body = {
        "input_ids": list(record.prompt),
        "sampling_params": {"max_new_tokens": record.max_new_tokens, "ignore_eos": True},
        "return_routed_experts": True,
        "routed_experts_start_len": record.experts_start,
    }
    status, answer = call("POST", reference + "/generate", body)
    return TurnRecord(
        record.session,
        record.turn,
        f"{record.rid} (reference)",
        record.prompt,
        record.max_new_tokens,
        record.experts_start,
        record.sent_at,
        record.answered_at,
        status,
        answer,
    )


# ---------------------------------------------------------------- the checks can fail


def _record(
    answer: Any, *, sent_at: float = 10.0, answered_at: float = 20.0, status: int = 200
) -> TurnRecord:
    return TurnRecord("s", 0, "s-t0", (101, 202, 303), 4, 0, sent_at, answered_at, status, answer)


def _answer(output: list[int], spans: list[dict[str, Any]], experts_start: int = 0) -> dict[str, Any]:
    flat = expected_experts([101, 202, 303, *output], experts_start, SHAPE)
    return {
        "output_ids": output,
        "meta_info": {
            "finish_reason": {"type": "length", "length": len(output)},
            "completion_tokens": len(output),
            "weight_versions": spans,
            "weight_version": spans[-1]["version"] if spans else None,
            "routed_experts": base64.b64encode(struct.pack(f"<{len(flat)}i", *flat)).decode(),
        },
    }


PUBLISHED = [Published("v1", 12.0, 13.0), Published("v2", 30.0, 31.0)]


def test_the_checks_pass_an_exact_answer_and_name_each_fault() -> None:
    output = expected_output((101, 202, 303), 4, MODEL)
    good = _answer(output, [{"version": "v0", "start": 0, "end": 2}, {"version": "v1", "start": 2, "end": 4}])
    assert answer_problems(_record(good), MODEL, SHAPE) == []
    assert span_problems(_record(good), PUBLISHED, "v0") == []

    short = _answer(output[:3], [{"version": "v0", "start": 0, "end": 3}])
    assert any("not the budget" in p for p in answer_problems(_record(short), MODEL, SHAPE))
    wrong = _answer([*output[:3], output[3] + 1], [{"version": "v0", "start": 0, "end": 4}])
    assert any("differ from the generator" in p for p in answer_problems(_record(wrong), MODEL, SHAPE))
    experts = dict(good, meta_info=dict(good["meta_info"], routed_experts="AAAAAA=="))
    assert any("routed expert values" in p for p in answer_problems(_record(experts), MODEL, SHAPE))
    assert answer_problems(_record("no", status=503), MODEL, SHAPE) == ["s-t0: answered 503: no"]

    # Sent after v1 was everywhere, yet made by v0's weights.
    stale = _record(good, sent_at=14.0)
    assert any("first span is v0" in p for p in span_problems(stale, PUBLISHED, "v0"))
    falling = _answer(
        output, [{"version": "v1", "start": 0, "end": 2}, {"version": "v0", "start": 2, "end": 4}]
    )
    assert any("do not rise" in p for p in span_problems(_record(falling), PUBLISHED, "v0"))
    gap = _answer(output, [{"version": "v0", "start": 0, "end": 1}, {"version": "v1", "start": 2, "end": 4}])
    assert any("do not tile" in p for p in span_problems(_record(gap), PUBLISHED, "v0"))
    early = _answer(output, [{"version": "v2", "start": 0, "end": 4}])
    assert any("not yet asked for" in p for p in span_problems(_record(early), PUBLISHED, "v0"))

    two = [_record(good), TurnRecord("s", 1, "s-t1", (1,), 4, 0, 0.0, 0.0, 200, good)]
    legs = legs_by_rid({"a": ["0123456789abcdef0123-s-t0"], "b": ["fedcba98765432100000-s-t1"]})
    assert legs == {"s-t0": ["a"], "s-t1": ["b"]}
    assert any("went to 2 engines" in p for p in session_problems(two, legs))
    assert session_problems(two, {"s-t0": ["a"], "s-t1": ["a", "a"]}) == []
