"""Preempt and migrate over real sidecars (issue 27): one worker of each engine kind running one
sequence at a time; a long, less urgent streaming generation runs, a more urgent request arrives
and waits past ``preempt_after``; the running one is paused (its engine request aborted), the
urgent one runs, then the paused one resumes where it stopped. Its client sees a 200 stream with
exactly the tokens, finish and usage of an uninterrupted run of the same request (testkit
engines are deterministic: the same prompt and seed give the same tokens, autoregressively), and
no error. Off (no ``preempt_after``), the urgent request waits for the running one to finish."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup
from testkit.book import Outcome

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.admission.state import AdmissionSettings
from sidecar_frontend.config import AdmissionConfig
from sidecar_frontend.exchange import Exchange
from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.handler import HandlerConfig
from tests.e2e_helpers import until
from tests.integration.frontend.fixtures import FrontendStack, frontend_over
from tests.sglang_fixtures import sglang_stack
from tests.vllm_fixtures import vllm_stack

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow(20)]

ENGINES = ["vllm", "sglang-grpc", "sglang-http"]
PROMPT = [101, 202, 303, 404]
# Long enough that the paused generation is still running when the urgent one has waited.
MAX_TOKENS = 60
TOKEN_MS = 20.0
PREEMPT_AFTER = 0.2
PRIORITY_HEADER = "x-sidecar-priority"


@asynccontextmanager
async def one_worker(
    engine: str, preempt_after: float | None, slots: int = 1
) -> AsyncIterator[FrontendStack]:
    """One sidecar of ``engine`` running ``slots`` sequences at a time, behind a frontend whose
    admission preempts after ``preempt_after`` seconds (None: never)."""
    async with AsyncExitStack() as stack:
        if engine == "vllm":
            cm: Any = vllm_stack(max_num_seqs=slots, token_latency_ms=TOKEN_MS)
        else:
            transport = engine.removeprefix("sglang-")
            cm = sglang_stack(transport, max_running_requests=slots, token_latency_ms=TOKEN_MS)  # type: ignore[arg-type]
        sidecar = await stack.enter_async_context(cm)
        admission = AdmissionConfig(
            settings=AdmissionSettings(max_queue_depth=8, max_queue_wait=60.0, headroom=0.0),
            tick=0.05,
            preempt_after=preempt_after,
        )
        yield await stack.enter_async_context(
            frontend_over(
                [f"127.0.0.1:{sidecar.server.port}"],
                [sidecar],
                formats=(SGLANG, VLLM),
                config=HandlerConfig(worker_wait=30.0),
                admission=admission,
            )
        )


def request_body(fmt: str, rid: str, *, stream: bool = True) -> tuple[str, dict[str, Any]]:
    if fmt == "sglang":
        return "/generate", {
            "input_ids": PROMPT,
            "rid": rid,
            "stream": stream,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True, "sampling_seed": 11},
        }
    body: dict[str, Any] = {
        "token_ids": PROMPT,
        "request_id": rid,
        "stream": stream,
        "sampling_params": {"max_tokens": MAX_TOKENS, "ignore_eos": True, "seed": 11, "logprobs": 1},
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return "/inference/v1/generate", body


def urgent_header(fmt: str) -> dict[str, str]:
    # The header speaks each format's language: vLLM serves the lower value first.
    return {PRIORITY_HEADER: "-5" if fmt == "vllm" else "5"}


@dataclass
class Stream:
    """One streaming request, read as it comes; ``started`` once ``wait_for`` tokens came."""

    fe: FrontendStack
    fmt: str
    rid: str
    wait_for: int = 3
    status: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    started: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)

    async def run(self) -> None:
        path, body = request_body(self.fmt, self.rid)
        async with self.fe.http.post(self.fe.url + path, json=body) as response:
            self.status = response.status
            async for line in response.content:
                text = line.decode().rstrip("\r\n")
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                self.events.append(json.loads(text[len("data: ") :]))
                if delivered(self.fmt, self.events) >= self.wait_for:
                    self.started.set()
        self.done.set()


def delivered(fmt: str, events: list[dict[str, Any]]) -> int:
    if fmt == "sglang":
        return len(events[-1].get("output_ids", ())) if events else 0
    return sum(len(c["token_ids"]) for e in events for c in e.get("choices", ()))


def summary(fmt: str, events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the client got, without what differs between any two runs (ids, times)."""
    if fmt == "sglang":
        last = events[-1]
        meta = last["meta_info"]
        return {
            "tokens": last["output_ids"],
            "finish": meta["finish_reason"],
            "usage": (meta["prompt_tokens"], meta["completion_tokens"]),
            "logprobs": [(v, t) for v, t, *_ in meta["output_token_logprobs"]],
            "cumulative": all(e["output_ids"] == last["output_ids"][: len(e["output_ids"])] for e in events),
            "errors": [e for e in events if "error" in e],
        }
    choices = [c for e in events for c in e.get("choices", ())]
    return {
        "tokens": [t for c in choices for t in c["token_ids"]],
        "finish": [c["finish_reason"] for c in choices if c.get("finish_reason")],
        "usage": {k: v for k, v in events[-1]["usage"].items() if k != "prompt_tokens_details"},
        "logprobs": [lp for c in choices if c.get("logprobs") for lp in c["logprobs"]["content"]],
        "errors": [e for e in events if "error" in e],
    }


async def post_urgent(fe: FrontendStack, fmt: str, rid: str) -> tuple[int, Any]:
    path, body = request_body(fmt, rid, stream=False)
    async with fe.http.post(fe.url + path, json=body, headers=urgent_header(fmt)) as response:
        return response.status, await response.json()


def engine_outcomes(fe: FrontendStack, rid: str) -> list[Outcome]:
    """How each engine request of ``rid`` ended, in the order they ended."""
    book = fe.sidecars[0].engine.book
    return [record.outcome for record in book.finished if record.request_id.endswith(rid)]


def ended_order(fe: FrontendStack) -> list[str]:
    """The public ids whose engine requests ended, in order (the sidecar prefixes them)."""
    book = fe.sidecars[0].engine.book
    return [record.request_id.rsplit("-", 1)[-1] for record in book.finished]


def total(fe: FrontendStack, name: str) -> float:
    """A counter's value summed over its labels (0 when it has none yet)."""
    return sum(
        sample.value
        for family in fe.metrics.registry.collect()
        for sample in family.samples
        if sample.name == name
    )


def preemptions(fe: FrontendStack) -> float:
    model = fe.workers.default_model() or ""
    value = fe.metrics.registry.get_sample_value("frontend_admission_preemptions_total", {"model": model})
    return 0.0 if value is None else value


async def until_idle(fe: FrontendStack) -> None:
    book = fe.sidecars[0].engine.book
    await until(
        lambda: not (book.running_count or book.waiting_count or fe.frontend.inflight), "idle", secs=30.0
    )


def queued(fe: FrontendStack) -> int:
    assert fe.gate is not None
    return sum(sum(by.values()) for by in fe.gate.queued().values())


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
@pytest.mark.parametrize("engine", ENGINES)
async def test_a_preempted_generation_resumes_token_exactly(engine: str, fmt: str) -> None:
    async with one_worker(engine, PREEMPT_AFTER) as fe:
        reference = Stream(fe, fmt, "ref")
        with anyio.fail_after(60):
            await reference.run()
        await until_idle(fe)
        low = Stream(fe, fmt, "low")
        urgent: list[tuple[int, Any]] = []
        async with anyio.create_task_group() as group:
            group.start_soon(low.run)
            with anyio.fail_after(30):
                await low.started.wait()

            async def send_urgent() -> None:
                urgent.append(await post_urgent(fe, fmt, "high"))

            group.start_soon(send_urgent)
        assert low.status == 200
        assert summary(fmt, low.events) == summary(fmt, reference.events)
        assert len(summary(fmt, low.events)["tokens"]) == MAX_TOKENS
        assert summary(fmt, low.events)["errors"] == []
        [(status, _)] = urgent
        assert status == 200
        assert preemptions(fe) == 1
        # Nobody failed: no worker failure, retry, migration or ejection was counted.
        for name in (
            "frontend_worker_failures_total",
            "frontend_retries_total",
            "frontend_migrations_total",
            "frontend_worker_ejections_total",
        ):
            assert total(fe, name) == 0, name
        await until_idle(fe)
        # The paused generation's engine request was aborted; the urgent one ran while it was
        # paused, then the rest of it ran (its continuation: one more engine request).
        assert engine_outcomes(fe, "-low")[0] in (Outcome.ABORTED, Outcome.CANCELLED)
        assert engine_outcomes(fe, "-low")[1:] == [Outcome.FINISHED]
        order = [rid for rid in ended_order(fe) if rid in ("low", "high")]
        assert order == ["low", "high", "low"]


async def test_a_preempted_batch_pauses_every_prompt_and_resumes_them_together() -> None:
    # Two slots, both held by one SGLang batch of two prompts: the urgent request takes the
    # batch's place, and the batch comes back once both its slots are free again.
    prompts = [PROMPT, [505, 606, 707]]
    batch: dict[str, Any] = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True, "sampling_seed": 3},
    }
    async with one_worker("sglang-grpc", PREEMPT_AFTER, slots=2) as fe:
        async with fe.http.post(fe.url + "/generate", json={**batch, "rid": ["r1", "r2"]}) as response:
            reference = await response.json()
        results: dict[str, Any] = {}

        async def run_batch() -> None:
            async with fe.http.post(fe.url + "/generate", json={**batch, "rid": ["b1", "b2"]}) as response:
                results["batch"] = (response.status, await response.json())

        async with anyio.create_task_group() as group:
            group.start_soon(run_batch)
            # Not streamed: one answer per prompt, nothing delivered before it. Preempted while
            # its engine generates, each prompt runs again from its start when readmitted.
            generating = {"b1": len(prompts[0]), "b2": len(prompts[1])}
            await until(lambda: every_prompt_generated(fe, generating, 3), "both prompts generate tokens")
            results["high"] = await post_urgent(fe, "sglang", "high")
        status, answers = results["batch"]
        assert status == 200
        assert results["high"][0] == 200

        def seen(answer: dict[str, Any]) -> tuple[Any, ...]:
            meta = answer["meta_info"]
            return (
                answer["output_ids"],
                meta["finish_reason"],
                meta["prompt_tokens"],
                meta["completion_tokens"],
            )

        assert [seen(answer) for answer in answers] == [seen(answer) for answer in reference]
        assert preemptions(fe) == 1
        await until_idle(fe)
        for rid in ("-b1", "-b2"):
            assert engine_outcomes(fe, rid)[0] in (Outcome.ABORTED, Outcome.CANCELLED)
            assert engine_outcomes(fe, rid)[1:] == [Outcome.FINISHED]


async def test_a_preemption_while_an_output_is_written_waits_for_the_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The client's write of one output is held (a slow client) until the preemption came: the
    # output, counted as delivered, still reaches the client, and the rest follows it.
    held, let_go = anyio.Event(), anyio.Event()
    deliver = Exchange.deliver

    async def slow_client(self: Exchange, index: int, output: sidecar_pb2.LLMEngineOutput) -> None:
        if self.call.requests[index].request_id.endswith("low") and not held.is_set():
            progress = self.attempts[index].progress.completion_tokens()
            if progress >= 5:
                held.set()
                await let_go.wait()
        await deliver(self, index, output)

    monkeypatch.setattr(Exchange, "deliver", slow_client)
    async with one_worker("vllm", PREEMPT_AFTER) as fe:
        reference = Stream(fe, "vllm", "ref")
        await reference.run()
        low = Stream(fe, "vllm", "low")
        async with anyio.create_task_group() as group:
            group.start_soon(low.run)
            with anyio.fail_after(30):
                await held.wait()
            urgent = later_result(group, post_urgent(fe, "vllm", "high"))
            await until(lambda: preemptions(fe) == 1, "the running request is preempted", secs=30.0)
            let_go.set()
        assert low.status == 200
        assert summary("vllm", low.events) == summary("vllm", reference.events)
        assert urgent[0][0] == 200


def later_result(group: TaskGroup, job: Awaitable[Any]) -> list[Any]:
    """Run ``job`` in ``group``; its result lands in the list returned."""
    results: list[Any] = []

    async def run() -> None:
        results.append(await job)

    group.start_soon(run)
    return results


def every_prompt_generated(fe: FrontendStack, prompts: dict[str, int], tokens: int) -> bool:
    """Whether the engine generated ``tokens`` tokens for each request of ``prompts`` (rid:
    prompt length) so far, whatever reached the frontend."""
    held = {
        rid.rsplit("-", 1)[-1]: sidecar.engine.book.held_tokens(rid) or 0
        for sidecar in fe.sidecars
        for rid in sidecar.engine.book.running_ids()
    }
    return all(held.get(rid, 0) - length >= tokens for rid, length in prompts.items())


async def test_without_the_flag_the_urgent_request_waits_for_the_running_one() -> None:
    async with one_worker("vllm", None) as fe:
        low = Stream(fe, "vllm", "low")
        urgent: list[tuple[int, Any]] = []
        async with anyio.create_task_group() as group:
            group.start_soon(low.run)
            with anyio.fail_after(30):
                await low.started.wait()

            async def send_urgent() -> None:
                urgent.append(await post_urgent(fe, "vllm", "high"))

            group.start_soon(send_urgent)
            await until(lambda: queued(fe) == 1 or low.done.is_set(), "the urgent request queued")
            assert not low.done.is_set()
        assert low.status == 200
        assert len(summary("vllm", low.events)["tokens"]) == MAX_TOKENS
        [(status, _)] = urgent
        assert status == 200
        await until_idle(fe)
        # The running generation finished untouched (it ran for more than a second after the
        # urgent request arrived: preemption, were it on, would have paused it), then the
        # urgent one ran.
        assert preemptions(fe) == 0
        assert engine_outcomes(fe, "-low") == [Outcome.FINISHED]
        assert [rid for rid in ended_order(fe) if rid in ("low", "high")] == ["low", "high"]
