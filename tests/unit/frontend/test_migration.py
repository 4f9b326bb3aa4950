"""Continuation law, on a deterministic engine model: a request whose worker fails at any token
and is continued elsewhere gives the client exactly what an undisturbed run gives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common import prompt_logprobs
from sidecar_common.api import sidecar_pb2
from sidecar_frontend.migration import Finish, Migration, Refusal, RefusalReason

VOCAB = 97
EOS = 2
CONTEXT = 70  # with no max_tokens, prompt + output stop at the context length


def logprob(token: int) -> float:
    return -((token % 7) + 1) / 8.0


@dataclass(frozen=True)
class Shape:
    """How the model engine cuts its stream into chunks (the law must not depend on it)."""

    chunks: tuple[int, ...]


def engine(req: sidecar_pb2.PreprocessedRequest, shape: Shape) -> list[sidecar_pb2.LLMEngineOutput]:
    """A deterministic engine: token i after prompt p is (p[-1] + i + 1) % VOCAB, so its output
    is a function of the prompt alone (like the testkit engines)."""
    stop = req.stop_conditions
    limit = stop.max_tokens if stop.HasField("max_tokens") else CONTEXT - len(req.token_ids)
    tokens: list[int] = []
    last = req.token_ids[-1]
    reason = sidecar_pb2.LENGTH
    while len(tokens) < limit:
        last = (last + 1) % VOCAB
        tokens.append(last)
        if last == EOS and not stop.ignore_eos and len(tokens) >= stop.min_tokens:
            reason = sidecar_pb2.STOP
            break
    outs: list[sidecar_pb2.LLMEngineOutput] = []
    at, cum, sizes = 0, 0.0, list(shape.chunks) or [1]
    k = 0
    while at < len(tokens):
        part = tokens[at : at + sizes[k % len(sizes)]]
        k += 1
        at += len(part)
        cum += sum(logprob(t) for t in part)
        outs.append(
            sidecar_pb2.LLMEngineOutput(
                token_ids=part, log_probs=[logprob(t) for t in part], cum_log_probs=cum
            )
        )
    terminal = outs[-1] if outs else sidecar_pb2.LLMEngineOutput()
    if not outs:
        outs.append(terminal)
    terminal.finish_reason = reason
    prompt = len(req.token_ids)
    terminal.completion_usage.CopyFrom(
        sidecar_pb2.CompletionUsage(
            prompt_tokens=prompt,
            completion_tokens=len(tokens),
            total_tokens=prompt + len(tokens),
            cached_tokens=prompt,
        )
    )
    if req.output_options.HasField("prompt_logprobs"):
        # As a 0.2 sidecar sends them: typed, and in the 0.1 Struct (one per prompt token).
        positions = [sidecar_pb2.TopLogprobs()]
        positions += [
            sidecar_pb2.TopLogprobs(entries=[prompt_logprobs.candidate(t, logprob(t))])
            for t in req.token_ids[1:]
        ]
        prompt_logprobs.attach(terminal, positions, prompt_logprobs.Shape.BY_TOKEN)
    return outs


def request(
    prompt: list[int], max_tokens: int | None, min_tokens: int | None, ignore_eos: bool
) -> sidecar_pb2.PreprocessedRequest:
    req = sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=prompt)
    if max_tokens is not None:
        req.stop_conditions.max_tokens = max_tokens
    if min_tokens is not None:
        req.stop_conditions.min_tokens = min_tokens
    req.stop_conditions.ignore_eos = ignore_eos
    req.stop_conditions.stop_token_ids_hidden.append(EOS)
    req.output_options.prompt_logprobs = 0
    return req


def joined(
    outs: list[sidecar_pb2.LLMEngineOutput],
) -> tuple[list[int], list[float], sidecar_pb2.LLMEngineOutput]:
    toks = [t for o in outs for t in o.token_ids]
    lps = [lp for o in outs for lp in o.log_probs]
    return toks, lps, outs[-1]


requests = st.builds(
    request,
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
    st.one_of(st.none(), st.integers(1, 40)),
    st.one_of(st.none(), st.integers(0, 10)),
    st.booleans(),
)
shapes = st.builds(Shape, st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)))


@settings(max_examples=300, deadline=None)
@given(requests, shapes, shapes, st.data())
def test_a_request_continued_after_failures_equals_the_undisturbed_run(
    req: sidecar_pb2.PreprocessedRequest, shape: Shape, later: Shape, data: st.DataObject
) -> None:
    reference = engine(req, shape)
    migration = Migration(req, limit=3)
    seen: list[sidecar_pb2.LLMEngineOutput] = []
    current = req
    failures = data.draw(st.integers(0, 3))
    for attempt in range(failures + 1):
        outs = engine(current, later if attempt else shape)
        # The worker dies after `cut` outputs, before the terminal (unless it is the last attempt).
        cut = len(outs) if attempt == failures else data.draw(st.integers(0, len(outs) - 1))
        for out in outs[:cut]:
            seen.append(migration.delivered(out))
        if attempt == failures:
            break
        nxt = migration.after_failure(migratable=True)
        if isinstance(nxt, Finish):
            seen.append(migration.delivered(nxt.terminal))
            break
        assert isinstance(nxt, sidecar_pb2.PreprocessedRequest), nxt
        current = nxt
    want_toks, want_lps, want_last = joined(reference)
    got_toks, got_lps, got_last = joined(seen)
    assert got_toks == want_toks
    assert got_lps == pytest.approx(want_lps)
    assert got_last.finish_reason == want_last.finish_reason
    assert got_last.completion_usage.prompt_tokens == want_last.completion_usage.prompt_tokens
    assert got_last.completion_usage.completion_tokens == want_last.completion_usage.completion_tokens
    assert got_last.completion_usage.total_tokens == want_last.completion_usage.total_tokens
    if got_last.HasField("cum_log_probs"):
        assert got_last.cum_log_probs == pytest.approx(want_last.cum_log_probs)
    if got_last.HasField("engine_data"):
        assert got_last.engine_data == want_last.engine_data
    assert list(got_last.prompt_logprobs) == list(want_last.prompt_logprobs)
    assert migration.finished


def test_the_continuation_carries_the_delivered_tokens_and_the_reduced_budgets() -> None:
    req = request([5, 6], max_tokens=10, min_tokens=4, ignore_eos=False)
    req.sampling_options.temperature = 0.5
    req.bootstrap_info.bootstrap_room = 7
    m = Migration(req)
    m.delivered(sidecar_pb2.LLMEngineOutput(token_ids=[7, 8, 9]))
    nxt = m.after_failure(migratable=True)
    assert isinstance(nxt, sidecar_pb2.PreprocessedRequest)
    assert list(nxt.token_ids) == [5, 6, 7, 8, 9]
    assert nxt.stop_conditions.max_tokens == 7
    assert nxt.stop_conditions.min_tokens == 1
    assert nxt.sampling_options.temperature == 0.5
    assert list(nxt.stop_conditions.stop_token_ids_hidden) == [EOS]
    assert nxt.request_id == "r"
    assert not nxt.HasField("bootstrap_info")
    assert m.migrations == 1


def test_absent_budgets_stay_absent_and_min_tokens_never_goes_negative() -> None:
    req = request([5], max_tokens=None, min_tokens=2, ignore_eos=False)
    m = Migration(req)
    m.delivered(sidecar_pb2.LLMEngineOutput(token_ids=[6, 7, 8]))
    nxt = m.after_failure(migratable=True)
    assert isinstance(nxt, sidecar_pb2.PreprocessedRequest)
    assert not nxt.stop_conditions.HasField("max_tokens")
    assert nxt.stop_conditions.HasField("min_tokens")
    assert nxt.stop_conditions.min_tokens == 0


def test_a_failure_after_the_whole_budget_ends_with_length_instead_of_a_new_attempt() -> None:
    req = request([5], max_tokens=2, min_tokens=None, ignore_eos=False)
    m = Migration(req)
    m.delivered(sidecar_pb2.LLMEngineOutput(token_ids=[6, 7]))
    nxt = m.after_failure(migratable=True)
    assert isinstance(nxt, Finish)
    assert nxt.terminal.finish_reason == sidecar_pb2.LENGTH
    assert nxt.terminal.completion_usage.completion_tokens == 2
    assert nxt.terminal.completion_usage.prompt_tokens == 1
    assert not nxt.terminal.token_ids


def _plain(req: sidecar_pb2.PreprocessedRequest) -> None:
    pass


def _guided(req: sidecar_pb2.PreprocessedRequest) -> None:
    req.sampling_options.guided_decoding.regex = "a+"


def _two_choices(req: sidecar_pb2.PreprocessedRequest) -> None:
    req.sampling_options.n = 2


@pytest.mark.parametrize(
    ("setup", "migratable", "reason"),
    [
        (_plain, False, RefusalReason.NOT_MIGRATABLE),
        (_guided, True, RefusalReason.GUIDED_DECODING),
        (_two_choices, True, RefusalReason.MULTIPLE_CHOICES),
    ],
)
def test_requests_that_must_not_move_are_refused_with_the_reason(
    setup: Callable[[sidecar_pb2.PreprocessedRequest], None], migratable: bool, reason: RefusalReason
) -> None:
    req = request([5], max_tokens=8, min_tokens=None, ignore_eos=False)
    setup(req)
    m = Migration(req)
    m.delivered(sidecar_pb2.LLMEngineOutput(token_ids=[6]))
    assert m.after_failure(migratable=migratable) == Refusal(reason)


def test_a_finished_request_is_never_run_again() -> None:
    m = Migration(request([5], max_tokens=8, min_tokens=None, ignore_eos=False))
    m.delivered(sidecar_pb2.LLMEngineOutput(token_ids=[6], finish_reason=sidecar_pb2.STOP))
    assert m.after_failure(migratable=True) == Refusal(RefusalReason.FINISHED)


def test_the_migration_limit_counts_moves() -> None:
    m = Migration(request([5], max_tokens=50, min_tokens=None, ignore_eos=False), limit=2)
    for _ in range(2):
        m.delivered(sidecar_pb2.LLMEngineOutput(token_ids=[6]))
        assert isinstance(m.after_failure(migratable=True), sidecar_pb2.PreprocessedRequest)
    assert m.after_failure(migratable=True) == Refusal(RefusalReason.LIMIT)
    assert m.migrations == 2


def test_a_failure_before_any_token_retries_the_same_request() -> None:
    req = request([5, 6], max_tokens=4, min_tokens=None, ignore_eos=False)
    nxt = Migration(req).after_failure(migratable=True)
    assert isinstance(nxt, sidecar_pb2.PreprocessedRequest)
    assert nxt == req
