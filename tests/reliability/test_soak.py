"""Soak with faults: thousands of seeded requests, 200 in flight, client cancels and short
deadlines, engine faults keyed by public id. Every request ends exactly one way with an exact
prefix; afterwards nothing runs on the engine, every unfinished request was aborted exactly
once, and the process has no task, descriptor or memory growth beyond a small bound.

Scale with ``SIDECAR_SOAK_SCALE`` (1 → 3,000 requests per engine kind; ``make soak`` uses 10).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import random
import time
from dataclasses import dataclass, field
from typing import ClassVar

import grpc
import pytest
from testkit.book import Outcome
from testkit.faults import FaultKind, FaultPlan

from sidecar_common.errors import FRONTEND_STATUS, FailureReason
from tests.reliability.harness import (
    KINDS,
    Ended,
    Kind,
    Rig,
    error_reason,
    expected_tokens,
    fd_count,
    outcomes,
    request,
    rig,
    rss_bytes,
    until,
)

SCALE = float(os.environ.get("SIDECAR_SOAK_SCALE", "1"))
REQUESTS = max(1, int(3000 * SCALE))
IN_FLIGHT = 200
WARMUP = 200
SEED = 20261130
MALFORMED = ("missing_finish_reason", "unknown_finish_reason", "count_mismatch", "negative_id")
ERROR_CODES = ("INTERNAL", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "ABORTED")


@dataclass
class Plan:
    """One request of the soak, decided up front from the seed."""

    public_id: str
    prompt: list[int]
    max_tokens: int
    full: list[int]
    fault: FaultPlan | None
    cancel_after_chunks: int | None = None  # client cancels after reading this many chunks
    cancel_after_secs: float | None = None  # ... or after this long
    deadline: float = 30.0

    @property
    def cancels(self) -> bool:
        return self.cancel_after_chunks is not None or self.cancel_after_secs is not None


@dataclass
class Result:
    plan: Plan
    ended: Ended
    cancelled: bool  # the client's own cancel took effect


def make_plans(rng: random.Random, count: int, start: int) -> list[Plan]:
    plans = []
    for i in range(start, start + count):
        prompt = [100 + rng.randrange(30000) for _ in range(rng.randint(1, 6))]
        max_tokens = rng.randint(3, 12)
        plans.append(Plan(f"q{i:07d}", prompt, max_tokens, [], None))
    return plans


def decide(rng: random.Random, plan: Plan, full: list[int]) -> None:
    plan.full = full
    roll = rng.random()
    k = rng.randrange(len(full))
    if roll < 0.06:
        plan.fault = FaultPlan(FaultKind.FAIL_OPEN)
    elif roll < 0.12:
        plan.fault = FaultPlan(FaultKind.CLOSE_AFTER, after=k)
    elif roll < 0.18:
        plan.fault = FaultPlan(FaultKind.ERROR_AFTER, after=k, code=rng.choice(ERROR_CODES))
    elif roll < 0.23:
        plan.fault = FaultPlan(FaultKind.MALFORMED_TERMINAL, variant=rng.choice(MALFORMED))
    elif roll < 0.27:
        plan.fault = FaultPlan(FaultKind.HANG, after=k)
    client = rng.random()
    if client < 0.25:
        if rng.random() < 0.5:
            plan.cancel_after_chunks = rng.randrange(len(full) + 1)
        else:
            plan.cancel_after_secs = rng.uniform(0.0, 0.03)
    elif client < 0.35 or (plan.fault is not None and plan.fault.kind is FaultKind.HANG):
        plan.deadline = rng.uniform(0.05, 0.4)


async def run_one(r: Rig, plan: Plan) -> Result:
    call = r.stub.Generate(request(plan.public_id, plan.prompt, plan.max_tokens), timeout=plan.deadline)
    ended = Ended()
    cancelled = False
    timer = None
    if plan.cancel_after_secs is not None:
        timer = asyncio.get_running_loop().call_later(plan.cancel_after_secs, call.cancel)
    try:
        while (out := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            ended.outs.append(out)
            at_cancel = plan.cancel_after_chunks is not None and len(ended.outs) >= plan.cancel_after_chunks
            if at_cancel and call.cancel():
                cancelled = True
                break
    except grpc.aio.AioRpcError as err:
        ended.error = err
    except asyncio.CancelledError:
        # A read interrupted by our own call.cancel(); anything else is a real cancellation.
        if not call.cancelled():
            raise
        cancelled = True
    finally:
        if timer is not None:
            timer.cancel()
    if plan.cancel_after_chunks == 0 and not ended.outs and ended.error is None and not cancelled:
        cancelled = call.cancel()
    if not cancelled and call.cancelled():
        cancelled = True
    return Result(plan, ended, cancelled)


async def run_batch(r: Rig, plans: list[Plan]) -> list[Result]:
    queue = collections.deque(plans)
    results: list[Result] = []

    async def worker() -> None:
        while queue:
            results.append(await run_one(r, queue.popleft()))

    await asyncio.gather(*(worker() for _ in range(min(IN_FLIGHT, len(plans)))))
    return results


@dataclass
class Tally:
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    problems: list[str] = field(default_factory=list)

    def bad(self, plan: Plan, what: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(f"{plan.public_id} fault={plan.fault} cancel={plan.cancels}: {what}")


def check_one(res: Result, tally: Tally, engine_aborts: int, engine_outcome: Outcome | None) -> None:
    plan, ended = res.plan, res.ended
    toks = ended.tokens
    if toks != plan.full[: len(toks)]:
        tally.bad(plan, f"tokens {toks} are not a prefix of {plan.full}")
    terms = ended.terminals
    if len(terms) > 1 or (terms and terms[0] is not ended.outs[-1]):
        tally.bad(plan, f"{len(terms)} terminals, or chunks after the terminal")
    if engine_aborts > 1:
        tally.bad(plan, f"aborted {engine_aborts} times on the engine")
    if res.cancelled or ended.code is grpc.StatusCode.DEADLINE_EXCEEDED:
        tally.outcomes["cancelled" if res.cancelled else "deadline"] += 1
        # Unless the engine sent every terminal before the client left, it must be aborted.
        if engine_outcome is not None and engine_outcome is not Outcome.FINISHED and engine_aborts != 1:
            tally.bad(plan, f"left early (engine: {engine_outcome}) but aborted {engine_aborts} times")
        return
    if ended.error is None:
        tally.outcomes["ok"] += 1
        if not terms:
            tally.bad(plan, "the stream ended OK without a terminal")
        elif toks != plan.full or terms[0].completion_usage.completion_tokens != len(plan.full):
            tally.bad(plan, f"complete stream {toks} != {plan.full}")
        if plan.fault is not None and plan.fault.kind is not FaultKind.MALFORMED_TERMINAL:
            tally.bad(plan, "a faulted request ended OK")
        if engine_aborts:
            tally.bad(plan, "a finished request was aborted")
        return
    why = error_reason(ended.error)
    tally.outcomes[f"error:{why[0] if why else ended.code.name}"] += 1
    if why is None:
        tally.bad(plan, f"status {ended.code} without ErrorInfo: {ended.error.details()}")
        return
    reason = FailureReason(why[0])
    want = FRONTEND_STATUS[reason]
    if want.code != ended.code or why[1] != str(want.migratable).lower():
        tally.bad(plan, f"status {ended.code} does not match reason {why}")
    if terms:
        tally.bad(plan, "a terminal and then an error status")
    fault = plan.fault
    if fault is None:
        tally.bad(plan, f"a fault-free request failed: {why} {ended.error.details()}")
    elif fault.kind in (FaultKind.CLOSE_AFTER, FaultKind.ERROR_AFTER) and toks != plan.full[: fault.after]:
        tally.bad(plan, f"prefix {toks} != the {fault.after} tokens sent before the fault")
    elif fault.kind is FaultKind.FAIL_OPEN and toks:
        tally.bad(plan, "tokens before a failed open")
    if engine_aborts != 1:
        tally.bad(plan, f"failed but aborted {engine_aborts} times on the engine")


async def soak(kind: Kind) -> None:
    rng = random.Random(f"{SEED}-{kind}")
    async with rig(kind, token_latency_ms=1, connections=None if kind == "sglang-http" else 4) as r:
        model = r.model
        warm = make_plans(rng, WARMUP, 0)
        for p in warm:
            decide(rng, p, expected_tokens(model, p.prompt, p.max_tokens))
            p.fault = None
        await run_batch(r, warm)
        await until(lambda: r.engine_busy() == 0, "engine idle after the warm-up")
        gc.collect()
        tasks0, fds0, rss0 = len(asyncio.all_tasks()), fd_count(), rss_bytes()

        plans = make_plans(rng, REQUESTS, WARMUP)
        tally = Tally()
        engine_aborts = 0
        for p in plans:
            decide(rng, p, expected_tokens(model, p.prompt, p.max_tokens))
            if p.fault is not None:
                r.faults.add(f"-{p.public_id}", p.fault, times=1)
                tally.faults[p.fault.kind.value] += 1
        # Two halves: whatever the first half leaves in the allocator is reused by the second,
        # so growth across the second half is what a leak would show.
        halves = [plans[: len(plans) // 2], plans[len(plans) // 2 :]]
        rss_marks: list[int] = []
        done = 0
        t0 = time.monotonic()
        for half in halves:
            results = await run_batch(r, half)
            await until(lambda: r.engine_busy() == 0, f"engine still runs {r.book.running_ids()[:5]}")
            assert await r.server.wait_idle(5.0), f"sidecar in flight: {r.server.inflight}"
            aborts_by_public: collections.Counter[str] = collections.Counter(
                rid.rsplit("-", 1)[-1] for rid in r.book.aborts
            )
            ends = {rid.rsplit("-", 1)[-1]: outcome for rid, outcome in outcomes(r.book).items()}
            for res in results:
                check_one(res, tally, aborts_by_public[res.plan.public_id], ends.get(res.plan.public_id))
            done += len(results)
            engine_aborts += len(r.book.aborts)
            # The engine's ledger and the client's records keep every request: drop them, so
            # the memory figure is the sidecar's (and the engines'), not the test's records.
            del results
            r.book.received.clear()
            r.book.aborts.clear()
            r.book.finished.clear()
            await asyncio.sleep(0.2)  # let closed calls' callbacks run
            gc.collect()
            rss_marks.append(rss_bytes())
        elapsed = time.monotonic() - t0

        tasks, fds, rss = len(asyncio.all_tasks()), fd_count(), rss_bytes()
        leaks = {
            "engine_running": r.engine_busy(),
            "sidecar_inflight": r.server.inflight,
            "tasks": max(0, tasks - tasks0 - 5),
            "fds": max(0, fds - fds0 - 5),
        }
        cancels = tally.outcomes["cancelled"] + tally.outcomes["deadline"]
        print(
            f"\nsoak[{kind}] requests={done} in_flight={IN_FLIGHT} seconds={elapsed:.1f}"
            f" faults={dict(tally.faults)} outcomes={dict(tally.outcomes)} client_cancels={cancels}"
            f" engine_aborts={engine_aborts} rss_growth_mb={(rss - rss0) / 2**20:.1f}"
            f" (second half {(rss_marks[1] - rss_marks[0]) / 2**20:.1f})"
            f" tasks={tasks0}->{tasks} fds={fds0}->{fds} leaks={sum(leaks.values())}"
        )
        assert done == REQUESTS
        assert not tally.problems, "\n".join(tally.problems)
        assert leaks == dict.fromkeys(leaks, 0), leaks
        assert rss - rss0 < 64 * 2**20 + 4096 * REQUESTS, f"RSS grew {(rss - rss0) / 2**20:.1f} MiB"
        second = rss_marks[1] - rss_marks[0]
        assert second < 32 * 2**20 + 1024 * len(halves[1]), (
            f"RSS grew {second / 2**20:.1f} MiB in the second half"
        )


# One class per engine kind, not one parametrized function: `make test` hands each pytest-xdist
# worker a module or a class at a time (--dist loadscope), and three soaks of a minute or more
# in one module would run one after another on one worker.
@pytest.mark.slow(75)
@pytest.mark.timeout(60 + int(90 * SCALE))
class Soak:
    kind: ClassVar[Kind]

    async def test_soak_with_faults_ends_every_request_one_way_and_leaks_nothing(self) -> None:
        await soak(self.kind)


class TestSoakVllm(Soak):
    kind = "vllm"


class TestSoakSglangGrpc(Soak):
    kind = "sglang-grpc"


class TestSoakSglangHttp(Soak):
    kind = "sglang-http"


def test_every_engine_kind_has_its_soak() -> None:
    assert sorted(c.kind for c in Soak.__subclasses__()) == sorted(KINDS)
